"""Two Python processes with the same system prompt share its prefix through kvcd.

Each process is tests/prefix_peer.py, a real client of the test's kvcd: the first computes the
whole prompt and kvcd publishes its whole 16-token blocks; the second, with the same system prompt
and a question of its own, attaches them (nothing recomputed: it appends only the rest), finds in
them exactly the keys it would have computed, and kvcd holds them once (kvcctl status:
shared_blocks unchanged, the second's peak bytes smaller by shared_bytes). When both are gone
nothing is left and the audit is clean. The processes are driven through their stdin and stdout:
no sleeps.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from typing import Any, Dict, List

import kvcd.admin
from conftest import DEADLINE_S

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEM = list(range(500, 540))  # 40 tokens: two whole blocks of 16 shared, 8 more in a partial block
BLOCK = 16


class Peer:
    """One prefix_peer.py process."""

    def __init__(self, sock: str, ids: List[int]) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "prefix_peer.py"), sock,
                                      *map(str, ids)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def read(self) -> Dict[str, Any]:
        ready, _, _ = select.select([self.proc.stdout], [], [], DEADLINE_S)
        assert ready, "the peer printed nothing in time"
        line = self.proc.stdout.readline()
        assert line, f"the peer exited {self.proc.wait()}"
        return json.loads(line)

    def finish(self) -> Dict[str, Any]:
        self.proc.stdin.write("close\n")
        self.proc.stdin.flush()
        out = self.read()
        assert self.proc.wait(timeout=DEADLINE_S) == 0
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def test_two_processes_with_one_system_prompt_hold_its_prefix_once(kvcd_daemon):
    admin = kvcd.admin.Admin(kvcd_daemon.dir)
    assert admin.status()["shared_blocks"] == 0
    first = Peer(kvcd_daemon.dir, SYSTEM + [7, 8, 9, 10])
    second = None
    try:
        opened = first.read()
        assert opened["shared_tokens"] == 0  # nobody published this prompt yet
        assert first.read()["stored"] == len(SYSTEM) + 4
        st = admin.status()
        blocks, shared_bytes = st["shared_blocks"], st["shared_bytes"]
        assert blocks > 0 and shared_bytes > 0

        second = Peer(kvcd_daemon.dir, SYSTEM + [11, 12, 13, 14])  # same system prompt, its own question
        opened = second.read()
        assert opened["shared_tokens"] == len(SYSTEM) // BLOCK * BLOCK
        assert opened["attached_ok"], "the attached blocks hold other keys than the second process computes"
        assert second.read()["stored"] == len(SYSTEM) + 4
        assert admin.status()["shared_blocks"] == blocks  # once, for both processes
        rows = {r["id"]: r for r in admin.sessions()}
        assert opened["session"] in rows

        b = second.finish()
        a = first.finish()
        assert b["peak_bytes"] == a["peak_bytes"] - shared_bytes  # the second held no copy of the prefix
    finally:
        for p in (first, second):
            if p is not None:
                p.kill()
    st = admin.status()
    assert st["shared_blocks"] == 0 and st["used_bytes"] == 0
    assert admin.audit()["clean"]
