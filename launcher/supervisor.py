"""`tandem serve`: start gateway + prefill + decode as child processes, wait until ready, stop them all.

Each child gets its config on stdin, written once and closed (launcher/handoff.py), its own session
(so a terminal's Ctrl-C reaches only us, and we stop them in order) and PR_SET_PDEATHSIG (so they
die with us even if we are killed with SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One child: `python -m launcher <args>` with `config` on its stdin and `env` as its whole
    environment (which carries the secrets meant for this child alone; both kept out of reprs)."""

    name: str
    args: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    config: str = field(repr=False)
    is_essential: bool = True  # False: when it stops, the stack serves on without it (logged once)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _hand_over(proc: subprocess.Popen, config: str) -> None:
    """Write `config` to the child's stdin and close it. A few KiB fit the pipe's buffer, so this does
    not wait for the child; one that died first is reported by the start-up wait."""
    with contextlib.suppress(BrokenPipeError), proc.stdin as pipe:
        pipe.write(config.encode())


class Supervisor:
    def __init__(
        self, children: list[ChildSpec], health_url: str, startup_timeout_s: float, stop_grace_s: float = 10.0
    ) -> None:
        self.specs = children
        self.stop_grace_s = stop_grace_s
        self.health_url = health_url
        self.startup_timeout_s = startup_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self._stopping = False
        self._gone: set[str] = set()  # children that are not essential and have exited

    def spawn(self) -> None:
        """Start every child; each imports its code, then waits for its config on stdin (`run` sends it).
        A child stopped before then has done nothing a user would see."""
        for spec in self.specs:
            if spec.name not in self.procs:
                self.procs[spec.name] = subprocess.Popen(
                    [sys.executable, "-m", "launcher", *spec.args],
                    env=dict(spec.env),
                    stdin=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )

    def run(self, ready_message: str) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            self.spawn()
            for spec in self.specs:
                _hand_over(self.procs[spec.name], spec.config)
            if not self._wait_ready():
                return 1
            print(ready_message, flush=True)
            return self._watch()
        finally:
            self.stop()

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline and not self._stopping:
            dead = self._dead_child()
            if dead:
                logger.error("%s exited with code %s during start-up", dead, self.procs[dead].returncode)
                return False
            try:
                with urllib.request.urlopen(self.health_url, timeout=2) as reply:
                    if reply.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)  # a local request: polled often, so that "ready" follows the gateway's health at once
        if not self._stopping:
            logger.error("the stack was not ready within %.0f s", self.startup_timeout_s)
        return False

    def _watch(self) -> int:
        while not self._stopping:
            dead = self._dead_child()
            if dead:
                logger.error("%s exited with code %s; stopping the others", dead, self.procs[dead].returncode)
                return 1
            time.sleep(0.5)
        return 0

    def _dead_child(self) -> str | None:
        """An essential child that has exited; a child that is not is logged once, and the stack goes on."""
        for spec in self.specs:
            proc = self.procs.get(spec.name)
            if proc is None or proc.poll() is None:
                continue
            if spec.is_essential:
                return spec.name
            if spec.name not in self._gone:
                self._gone.add(spec.name)
                logger.warning("%s exited with code %s; the others go on without it", spec.name, proc.returncode)
        return None

    def _on_signal(self, signum: int, frame) -> None:
        """The first signal stops the stack (the children drain); a second one is passed on as SIGINT,
        which every child (uvicorn included) takes as "stop now"."""
        if self._stopping:
            self._signal_children(signal.SIGINT)
        self._stopping = True

    def _signal_children(self, signum: int) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    def stop(self) -> None:
        """SIGTERM every essential child, then the others once those are gone (the workers leave the KV store
        while it still answers); SIGKILL whatever outlives `stop_grace_s` (their drain and some)."""
        deadline = time.monotonic() + self.stop_grace_s
        for is_essential in (True, False):
            group = {
                s.name: self.procs[s.name]
                for s in self.specs
                if s.is_essential == is_essential and s.name in self.procs
            }
            for proc in group.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for name, proc in group.items():
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in time; killing it", name)
                    proc.kill()
                    proc.wait()
