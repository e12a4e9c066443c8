"""The internal plane's flags: the shared token, the workers' KV grant secret, mTLS files, --insecure,
and `tandem internal-token`.

The token comes from --internal-token, else --internal-token-file, else the environment
(TANDEM_INTERNAL_TOKEN, then TANDEM_INTERNAL_TOKEN_FILE), read here (a child of `tandem serve` reads
its own in launcher/handoff.py). The KV grant secret, which keys the grants of KV writes
(server_runtime/kv_grants.py), is the workers' alone: the gateway holds the token but never this
secret, so it cannot forge a grant. It comes from --kv-grant-secret-file, else TANDEM_KV_GRANT_SECRET,
then TANDEM_KV_GRANT_SECRET_FILE. `tandem serve` makes a token for its three children when none is
given, and a fresh grant secret for its two workers, and hands them down by environment
(launcher/handoff.py), never on a command line. A worker or gateway run alone with no token refuses
to open the plane beyond loopback unless --insecure says so; a worker with a token but no grant secret
refuses to start.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from tandem.internal_auth import (
    MIN_TOKEN_LEN,
    InternalCredentials,
    generate_token,
    host_of,
    is_loopback_host,
    read_token_file,
    write_token_file,
)

logger = logging.getLogger(__name__)

TOKEN_ENV = "TANDEM_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "TANDEM_INTERNAL_TOKEN_FILE"
GRANT_SECRET_ENV = "TANDEM_KV_GRANT_SECRET"
GRANT_SECRET_FILE_ENV = "TANDEM_KV_GRANT_SECRET_FILE"


def add_internal_plane_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("internal plane (gateway <-> workers)")
    group.add_argument(
        "--internal-token",
        default=None,
        help=f"the secret every worker RPC must carry (default: ${TOKEN_ENV}); prefer "
        f"--internal-token-file or the environment, which `ps` does not show",
    )
    group.add_argument(
        "--internal-token-file",
        default=None,
        help=f"read the internal token from this file (default: ${TOKEN_FILE_ENV}); "
        f"`tandem internal-token --file PATH` writes one",
    )
    group.add_argument(
        "--tls-cert",
        default=None,
        help="PEM certificate chain: the worker gRPC port (or the gateway's calls to it) use TLS",
    )
    group.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    group.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA that signs every peer: with it, TLS is mutual "
        "(workers refuse callers without a certificate it signed)",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="allow an unauthenticated internal plane on a non-loopback address (anyone who "
        "reaches the port can reserve pages, abort requests and load weights)",
    )


def add_kv_grant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-grant-secret-file",
        default=None,
        help=f"the secret that keys KV write grants (default: ${GRANT_SECRET_ENV}, then "
        f"${GRANT_SECRET_FILE_ENV}): the prefill and decode workers need the same one, the gateway "
        f"none; required with an internal token or mTLS. `tandem internal-token --file PATH` "
        f"writes one",
    )


def add_internal_token_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file", required=True, help="where to write the token (mode 0600); kept if it holds one")


def run_internal_token(args: argparse.Namespace) -> int:
    """`tandem internal-token --file PATH`, for init containers and compose one-shot services."""
    wrote = write_token_file(args.file)
    print(f"{'wrote a new' if wrote else 'kept the'} internal token in {args.file}")
    return 0


def _read_secret(value: str | None, path: str | None, env: str, file_env: str, what: str) -> str | None:
    """The flag's value, else the flag's file, else the environment's value, else its file; None when
    none is set. OSError or ValueError on a file that cannot be read or is empty."""
    if value:
        return value
    if path:
        return read_token_file(path, what)
    if os.environ.get(env):
        return os.environ[env]
    if os.environ.get(file_env):
        return read_token_file(os.environ[file_env], what)
    return None


def credentials_from_args(args: argparse.Namespace) -> InternalCredentials:
    """The flags' credentials (the environment filling in the token); SystemExit on a bad file."""
    try:
        token = _read_secret(args.internal_token, args.internal_token_file, TOKEN_ENV, TOKEN_FILE_ENV, "internal token")
        return InternalCredentials(token=token, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"internal plane: {exc}") from None


def kv_grant_secret_from_args(args: argparse.Namespace, credentials: InternalCredentials) -> str | None:
    """A worker's KV grant secret (None on an open plane without one). SystemExit when the plane is
    closed (token or mTLS) and there is none, when it is short, or when it is the internal token:
    a grant key the token gives would let any token holder, the gateway included, forge grants."""
    try:
        secret = _read_secret(
            None, args.kv_grant_secret_file, GRANT_SECRET_ENV, GRANT_SECRET_FILE_ENV, "KV grant secret"
        )
    except (OSError, ValueError) as exc:
        raise SystemExit(f"internal plane: {exc}") from None
    if secret is None and not credentials.is_open:
        raise SystemExit(
            f"tandem {args.command}: the internal plane is closed but no KV grant secret is set: pass "
            f"--kv-grant-secret-file (or ${GRANT_SECRET_ENV}), the same secret to the prefill and the "
            f"decode workers and none to the gateway. A grant key derived from the internal token "
            f"would let the gateway forge KV writes"
        )
    if secret is not None and len(secret) < MIN_TOKEN_LEN:
        raise SystemExit(f"internal plane: the KV grant secret must be at least {MIN_TOKEN_LEN} characters")
    if secret is not None and secret == credentials.token:
        raise SystemExit(
            "internal plane: the KV grant secret must differ from the internal token, which the gateway holds"
        )
    return secret


def serve_credentials(args: argparse.Namespace) -> InternalCredentials:
    """`tandem serve`: its children's credentials, with a fresh token when none was given."""
    credentials = credentials_from_args(args)
    return credentials if credentials.token else dataclasses.replace(credentials, token=generate_token())


def check_open_plane(credentials: InternalCredentials, hosts: list[str], insecure: bool, what: str) -> None:
    """Refuse an open plane (no token, no mTLS) on any non-loopback host unless --insecure."""
    if not credentials.is_open:
        return
    exposed = [h for h in hosts if not is_loopback_host(host_of(h))]
    if not exposed:
        return
    if not insecure:
        raise SystemExit(
            f"{what} {', '.join(exposed)} is not loopback and no internal token is set: pass "
            f"--internal-token-file (or ${TOKEN_ENV}), or --insecure to run an open plane anyway"
        )
    logger.warning(
        "INSECURE: %s %s without an internal token: anyone who reaches it can reserve pages, abort "
        "requests, overwrite KV and load weights (--insecure)",
        what,
        ", ".join(exposed),
    )
