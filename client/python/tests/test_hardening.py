"""Issue 28's client-side findings against the Python binding, each a test that failed on the code
before its fix: stale layer views (item 5), numbers and strings passed on silently (item 10),
requests too large for kvcd (item 6) and the admin socket's owner (item 11).

A test whose failure on the old code was a crash (SIGSEGV) runs its body in a child interpreter,
so the old code fails the test instead of killing pytest.
"""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

import kvcd
import kvcd.admin
from conftest import DEADLINE_S

G = kvcd.Geometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_tokens=256)


@pytest.fixture
def client(kvcd_daemon):
    with kvcd.connect(kvcd_daemon.dir, name="pytest-hardening") as c:
        yield c


@pytest.fixture
def admin(kvcd_daemon):
    return kvcd.admin.Admin(kvcd_daemon.dir)


def ones(value):
    return np.full((2, 8), value, np.float32), np.zeros((2, 8), np.float32)


# --- item 5: stale layer views ------------------------------------------------------------

STALE_AFTER_CLIENT_CLOSE = r"""
import sys
import numpy as np
import kvcd
c = kvcd.connect(sys.argv[1], name="stale")
s = c.open_session(kvcd.Geometry(1, 4, 2, 8, 256))
s.append(0, 0, np.full((2, 8), 3.0, np.float32), np.zeros((2, 8), np.float32))
view = s.layer_view(0)
keys = view.blocks[0].keys
c.close()
try:
    s.layer_tokens(0)
    sys.exit("a call on a session of a closed client passed")
except kvcd.KvcInvalid:
    pass
assert keys[0, 0, 0] == 3.0, keys[0, 0, 0]
keys[0, 0, 1] = 5.0
assert view.blocks[0].pos[0, 0] == 0
print("ok")
"""


def test_a_layer_view_read_and_written_after_its_client_closed_does_not_crash(kvcd_daemon):
    p = subprocess.run([sys.executable, "-c", STALE_AFTER_CLIENT_CLOSE, kvcd_daemon.dir], capture_output=True,
                       text=True, timeout=DEADLINE_S)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stdout, p.stderr)


def test_a_closed_sessions_view_keeps_its_blocks_from_the_next_session(client, admin):
    s = client.open_session(G)
    s.append(0, 0, *ones(3.0))
    sid = s.id
    keys = s.layer_view(0).blocks[0].keys
    assert s.close() is None  # deferred: an array of its view is alive
    assert s.closed and client.sessions == []
    with pytest.raises(kvcd.KvcInvalid):
        s.layer_tokens(0)
    assert any(r["id"] == sid for r in admin.sessions())  # kept in kvcd for the array
    with client.open_session(G) as s2:  # takes blocks of the client's chunk: not that one
        for t in range(64):
            s2.append(0, t, *ones(7.0))
            s2.append(1, t, *ones(7.0))
        assert keys[0, 0, 0] == 3.0
    del keys
    gc.collect()
    assert all(r["id"] != sid for r in admin.sessions())
    assert s.closed and s.close() is not None  # kvcd's final accounting, now it came


def test_a_closed_clients_views_keep_the_connection_until_they_go(kvcd_daemon, admin):
    c = kvcd.connect(kvcd_daemon.dir, name="pinned")
    kept, other = c.open_session(G), c.open_session(G)
    kept.append(1, 0, *ones(2.0))
    ids = kept.id, other.id
    block = kept.layer_view(1).blocks[0]
    c.close()
    assert c.closed and kept.closed and other.closed
    live = {r["id"] for r in admin.sessions()}
    assert ids[0] in live and ids[1] not in live  # the one without views is closed at once
    assert block.keys[1, 0, 0] == 2.0
    del block
    gc.collect()
    assert not {r["id"] for r in admin.sessions()} & set(ids)
    c.close()


# --- item 6: requests kvcd would refuse for their size --------------------------------------


def test_a_request_too_large_for_kvcd_is_refused_at_once_by_libkvc(kvcd_daemon):
    # a timeout longer than the test's deadline: the old libkvc sent these and waited for it
    with kvcd.connect(kvcd_daemon.dir, name="big", timeout_ms=int(DEADLINE_S * 1000) * 3) as c:
        with pytest.raises(kvcd.KvcMessageSize) as e:
            c.open_session(G, policy="x" * (1 << 20))
        assert "at most 65536" in str(e.value)
        with pytest.raises(kvcd.KvcMessageSize):
            c.open_session(G, prompt_token_ids=range(10**6))
        with pytest.raises(kvcd.KvcMessageSize):
            c.open_session(G, model_id="m" * (1 << 17), prompt_token_ids=range(16), share_prefix=True)
        with c.open_session(G) as s:  # the connection is as good as before
            s.append(0, 0, *ones(1.0))
            assert s.layer_tokens(0) == 1


