"""kvcd_harness.py: what the pytest tests need to run the real kvcd and its real clients.

The Python twin of tests/integration/harness.c: kvcd in a private runtime directory, waited for
through a fake NOTIFY_SOCKET (READY=1, never a sleep), clients as subprocesses, every wait with a
deadline. Binaries come from $KVC_BUILD/bin (default build/bin), the models from ../shared.
"""

import os
import signal
import socket
import subprocess
import tempfile
import threading
import time

DEADLINE_S = 20.0
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def bin_path(name):
    build = os.environ.get("KVC_BUILD", "build")
    return os.path.join(ROOT, build, "bin", name)


class Kvcd:
    """kvcd started with extra arguments; stop() sends SIGTERM and returns its exit status."""

    def __init__(self, extra=()):
        self.root = tempfile.mkdtemp(prefix="kvcd-pytest-")
        self.dir = os.path.join(self.root, "run")
        self.log = os.path.join(self.root, "kvcd.log")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(os.path.join(self.root, "notify"))
        self.start(extra)

    def start(self, extra):
        """Starts kvcd (again, after kill(): same directory, the log appended) and waits for
        READY=1."""
        env = dict(os.environ, NOTIFY_SOCKET=os.path.join(self.root, "notify"))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [bin_path("kvcd"), "--runtime-dir", self.dir, "--log-level", "debug", *extra],
                stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=ROOT)
        deadline = time.monotonic() + DEADLINE_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise TimeoutError("kvcd did not say READY=1: " + self.log_text())
            self.notify.settimeout(min(left, 0.5))  # bounded: also notices kvcd exiting
            try:
                if b"READY=1" in self.notify.recv(4096):
                    return
            except socket.timeout:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("kvcd exited with %d: %s" % (self.proc.returncode, self.log_text()))

    def path(self, name):
        return os.path.join(self.dir, name)

    def log_text(self):
        with open(self.log, "rb") as f:
            return f.read().decode(errors="replace")

    def kill(self):
        """SIGKILL: kvcd dies at once, its sessions with it (no fd store here)."""
        self.proc.kill()
        return self.proc.wait(timeout=DEADLINE_S)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=DEADLINE_S)
        self.notify.close()
        return rc


def kvc_run(kvcd, prompt, *extra):
    """Starts kvc-run on stories260K against kvcd (stdout captured); returns the Popen."""
    return subprocess.Popen(
        [bin_path("kvc-run"), "--socket", kvcd.dir, "-i", prompt, "--json", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)


def finish(proc):
    """Waits for a client (deadline) and returns its stdout; fails unless it exited 0."""
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, err.decode(errors="replace")
    return out.decode()


def wait_stopped(proc):
    """Waits (deadline) until proc stopped itself (SIGSTOP, kvc-run --stop-at)."""
    got = {}

    def waiter():
        got["status"] = os.waitpid(proc.pid, os.WUNTRACED)[1]

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert "status" in got and os.WIFSTOPPED(got["status"]), "the client did not stop itself"


def free_tcp_port():
    """A loopback port nobody listens on now (kvcd binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
