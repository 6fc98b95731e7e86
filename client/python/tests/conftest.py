"""Fixtures of the binding's tests: a real kvcd from the build tree ($KVC_BUILD/bin/kvcd, default
build/), in a private runtime directory, waited for through a NOTIFY_SOCKET of our own (READY=1,
never a sleep), as tests/integration/harness.c does for the C tests.

``kvcd_daemon`` is one kvcd for the module (most tests share it and leave it as they found it);
``start_kvcd`` starts extra ones with flags of their own (a small pool, a kvcd to kill), each
stopped at the end of its test. Every wait here has a deadline.
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Callable, Iterator, List, Optional

import pytest

DEADLINE_S = 20.0
BUILD = os.environ.get("KVC_BUILD", "build")


def _bin(name: str) -> str:
    return os.path.join(BUILD, "bin", name)


def _die_with_parent() -> None:
    """In the child before exec: kvcd gets SIGTERM when the test process dies (a crash in a test
    skips the fixture's teardown, and kvcd would outlive the run)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Daemon:
    """One kvcd: ``dir`` its runtime directory, ``proc`` the process, ``log`` its stderr."""

    def __init__(self, extra: Optional[List[str]] = None) -> None:
        self.root = tempfile.mkdtemp(prefix="kvcd-py-")
        self.dir = os.path.join(self.root, "run")
        self.log = os.path.join(self.root, "kvcd.log")
        notify_path = os.path.join(self.root, "notify")
        ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        ns.bind(notify_path)
        env = dict(os.environ, NOTIFY_SOCKET=notify_path)
        env.pop("KVC_SOCKET", None)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [_bin("kvcd"), "--runtime-dir", self.dir, "--log-level", "debug", *(extra or [])],
                stdout=subprocess.DEVNULL, stderr=log, env=env, preexec_fn=_die_with_parent)
        try:
            self._wait_ready(ns)
        finally:
            ns.close()  # kvcd's later notifications (STATUS=) then go nowhere, harmlessly
            os.unlink(notify_path)

    def _wait_ready(self, ns: socket.socket) -> None:
        pidfd = os.pidfd_open(self.proc.pid)
        try:
            end = time.monotonic() + DEADLINE_S
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"kvcd sent no READY=1 within {DEADLINE_S} s: {self.log_text()}")
                ready, _, _ = select.select([ns, pidfd], [], [], left)
                if ns in ready and b"READY=1" in ns.recv(4096):
                    return
                if pidfd in ready:
                    self.proc.wait()
                    raise RuntimeError(f"kvcd exited {self.proc.returncode} before READY: {self.log_text()}")
        finally:
            os.close(pidfd)

    def log_text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self) -> int:
        """SIGTERM and wait (deadline); kvcd's exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=DEADLINE_S)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=DEADLINE_S)

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def kvcd_daemon() -> Iterator[Daemon]:
    d = Daemon()
    yield d
    rc = d.stop()
    d.cleanup()
    assert rc == 0, "kvcd did not stop cleanly on SIGTERM"


@pytest.fixture
def start_kvcd() -> Iterator[Callable[..., Daemon]]:
    started: List[Daemon] = []

    def start(*extra: str) -> Daemon:
        d = Daemon(list(extra))
        started.append(d)
        return d

    yield start
    for d in started:
        d.cleanup()
