"""kvcd.admin: what kvcctl does, from Python: status, sessions, budgets, evict, drain, audit,
metrics, events, returning the dicts ``kvcctl --json`` prints (the same keys, by construction).

It runs kvcctl. The admin wire (ZeroMQ + protobuf on kvcd.admin.sock) is kvcctl's, not libkvc's:
speaking it from Python would need pyzmq, a protobuf runtime and code generated from kvc.proto,
and a second implementation of the JSON kvcctl already defines (and its tests pin). One process
per call costs a few milliseconds, which is nothing next to what an operator's call does.
kvcctl's own rules apply unchanged: where it finds kvcd, its --timeout, its exit codes.

Errors: kvcctl --json reports a failure as {"error": {"code", "name", "message"}}; that becomes
the KvcError subclass of the errno (kvcd.errors), the exit code kept as ``exit_code``. The
outcomes kvcctl reports with a non-zero exit but a normal document are returned, not raised:
audit with a mismatch (exit 1, "clean": false), drain with sessions left (exit 5,
"timed_out": true), events with fewer than count in the timeout (exit 5).

Where kvcctl is: ``kvcctl=`` or $KVCCTL; else the bin/ beside the lib/ that libkvc was loaded
from (the build tree, or an install prefix); else $PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any, Dict, List, Optional

from . import _lib
from .errors import KvcError, error_for

EXIT_REFUSED = 1
EXIT_TIMEDOUT = 5


def _loaded_library_dir() -> Optional[str]:
    """The directory of the libkvc this process mapped (from /proc/self/maps), if any."""
    try:
        _lib.load()
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1]
                if "/libkvc.so" in path:
                    return os.path.dirname(os.path.realpath(path))
    except (OSError, ImportError):
        pass
    return None


def find_kvcctl() -> str:
    """The kvcctl this module runs; KvcError(ENOENT) when there is none."""
    env = os.environ.get("KVCCTL")
    if env:
        return env
    libdir = _loaded_library_dir()
    if libdir:
        cand = os.path.join(os.path.dirname(libdir), "bin", "kvcctl")
        if os.access(cand, os.X_OK):
            return cand
    found = shutil.which("kvcctl")
    if found:
        return found
    raise error_for(2, "kvcctl not found: set $KVCCTL, or put it on $PATH")


class Admin:
    """kvcd's admin interface at ``socket`` (its runtime directory or kvcd.admin.sock; a
    kvcd.sock path means its directory; None: kvcctl's own search), ``timeout_ms`` the wait for
    each answer (None: kvcctl's 5000)."""

    def __init__(self, socket: Optional[str] = None, timeout_ms: Optional[int] = None,
                 kvcctl: Optional[str] = None) -> None:
        if socket and os.path.basename(socket) == "kvcd.sock":
            socket = os.path.dirname(socket) or "."
        self.socket = socket
        self.timeout_ms = timeout_ms
        self.kvcctl = kvcctl or find_kvcctl()

    def _run(self, *verb: str, ok: tuple = (0,), timeout_ms: Optional[int] = None,
             lines: bool = False) -> Any:
        argv = [self.kvcctl, "--json"]
        if self.socket:
            argv += ["--socket", self.socket]
        t = timeout_ms if timeout_ms is not None else self.timeout_ms
        if t is not None:
            argv += ["--timeout", str(t)]
        argv += list(verb)
        # kvcctl bounds its own waits (--timeout); this one only guards against a kvcctl that hangs
        limit = (t if t is not None else 5000) / 1000.0 + 30
        try:
            p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=limit)
        except subprocess.TimeoutExpired as e:
            raise error_for(110, f"kvcctl {' '.join(verb)} did not finish in {limit:.0f} s") from e
        docs = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
        if docs and isinstance(docs[-1], dict) and "error" in docs[-1]:
            e = docs[-1]["error"]
            err = error_for(int(e.get("code", 0)), e.get("message", ""), e.get("name"))
            err.exit_code = p.returncode  # type: ignore[attr-defined]
            raise err
        if p.returncode not in ok:
            err = KvcError(0, f"kvcctl {' '.join(verb)} exited {p.returncode}: {p.stderr.strip()}", "E?")
            err.exit_code = p.returncode  # type: ignore[attr-defined]
            raise err
        if lines:
            return docs
        if len(docs) != 1:
            raise KvcError(71, f"kvcctl {' '.join(verb)} printed {len(docs)} documents", "EPROTO")
        return docs[0]

    def status(self) -> Dict[str, Any]:
        """kvcctl status: the pool, tenants, kvcd's memory and counters."""
        return self._run("status")

    def sessions(self) -> List[Dict[str, Any]]:
        """kvcctl sessions: one dict per session ("id", "pid", "client", "policy", "tokens", ...)."""
        return self._run("sessions")

    def budgets(self) -> Dict[str, Any]:
        """kvcctl budget get: the capacity and the tenants' quotas."""
        return self._run("budget", "get")

    def set_budget(self, capacity: Optional[int] = None, tenant: Optional[str] = None,
                   quota: Optional[int] = None, uid: Optional[int] = None, gid: Optional[int] = None,
                   session: Optional[int] = None, min_bytes: Optional[int] = None,
                   max_bytes: Optional[int] = None, priority: Optional[int] = None) -> Dict[str, Any]:
        """kvcctl budget set: the same combinations kvcctl takes; returns the budgets after."""
        args = ["budget", "set"]
        for flag, val in (("--capacity", capacity), ("--tenant", tenant), ("--quota", quota), ("--uid", uid),
                          ("--gid", gid), ("--session", session), ("--min", min_bytes), ("--max", max_bytes),
                          ("--priority", priority)):
            if val is not None:
                args += [flag, str(val)]
        return self._run(*args)

    def evict(self, session_id: int) -> Dict[str, Any]:
        """kvcctl evict: closes the session; its client is told (ESHUTDOWN on its next call)."""
        return self._run("evict", str(int(session_id)))

    def drain(self, timeout_s: Optional[float] = None, resume: bool = False) -> Dict[str, Any]:
        """kvcctl drain: refuse new sessions and wait up to timeout_s for the open ones to end
        ("timed_out" says whether some were left); resume=True admits sessions again."""
        args = ["drain"]
        if resume:
            args.append("--resume")
        if timeout_s is not None:
            args += ["--timeout", f"{timeout_s:g}"]
        return self._run(*args, ok=(0, EXIT_TIMEDOUT))

    def audit(self) -> Dict[str, Any]:
        """kvcctl audit: kvcd recomputes its accounting; "clean" is False on a mismatch."""
        return self._run("audit", ok=(0, EXIT_REFUSED))

    def metrics(self) -> Dict[str, Any]:
        """kvcctl metrics: {"text": the Prometheus exposition}."""
        return self._run("metrics")

    def events(self, count: Optional[int] = None, timeout_ms: int = 1000) -> List[Dict[str, Any]]:
        """kvcctl events: the KV events (prefix blocks stored and removed) published from now on
        until ``count`` arrived or ``timeout_ms`` passed."""
        args = ["events"]
        if count is not None:
            args += ["--count", str(int(count))]
        return self._run(*args, ok=(0, EXIT_TIMEDOUT), timeout_ms=timeout_ms, lines=True)


def status(socket: Optional[str] = None) -> Dict[str, Any]:
    """Admin(socket).status()."""
    return Admin(socket).status()


def sessions(socket: Optional[str] = None) -> List[Dict[str, Any]]:
    """Admin(socket).sessions()."""
    return Admin(socket).sessions()


def audit(socket: Optional[str] = None) -> Dict[str, Any]:
    """Admin(socket).audit()."""
    return Admin(socket).audit()
