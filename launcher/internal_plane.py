"""The internal plane's flags: the shared token, mTLS files, --insecure, and `tandem internal-token`.

The token comes from --internal-token, else --internal-token-file, else the environment
(TANDEM_INTERNAL_TOKEN, then TANDEM_INTERNAL_TOKEN_FILE), read here and nowhere else. `tandem
serve` makes one for its children when none is given and hands it down by environment, never on
a command line. A worker or gateway run alone with no token refuses to open the plane beyond
loopback unless --insecure says so.
"""

from __future__ import annotations

import argparse
import logging
import os

from tandem.internal_auth import InternalCredentials, generate_token, host_of, is_loopback_host, read_token_file, \
    write_token_file

logger = logging.getLogger(__name__)

TOKEN_ENV = "TANDEM_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "TANDEM_INTERNAL_TOKEN_FILE"


def add_internal_plane_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("internal plane (gateway <-> workers)")
    group.add_argument("--internal-token", default=None,
                       help=f"the secret every worker RPC must carry (default: ${TOKEN_ENV}); prefer "
                            f"--internal-token-file or the environment, which `ps` does not show")
    group.add_argument("--internal-token-file", default=None,
                       help=f"read the internal token from this file (default: ${TOKEN_FILE_ENV}); "
                            f"`tandem internal-token --file PATH` writes one")
    group.add_argument("--tls-cert", default=None, help="PEM certificate chain: the worker gRPC port (or the "
                                                         "gateway's calls to it) use TLS")
    group.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    group.add_argument("--tls-ca", default=None, help="PEM CA that signs every peer: with it, TLS is mutual "
                                                       "(workers refuse callers without a certificate it signed)")
    group.add_argument("--insecure", action="store_true",
                       help="allow an unauthenticated internal plane on a non-loopback address (anyone who "
                            "reaches the port can reserve pages, abort requests and load weights)")


def add_internal_token_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file", required=True, help="where to write the token (mode 0600); kept if it holds one")


def run_internal_token(args: argparse.Namespace) -> int:
    """`tandem internal-token --file PATH`, for init containers and compose one-shot services."""
    wrote = write_token_file(args.file)
    print(f"{'wrote a new' if wrote else 'kept the'} internal token in {args.file}")
    return 0


def credentials_from_args(args: argparse.Namespace) -> InternalCredentials:
    """The flags' credentials (the environment filling in the token); SystemExit on a bad file."""
    token = args.internal_token or os.environ.get(TOKEN_ENV) or None
    token_file = args.internal_token_file or os.environ.get(TOKEN_FILE_ENV) or None
    try:
        if token is None and token_file is not None:
            token = read_token_file(token_file)
        return InternalCredentials(token=token, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"internal plane: {exc}") from None


def ensure_serve_token(args: argparse.Namespace) -> None:
    """`tandem serve`: the children's token, by environment; a fresh one when none was given."""
    credentials = credentials_from_args(args)
    os.environ[TOKEN_ENV] = credentials.token or generate_token()
    os.environ.pop(TOKEN_FILE_ENV, None)


def check_open_plane(credentials: InternalCredentials, hosts: list[str], insecure: bool, what: str) -> None:
    """Refuse an open plane (no token, no mTLS) on any non-loopback host unless --insecure."""
    if not credentials.is_open:
        return
    exposed = [h for h in hosts if not is_loopback_host(host_of(h))]
    if not exposed:
        return
    if not insecure:
        raise SystemExit(f"{what} {', '.join(exposed)} is not loopback and no internal token is set: pass "
                         f"--internal-token-file (or ${TOKEN_ENV}), or --insecure to run an open plane anyway")
    logger.warning("INSECURE: %s %s without an internal token: anyone who reaches it can reserve pages, abort "
                   "requests, overwrite KV and load weights (--insecure)", what, ", ".join(exposed))