# --- item 10: numbers and strings checked at the boundary -----------------------------------


@pytest.mark.parametrize("kwargs", [
    {"budget": 2**64}, {"budget": 2**32}, {"budget": -1},
    {"max_bytes": 2**70}, {"min_bytes": -1}, {"priority": 2**40}, {"priority": -(2**31) - 1},
    {"prompt_tokens": 2**32}, {"prompt_token_ids": [2**40]}, {"prompt_token_ids": [-1]},
    {"policy": "full\0x"}, {"tenant": "a\0b"}, {"model_id": "m\0"}, {"params": {"tau\0": 1}},
    {"params": {"tau": "0.5\0"}},
])
def test_a_number_out_of_range_or_a_string_with_a_nul_is_invalid(client, kwargs):
    with pytest.raises(kvcd.KvcInvalid):
        client.open_session(G, **kwargs)
    assert client.sessions == []


@pytest.mark.parametrize("kwargs", [
    {"budget": 1.5}, {"budget": "16"}, {"budget": True}, {"max_bytes": 1e9}, {"priority": None},
    {"prompt_token_ids": [1.7, 2.2]}, {"prompt_token_ids": np.array([1.0, 2.0])},
    {"prompt_token_ids": "abc"}, {"prompt_token_ids": 5},
    {"policy": 5}, {"policy": b"full"}, {"policy": None}, {"tenant": 3}, {"params": [("tau", 1)]},
    {"params": {"tau": None}}, {"params": {1: 2}},
])
def test_a_value_of_the_wrong_type_is_a_dtype_error(client, kwargs):
    with pytest.raises(kvcd.KvcDtypeError):
        client.open_session(G, **kwargs)
    assert client.sessions == []


def test_the_session_and_client_calls_check_their_numbers(kvcd_daemon, client):
    with pytest.raises(kvcd.KvcDtypeError):
        client.open_session("a geometry")
    with client.open_session(G, policy="window", budget=32) as s:
        with pytest.raises(kvcd.KvcInvalid):
            s.reserve(2**40)  # was reserve(0)
        with pytest.raises(kvcd.KvcDtypeError):
            s.reserve(1.5)
        with pytest.raises(kvcd.KvcInvalid):
            s.append_slots(0, 2**32)
        with pytest.raises(kvcd.KvcDtypeError):
            s.append(0, 0.7, *ones(1.0))  # a float position was truncated to 0
        with pytest.raises(kvcd.KvcDtypeError):
            s.append(0, [0.0, 1.0], *(np.zeros((2, 2, 8), np.float32),) * 2)
        with pytest.raises(kvcd.KvcInvalid):
            s.gather(0, first=-1)
        assert s.layer_tokens(0) == 0
        s.append(0, np.int64(0), *ones(1.0))
        assert s.layer_tokens(0) == 1
    with pytest.raises(kvcd.KvcInvalid):
        client.poll(2**31)
    with pytest.raises(kvcd.KvcDtypeError):
        kvcd.connect(kvcd_daemon.dir, name=7)
    with pytest.raises(kvcd.KvcInvalid):
        kvcd.connect(kvcd_daemon.dir, timeout_ms=2**31)
    with pytest.raises(kvcd.KvcInvalid):
        kvcd.connect(kvcd_daemon.dir + "\0x")
    with client.open_session(G, prompt_token_ids=np.arange(20, dtype=np.uint16), policy="window",
                            budget=np.uint32(64)) as s:
        assert s.budget == 64


# --- item 11: the admin socket's owner ------------------------------------------------------


def test_admin_refuses_an_admin_socket_kvcds_user_does_not_serve(kvcd_daemon, monkeypatch):
    assert kvcd.admin.Admin(kvcd_daemon.dir).status()["sessions"] >= 0
    monkeypatch.setenv("KVC_DAEMON_UID", "65534")  # kvcd here runs as us (root): not that user
    with pytest.raises(kvcd.KvcNotPermitted) as e:
        kvcd.admin.Admin(kvcd_daemon.dir).status()
    assert "served by uid" in str(e.value)
