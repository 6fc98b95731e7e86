"""The kvcd package against a real kvcd: every call of the binding, every error class, numpy dtype
and shape refusals, a session that dies with its process, and no leaks over 1,000 cycles.

Each test reads as the sentence its name says. Waits are on events with deadlines (a poll that
answers, kvcctl's view changing), never sleeps.
"""

from __future__ import annotations

import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

import kvcd
import kvcd.admin
from conftest import DEADLINE_S

G = kvcd.Geometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_tokens=256)


def kv(rng, n=None, g=G):
    shape = (g.n_kv_heads, g.head_dim) if n is None else (n, g.n_kv_heads, g.head_dim)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


def ref_attention(keys, values, q, n_heads):
    """Decode attention in numpy: keys/values [n_kv_heads, n, d], q [n_heads, d]."""
    h_kv, _, d = keys.shape
    group = n_heads // h_kv
    out = np.empty_like(q)
    for h in range(n_heads):
        s = keys[h // group] @ q[h] / math.sqrt(d)
        w = np.exp(s - s.max())
        w /= w.sum()
        out[h] = w @ values[h // group]
    return out


@pytest.fixture
def client(kvcd_daemon):
    with kvcd.connect(kvcd_daemon.dir, name="pytest") as c:
        yield c


@pytest.fixture
def admin(kvcd_daemon):
    return kvcd.admin.Admin(kvcd_daemon.dir)


def wait_until(pred, what, deadline_s=DEADLINE_S):
    """Calls pred (each call a round trip to kvcd) until it is true; fails after the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
    pytest.fail(f"{what}: not within {deadline_s} s")


# --- connecting ---------------------------------------------------------------------------


def test_connect_is_a_context_manager_that_closes_its_sessions(kvcd_daemon, admin):
    with kvcd.connect(kvcd_daemon.dir, name="ctx") as c:
        assert not c.closed and not c.is_device and c.pool_device == -1
        s = c.open_session(G)
        assert c.sessions == [s]
        assert any(r["id"] == s.id and r["client"] == "ctx" for r in admin.sessions())
    assert c.closed and s.closed
    assert s.close() is None  # closing again (the client closed it) does nothing
    with pytest.raises(kvcd.KvcInvalid):
        s.append(0, 0, *kv(np.random.default_rng(0)))
    with pytest.raises(kvcd.KvcInvalid):
        c.open_session(G)
    c.close()  # twice is fine
    assert not [r for r in admin.sessions() if r["client"] == "ctx"]


def test_connect_to_an_empty_directory_is_not_found():
    with tempfile.TemporaryDirectory() as d:
        with pytest.raises(kvcd.KvcNotFound) as e:
            kvcd.connect(d)
    assert e.value.errno_name == "ENOENT" and e.value.message


def test_default_runtime_dir_follows_kvc_socket(monkeypatch):
    monkeypatch.setenv("KVC_SOCKET", "/tmp/some-kvcd")
    assert kvcd.default_runtime_dir() == "/tmp/some-kvcd"


@pytest.mark.skipif("KVC_LIBRARY" not in os.environ, reason="tests/python/binding.sh sets it")
def test_library_comes_from_kvc_library():
    from kvcd import _lib

    assert _lib.path() == os.environ["KVC_LIBRARY"]


def test_a_kvc_library_that_does_not_exist_is_an_error_not_a_fallback(tmp_path):
    env = dict(os.environ, KVC_LIBRARY=str(tmp_path / "libkvc.so.0"))
    code = "import kvcd\ntry:\n    kvcd.default_runtime_dir()\nexcept kvcd.LibraryNotFound as e:\n    print(e)"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert "does not exist" in p.stdout, p.stdout + p.stderr


# --- append, attend, views ----------------------------------------------------------------


def test_attend_is_the_softmax_attention_over_what_was_appended(client):
    rng = np.random.default_rng(1)
    n = 37  # three blocks, the last one partial
    with client.open_session(G) as s:
        k, v = kv(rng, n)
        for layer in range(G.n_layers):
            s.append(layer, 0, k, v)  # n tokens at positions 0..n-1
        assert [s.layer_tokens(l) for l in range(G.n_layers)] == [n, n]
        q = rng.standard_normal((G.n_heads, G.head_dim), dtype=np.float32)
        out = s.attend(1, q)
        ref = ref_attention(k.transpose(1, 0, 2), v.transpose(1, 0, 2), q, G.n_heads)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
        flat = np.empty(G.n_heads * G.head_dim, np.float32)
        assert s.attend(1, q.reshape(-1), out=flat) is flat
        np.testing.assert_allclose(flat.reshape(q.shape), ref, rtol=1e-5, atol=1e-6)


def test_layer_view_shows_the_keys_values_positions_and_scores_in_the_pool(client):
    rng = np.random.default_rng(2)
    with client.open_session(G) as s:
        k, v = kv(rng, 20)
        s.append(0, [100 + 2 * i for i in range(20)], k, v)
        s.attend(0, rng.standard_normal((G.n_heads, G.head_dim), dtype=np.float32))
        view = s.layer_view(0)
        assert (view.n_tokens, view.n_q8, view.block_tokens, view.shared_tokens) == (20, 0, 16, 0)
        assert len(view.blocks) == 2 and all(b.writable for b in view.blocks)
        b0 = view.blocks[0]
        assert b0.keys.shape == (2, 16, 8) and b0.keys.dtype == np.float32
        np.testing.assert_array_equal(view.gather("keys"), k.transpose(1, 0, 2))
        np.testing.assert_array_equal(view.gather("values"), v.transpose(1, 0, 2))
        np.testing.assert_array_equal(view.gather("pos")[0], 100 + 2 * np.arange(20))
        sums = view.gather("sum")  # one attend: each KV head's weights average to 1 over the tokens
        np.testing.assert_allclose(sums.sum(axis=1), [1.0, 1.0], rtol=1e-5)
        np.testing.assert_array_equal(view.gather("last"), sums)
        # the views are the pool itself: a score written here is what kvcd's policy reads
        b0.sum[0, 0] = 42.0
        assert s.layer_view(0).blocks[0].sum[0, 0] == 42.0


def test_gather_copies_a_layer_into_dense_arrays_and_refuses_bad_ones(client):
    rng = np.random.default_rng(21)
    with client.open_session(G) as s:
        k, v = kv(rng, 40)  # three blocks
        s.append(1, 0, k, v)
        gk, gv = s.gather(1)
        assert gk.shape == (2, 40, 8) and gk.dtype == np.float32
        np.testing.assert_array_equal(gk, k.transpose(1, 0, 2))
        np.testing.assert_array_equal(gv, v.transpose(1, 0, 2))
        big_k, big_v = np.full((2, 64, 8), -1.0, np.float32), np.full((2, 64, 8), -1.0, np.float32)
        assert s.gather(1, 5, 30, big_k, big_v)[0] is big_k  # rows [:, :30] written, the rest left
        np.testing.assert_array_equal(big_k[:, :30], k[5:35].transpose(1, 0, 2))
        np.testing.assert_array_equal(big_v[:, :30], v[5:35].transpose(1, 0, 2))
        assert (big_k[:, 30:] == -1.0).all() and (big_v[:, 30:] == -1.0).all()
        assert s.gather(0)[0].shape == (2, 0, 8)  # an empty layer
        with pytest.raises(kvcd.KvcInvalid, match="holds 40"):
            s.gather(1, 10, 31)
        with pytest.raises(kvcd.KvcDtypeError):
            s.gather(1, 0, 4, big_k.astype(np.float64), big_v)
        with pytest.raises(kvcd.KvcInvalid, match="shape"):
            s.gather(1, 0, 40, big_k[:, :20].copy(), big_v)
        with pytest.raises(kvcd.KvcInvalid):
            s.gather(2)


def test_slots_counted_with_append_slots_are_written_through_the_view(client):
    rng = np.random.default_rng(17)
    keys = rng.standard_normal((2, 3, 8), dtype=np.float32)
    values = rng.standard_normal((2, 3, 8), dtype=np.float32)
    with client.open_session(G) as s:
        s.append_slots(0, 3)
        assert s.layer_tokens(0) == 3
        b = s.layer_view(0).blocks[0]
        b.keys[:, :3], b.values[:, :3] = keys, values
        b.pos[:, :3] = np.arange(3)
        for side in (b.sum, b.ema, b.last, b.logw):
            side[:, :3] = 0
        q = rng.standard_normal((4, 8), dtype=np.float32)
        np.testing.assert_allclose(s.attend(0, q), ref_attention(keys, values, q, 4), rtol=1e-5, atol=1e-6)
        with pytest.raises(kvcd.KvcNoSpace):
            s.append_slots(0, s.max_tokens)


def test_a_float16_session_stores_float16_and_takes_float16_arrays(client):
    g = kvcd.Geometry(1, 2, 1, 8, 64, dtype="float16")
    rng = np.random.default_rng(3)
    with client.open_session(g) as s:
        k16 = rng.standard_normal((1, 8)).astype(np.float16)
        v16 = rng.standard_normal((1, 8)).astype(np.float16)
        s.append(0, 0, k16, v16)
        view = s.layer_view(0)
        assert view.blocks[0].keys.dtype == np.float16
        np.testing.assert_array_equal(view.gather("keys")[:, 0], k16)
        out16 = s.attend(0, np.ones((2, 8), np.float16))
        np.testing.assert_allclose(out16, np.repeat(v16.astype(np.float32), 2, axis=0), rtol=1e-3)


def test_a_bfloat16_session_is_viewed_as_its_bits(client):
    with client.open_session(kvcd.Geometry(1, 1, 1, 4, 16, dtype="bfloat16")) as s:
        s.append(0, 0, np.array([[1.0, -2.0, 0.5, 3.0]], np.float32), np.zeros((1, 4), np.float32))
        bits = s.layer_view(0).gather("keys")[0, 0]
        assert bits.dtype == np.uint16
        back = (bits.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(back, [1.0, -2.0, 0.5, 3.0])


# --- refusals of arrays and arguments -----------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int8, np.complex64])
def test_append_and_attend_refuse_other_dtypes(client, dtype):
    with client.open_session(G) as s:
        bad = np.zeros((2, 8), dtype)
        good = np.zeros((2, 8), np.float32)
        with pytest.raises(kvcd.KvcDtypeError):
            s.append(0, 0, bad, good)
        with pytest.raises(TypeError):  # a KvcDtypeError is a TypeError too
            s.append(0, 0, good, bad)
        s.append(0, 0, good, good)
        with pytest.raises(kvcd.KvcDtypeError):
            s.attend(0, np.zeros((4, 8), dtype))
        with pytest.raises(kvcd.KvcDtypeError):
            kvcd.summarize(np.zeros(10, dtype))
        assert s.layer_tokens(0) == 1  # nothing refused reached the pool


def test_append_and_attend_refuse_wrong_shapes_and_strides(client):
    with client.open_session(G) as s:
        z = np.zeros((2, 8), np.float32)
        for bad in (np.zeros((8, 2), np.float32), np.zeros(15, np.float32), np.zeros((1, 2, 8, 1), np.float32)):
            with pytest.raises(kvcd.KvcInvalid):
                s.append(0, 0, bad, z)
        with pytest.raises(ValueError):  # a KvcInvalid is a ValueError too
            s.append(0, 0, np.zeros((2, 16), np.float32)[:, ::2], z)  # right shape, not contiguous
        with pytest.raises(kvcd.KvcInvalid, match="contiguous"):  # float16 is converted, not this
            s.append(0, 0, np.zeros((2, 16), np.float16)[:, ::2], z)
        with pytest.raises(kvcd.KvcDtypeError):
            s.append(0, 0, [[0.0] * 8] * 2, z)  # a list, not an array
        with pytest.raises(kvcd.KvcDtypeError):
            s.append(0, 0, np.zeros((2, 8), ">f4"), z)  # float32, but big-endian
        with pytest.raises(kvcd.KvcInvalid):
            s.append(0, [0, 1], np.zeros((3, 2, 8), np.float32), np.zeros((3, 2, 8), np.float32))
        s.append(0, 0, z, z)
        for bad in (np.zeros((2, 8), np.float32), np.zeros((4, 8), np.float32)[:, ::2]):
            with pytest.raises(kvcd.KvcInvalid):
                s.attend(0, bad)
        q = np.zeros((4, 8), np.float32)
        with pytest.raises(kvcd.KvcDtypeError):
            s.attend(0, q, out=np.zeros((4, 8), np.float64))
        with pytest.raises(kvcd.KvcInvalid):
            s.attend(0, q, out=np.zeros(32, np.float32))
        ro = np.zeros((4, 8), np.float32)
        ro.flags.writeable = False
        with pytest.raises(kvcd.KvcInvalid):
            s.attend(0, q, out=ro)
        with pytest.raises(kvcd.KvcInvalid):
            kvcd.summarize(np.zeros((2, 5), np.float32))
        with pytest.raises(kvcd.KvcInvalid):
            kvcd.summarize(np.zeros(0, np.float32))
        with pytest.raises(kvcd.KvcDtypeError):
            kvcd.summarize([1.0, 2.0])
        for layer in (-1, 2, "0"):
            with pytest.raises(kvcd.KvcInvalid):
                s.append(layer, 0, z, z)
        with pytest.raises(kvcd.KvcInvalid):
            s.append(0, 2**31, z, z)
        with pytest.raises(kvcd.KvcInvalid):
            s.step(1, np.ones(4, np.float32), phase="warmup")
        assert s.layer_tokens(0) == 1


def test_attend_over_an_empty_layer_is_invalid(client):
    with client.open_session(G) as s:
        with pytest.raises(kvcd.KvcInvalid, match="empty"):
            s.attend(0, np.zeros((4, 8), np.float32))


# --- summaries, steps, plans --------------------------------------------------------------


def test_summarize_is_entropy_top1_and_margin_of_the_logits():
    logits = np.array([2.0, 1.0, 0.5, -1.0, 3.0], np.float32)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    s = kvcd.summarize(logits)
    assert s.top1 == 4
    assert s.top1_prob == pytest.approx(p.max(), rel=1e-5)
    assert s.margin == pytest.approx(1.0)
    assert s.entropy == pytest.approx(-(p * np.log(p)).sum() / math.log(5), rel=1e-4)
    conf = 0.4 * (1 - s.entropy) + 0.3 / (1 + math.exp(-s.margin)) + 0.3 * s.top1_prob
    assert s.confidence == pytest.approx(conf, rel=1e-5)
    assert kvcd.summarize(logits.astype(np.float16)).top1 == 4


def test_window_plans_keep_the_most_recent_tokens_within_the_limit(client, admin):
    rng = np.random.default_rng(4)
    with client.open_session(G, policy="window", budget=32) as s:
        limit = s.max_tokens
        assert s.budget == 32 and limit >= 32
        assert s.last_step is None
        for t in range(100):
            for layer in range(G.n_layers):
                s.append(layer, t, *kv(rng))
                s.attend(layer, rng.standard_normal((4, 8), dtype=np.float32))
                assert s.layer_tokens(layer) <= s.max_tokens
            s.step(t, rng.standard_normal(50).astype(np.float32))
            client.flush()
        assert s.last_step == 99
        st = s.stats()
        assert st.steps == 100 and st.plans_applied >= 1
        pos = s.layer_view(0).gather("pos")[0]
        assert list(pos) == list(range(100 - len(pos), 100))  # a suffix of the sequence
        row = next(r for r in admin.sessions() if r["id"] == s.id)
        assert row["policy"] == "window" and row["steps"] == 100 and row["tokens"] == len(pos)
        final = s.close()
    assert len(pos) <= final.peak_tokens <= limit
    assert final.plans >= 1 and final.peak_bytes > 0
    assert s.stats() == final


def test_the_ladder_keeps_a_byte_budget_by_lowering_precision(client):
    g = kvcd.Geometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, max_tokens=640)
    full = kvcd.full_cache_bytes(g, 640)
    assert full == kvcd.full_cache_bytes(g, 640, 1.0) and kvcd.full_cache_bytes(g, 640, 0.5) == full // 2
    rng = np.random.default_rng(27)
    with client.open_session(g, policy="ladder", tiers=["q8", "q4", "q2"], budget_fraction=0.4,
                             params={"sinks": 4, "window": 32}) as s:
        assert s.budget_bytes == int(0.4 * full)
        keys, values = kv(rng, 640, g)
        for t in range(0, 640, 64):  # a prompt in chunks: kvcd plans between them
            s.reserve(t + 64)
            for i in range(t, t + 64):
                for layer in range(g.n_layers):
                    s.append(layer, i, keys[i], values[i])
            s.step(t // 64, rng.standard_normal(50).astype(np.float32), phase="prefill")
            client.flush()
            assert s.bytes <= s.budget_bytes
        tiers = s.tier_tokens(0)
        assert sum(tiers.values()) == 640  # nothing evicted: lowered instead
        mine = np.arange(2 * 640, dtype=np.float32).reshape(2, 640)
        s.set_scores(1, mine)  # an importance of the caller's own, across every tier
        np.testing.assert_array_equal(s.scores(1), mine)
        with pytest.raises(kvcd.KvcInvalid):
            s.set_scores(1, np.full((2, 4), np.nan))
        assert tiers["f32"] >= 36 and tiers["q8"] + tiers["q4"] + tiers["q2"] > 300
    with pytest.raises(kvcd.KvcInvalid):
        client.open_session(g, policy="ladder", tiers=["q4"], budget_fraction=-1)
    with pytest.raises(kvcd.KvcInvalid):
        client.open_session(g, policy="ladder", budget_bytes=1 << 20)  # no tiers to lower to


def test_a_session_with_tiers_keeps_its_window_and_reads_every_tier_back(client, admin):
    g = kvcd.Geometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, max_tokens=256)
    rng = np.random.default_rng(26)
    with client.open_session(g, tiers=["q8", "q4"], params={"tier_window": 16}, rotation_seed=5) as s:
        assert s.tiers == ["f32", "q8", "q4"]
        keys, values = kv(rng, 80, g)
        for t in range(80):
            for layer in range(g.n_layers):
                s.append(layer, t, keys[t], values[t])
            s.step(t, rng.standard_normal(50).astype(np.float32))
            client.flush()
        tiers = s.tier_tokens(1)
        assert sum(tiers.values()) == 80 and tiers["q8"] == 0  # tier_window sends to the lowest
        assert 16 <= tiers["f32"] < 32 and tiers["q4"] == 80 - tiers["f32"]
        gk, gv = s.gather(1)  # dequantized and rotated back
        want_k, want_v = keys.transpose(1, 0, 2), values.transpose(1, 0, 2)
        low = tiers["q4"]
        np.testing.assert_array_equal(gk[:, low:], want_k[:, low:])  # the window: exact
        err = np.linalg.norm(gk[:, :low] - want_k[:, :low], axis=-1) / np.linalg.norm(want_k[:, :low], axis=-1)
        assert err.max() < 0.2  # 4-bit Lloyd-Max codes of a rotated row
        err = np.linalg.norm(gv[:, :low] - want_v[:, :low], axis=-1) / np.linalg.norm(want_v[:, :low], axis=-1)
        assert err.max() < 0.2
        with pytest.raises(kvcd.KvcNotSupported):
            s.layer_view(0)  # packed blocks have no view: gather reads them
        row = next(r for r in admin.sessions() if r["id"] == s.id)
        assert set(row["tier_bytes"]) == {"f32", "q4"} and 0 < row["bits_per_value"] < 32
    with pytest.raises(kvcd.KvcInvalid, match="q5"):
        client.open_session(g, tiers=["q5"])
    with pytest.raises(kvcd.KvcDtypeError):
        client.open_session(g, tiers="q4")


def test_a_step_that_is_not_after_the_last_is_invalid(client):
    with client.open_session(G) as s:
        s.append(0, 0, *kv(np.random.default_rng(5)))
        s.step(5, np.ones(8, np.float32))
        client.flush()
        with pytest.raises(kvcd.KvcInvalid, match="not after"):
            s.step(5, np.ones(8, np.float32))


def test_policy_parameters_reach_kvcd(client):
    with client.open_session(G, policy="streaming", budget=32, params={"sinks": 4}) as s:
        assert s.budget == 32
        assert s.max_tokens >= 32
    with pytest.raises(kvcd.KvcInvalid, match="zzz"):
        client.open_session(G, policy="window", params={"zzz": 1})
    with pytest.raises(kvcd.KvcInvalid):
        client.open_session(G, policy="streaming", budget=32, params={"sinks": "many"})


def test_more_than_32_parameters_and_bad_prompt_ids_are_invalid(client):
    with pytest.raises(kvcd.KvcInvalid, match="parameters"):
        client.open_session(G, policy="window", params={f"p{i}": i for i in range(33)})
    for ids in ([-1, 2], [2**32]):
        with pytest.raises(kvcd.KvcInvalid, match="32-bit"):
            client.open_session(G, prompt_token_ids=ids)
    with client.open_session(G) as s:
        for step in (-1, 2**64):
            with pytest.raises(kvcd.KvcInvalid, match="64-bit"):
                s.step(step, np.ones(4, np.float32))


def test_poll_answers_zero_when_kvcd_has_nothing_to_say(client):
    assert client.poll(0) == 0


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "geo",
    [
        kvcd.Geometry(2, 4, 3, 8, 64),  # 3 does not divide 4
        kvcd.Geometry(0, 4, 2, 8, 64),
        kvcd.Geometry(2, 4, 2, 0, 64),
        kvcd.Geometry(2, 4, 2, 8, 0),
        kvcd.Geometry(2, 4, 2, 8, 64, dtype="int8"),
        kvcd.Geometry(2, -4, 2, 8, 64),
    ],
)
def test_a_bad_geometry_is_invalid(client, geo):
    with pytest.raises(kvcd.KvcInvalid):
        client.open_session(geo)


def test_kvcd_refuses_a_geometry_beyond_its_limits_with_einval(kvcd_daemon):
    with kvcd.connect(kvcd_daemon.dir, timeout_ms=2000) as c:
        with pytest.raises(kvcd.KvcInvalid):
            c.open_session(kvcd.Geometry(100000, 4, 2, 8, 64))


def test_an_unknown_policy_is_invalid_with_kvcds_message(client):
    with pytest.raises(kvcd.KvcInvalid) as e:
        client.open_session(G, policy="nope")
    assert e.value.errno == 22 and "unknown policy 'nope'" in e.value.message


def test_an_unknown_session_is_not_found(admin):
    with pytest.raises(kvcd.KvcNotFound) as e:
        admin.evict(987654)
    assert e.value.errno_name == "ENOENT" and e.value.exit_code == 1


def test_a_bad_handoff_ticket_is_not_permitted(client):
    with pytest.raises(kvcd.KvcNotPermitted):
        client.import_session(kvcd.Handoff(12345, b"\0" * 16), G)
    with pytest.raises(kvcd.KvcInvalid):
        client.import_session(kvcd.Handoff(12345, b"short"), G)


def test_room_beyond_the_policys_limit_is_no_space(client):
    with client.open_session(G, policy="window", budget=16) as s:
        with pytest.raises(kvcd.KvcNoSpace, match="allows"):
            s.reserve(s.max_tokens + 1)
        s.reserve(s.max_tokens)
        k, v = kv(np.random.default_rng(6), s.max_tokens)
        s.append(0, 0, k, v)  # up to the limit without a step in between
        with pytest.raises(kvcd.KvcNoSpace):
            s.append(0, s.max_tokens, k[0], v[0])
        assert s.layer_tokens(0) == s.max_tokens


def test_a_session_over_its_max_bytes_is_no_space(client):
    with client.open_session(G, max_bytes=16384) as s:
        rng = np.random.default_rng(7)
        with pytest.raises(kvcd.KvcNoSpace):
            for t in range(G.max_tokens):
                s.append(0, t, *kv(rng))
        assert 0 < s.layer_tokens(0) < G.max_tokens


def test_a_full_pool_and_a_tenants_quota_are_no_space(start_kvcd):
    d = start_kvcd("--capacity", "8M", "--tenant", "small:quota=1M")
    with kvcd.connect(d.dir) as c:
        big = c.open_session(G, min_bytes=6 << 20)
        with pytest.raises(kvcd.KvcNoSpace, match="capacity"):
            c.open_session(G, min_bytes=4 << 20)
        with pytest.raises(kvcd.KvcNoSpace, match="small"):
            c.open_session(G, tenant="small", min_bytes=2 << 20)
        big.close()
        c.open_session(G, min_bytes=4 << 20).close()  # the pool's room is back


def test_an_evicted_session_is_shut_down(client, admin):
    s = client.open_session(G)
    s.append(0, 0, *kv(np.random.default_rng(8)))
    got = admin.evict(s.id)
    assert got["evicted"] == s.id

    def told():  # the notice arrives unasked: poll until libkvc has handled it
        client.poll(100)
        try:
            s.append_slots(0, 0)  # changes nothing; refused once libkvc knows
        except kvcd.KvcShutdown:
            return True
        return False

    wait_until(told, "kvcd's notice of the evict")
    with pytest.raises(kvcd.KvcShutdown) as e:
        s.append(0, 1, *kv(np.random.default_rng(9)))
    assert e.value.errno_name == "ESHUTDOWN" and str(s.id) in e.value.message
    with pytest.raises(kvcd.KvcShutdown):
        s.step(0, np.ones(4, np.float32))
    try:
        s.close()
    except kvcd.KvcError:
        pass
    assert s.closed


def test_a_draining_kvcd_refuses_new_sessions_with_shutdown(start_kvcd):
    d = start_kvcd()
    a = kvcd.admin.Admin(d.dir)
    with kvcd.connect(d.dir) as c:
        s = c.open_session(G)
        assert a.drain() == {"sessions_left": 1, "timed_out": False, "draining": True}
        assert a.status()["draining"] is True
        with pytest.raises(kvcd.KvcShutdown, match="draining"):
            c.open_session(G)
        s.close()
        assert a.drain(timeout_s=1)["sessions_left"] == 0
        assert a.drain(resume=True)["draining"] is False
        c.open_session(G).close()


def test_a_stopping_kvcd_refuses_sessions_then_is_not_connected(start_kvcd):
    d = start_kvcd()
    a = kvcd.admin.Admin(d.dir)
    c = kvcd.connect(d.dir, resume_ms=-1)
    s = c.open_session(G)
    d.proc.send_signal(signal.SIGTERM)  # graceful: the open session gets --stop-timeout to end
    wait_until(lambda: a.status()["draining"], "kvcd draining after SIGTERM")
    with pytest.raises(kvcd.KvcShutdown):
        c.open_session(G)
    # the last session ends and kvcd exits; it may stop before its answer to this close leaves
    # (server_stop right after the handler), so ENOTCONN is a correct outcome of this close too
    try:
        s.close()
    except kvcd.KvcNotConnected:
        pass
    assert s.closed
    assert d.proc.wait(timeout=DEADLINE_S) == 0
    with pytest.raises(kvcd.KvcNotConnected):
        c.open_session(G)
    c.close()


def test_a_killed_kvcd_is_not_connected(start_kvcd):
    d = start_kvcd()
    c = kvcd.connect(d.dir, resume_ms=-1)
    s = c.open_session(G)
    s.append(0, 0, *kv(np.random.default_rng(10)))
    d.kill()
    with pytest.raises(kvcd.KvcNotConnected) as e:
        s.step(0, np.ones(4, np.float32))
        c.flush()
    assert isinstance(e.value, ConnectionError) and e.value.errno_name == "ENOTCONN"
    with pytest.raises(kvcd.KvcNotConnected):
        c.open_session(G)
    c.close()


# --- processes, sharing, hand-off ---------------------------------------------------------

CHILD = """
import sys, kvcd
c = kvcd.connect(sys.argv[1], name="doomed")
s = c.open_session(kvcd.Geometry(2, 4, 2, 8, 64))
print(s.id, flush=True)
sys.stdin.read()  # until killed
"""


def read_line(proc, deadline_s=DEADLINE_S):
    ready, _, _ = select.select([proc.stdout], [], [], deadline_s)
    assert ready, "the child printed nothing in time"
    return proc.stdout.readline()


def test_a_session_dies_with_its_process(kvcd_daemon, admin):
    deaths = admin.status()["client_deaths"]
    child = subprocess.Popen([sys.executable, "-c", CHILD, kvcd_daemon.dir], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        sid = int(read_line(child))
        row = next(r for r in admin.sessions() if r["id"] == sid)
        assert row["pid"] == child.pid and row["client"] == "doomed"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=DEADLINE_S)
    finally:
        child.kill()
        child.wait()
    wait_until(lambda: all(r["id"] != sid for r in admin.sessions()), "kvcd closing the dead client's session")
    assert admin.status()["client_deaths"] == deaths + 1
    assert admin.audit()["clean"]


def test_a_session_exported_is_imported_by_another_client_with_its_cache(kvcd_daemon, client):
    rng = np.random.default_rng(11)
    s = client.open_session(G, handoff=True)
    k, v = kv(rng, 10)
    s.append(0, 0, k, v)
    s.append(1, 0, k, v)
    s.step(0, np.ones(4, np.float32), phase="prefill")
    client.flush()
    h = s.export()
    assert s.closed and h.session_id and len(h.ticket) == 16
    with kvcd.connect(kvcd_daemon.dir, name="importer") as c2:
        s2 = c2.import_session(h, G)
        assert s2.id == h.session_id and s2.layer_tokens(0) == 10 and s2.last_step == 0
        np.testing.assert_array_equal(s2.layer_view(0).gather("keys"), k.transpose(1, 0, 2))
        s2.append(0, 10, *kv(rng))
        s2.close()


def test_a_shared_prefix_is_attached_and_its_blocks_are_read_only(client):
    rng = np.random.default_rng(12)
    ids = list(range(1000, 1040))  # two whole 16-token blocks and 8 tokens more
    k, v = kv(rng, 40)
    opts = dict(prompt_token_ids=ids, share_prefix=True, model_id="pytest-model")
    with client.open_session(G, **opts) as a:
        assert a.shared_tokens == 0
        for layer in range(G.n_layers):
            a.append(layer, 0, k, v)
        a.step(0, np.ones(4, np.float32), phase="prefill")
        client.flush()
        with client.open_session(G, **opts) as b:
            assert b.shared_tokens == 32 and b.layer_tokens(0) == 32  # the caller computes the rest
            view = b.layer_view(0)
            assert view.shared_tokens == 32 and not any(blk.writable for blk in view.blocks[:2])
            np.testing.assert_array_equal(view.gather("keys"), k[:32].transpose(1, 0, 2))
            with pytest.raises(ValueError):
                view.blocks[0].keys[0, 0, 0] = 1.0
            b.append(0, 32, k[32], v[32])  # its own tokens go after the prefix, in a block of its own
            assert b.layer_view(0).blocks[-1].writable


def test_events_report_the_prefix_blocks_kvcd_publishes(kvcd_daemon, client, admin):
    got = []
    follower = threading.Thread(target=lambda: got.extend(admin.events(count=1, timeout_ms=int(DEADLINE_S * 1000))))
    follower.start()
    rng = np.random.default_rng(13)
    end = time.monotonic() + DEADLINE_S
    n = 0
    # the subscription's start is not observable from here: publish until the follower saw one
    while follower.is_alive() and time.monotonic() < end:
        with client.open_session(G, prompt_token_ids=list(range(n * 16, n * 16 + 16)), share_prefix=True,
                                 model_id=f"events-{n}") as s:
            k, v = kv(rng, 16)
            for layer in range(G.n_layers):
                s.append(layer, 0, k, v)
            s.step(0, np.ones(4, np.float32), phase="prefill")
            client.flush()
        n += 1
        follower.join(0.05)
    follower.join()
    assert got, "no event within the deadline"
    e = got[0]
    assert set(e) == {"seq", "ts_usec", "event", "session", "block_hashes"}
    assert e["event"] in ("stored", "removed", "cleared")


# --- the admin module ---------------------------------------------------------------------


def test_admin_returns_what_kvcctl_json_prints(kvcd_daemon, client, admin):
    s = client.open_session(G, policy="h2o", budget=32, tenant="default", priority=3)
    s.append(0, 0, *kv(np.random.default_rng(14)))
    st = admin.status()
    for key in ("version", "backend", "capacity_bytes", "used_bytes", "sessions", "clients", "tenants", "rss_bytes"):
        assert key in st
    assert st["backend"] == "host" and st["sessions"] >= 1 and st["used_bytes"] > 0
    row = next(r for r in admin.sessions() if r["id"] == s.id)
    assert row["policy"] == "h2o" and row["budget"] == 32 and row["priority"] == 3
    assert row["pid"] == os.getpid() and row["client"] == "pytest"
    b = admin.budgets()
    assert b["capacity_bytes"] == st["capacity_bytes"] and b["tenants"][0]["name"] == "default"
    after = admin.set_budget(session=s.id, priority=7)
    assert after["capacity_bytes"] == b["capacity_bytes"]
    assert next(r for r in admin.sessions() if r["id"] == s.id)["priority"] == 7
    with pytest.raises(kvcd.KvcInvalid):  # kvcctl's own usage check: --priority needs --session
        admin.set_budget(priority=1)
    assert "kvcd_pool_bytes" in admin.metrics()["text"]
    audit = admin.audit()
    assert audit["clean"] and audit["sessions"] == st["sessions"] and audit["used_bytes"] == st["used_bytes"]
    assert kvcd.admin.status(kvcd_daemon.dir)["version"] == st["version"]
    assert kvcd.admin.Admin(os.path.join(kvcd_daemon.dir, "kvcd.sock")).audit()["clean"]
    s.close()


def test_admin_of_nothing_says_so_with_kvcctls_exit_code():
    with tempfile.TemporaryDirectory() as d:
        with pytest.raises(kvcd.KvcError) as e:
            kvcd.admin.Admin(d).status()
    assert e.value.exit_code == 3 and "nothing is listening" in e.value.message


# --- leaks --------------------------------------------------------------------------------


def count_maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_no_leaks_over_1000_session_open_close_cycles(kvcd_daemon, client, admin):
    rng = np.random.default_rng(15)
    k, v = kv(rng)
    client.open_session(G).close()  # the first session maps the pool's range: count after it
    fds, maps = len(os.listdir("/proc/self/fd")), count_maps()
    for i in range(1000):
        s = client.open_session(G, policy="window", budget=16)
        s.append(i % 2, i, k, v)
        s.close()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert count_maps() <= maps + 4
    assert client.sessions == []
    audit = admin.audit()
    assert audit["clean"] and audit["used_bytes"] == 0 and audit["sessions"] == 0, audit
    assert admin.sessions() == []


def test_no_leaks_over_200_connect_disconnect_cycles(kvcd_daemon, admin):
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(200):
        with kvcd.connect(kvcd_daemon.dir) as c:
            c.open_session(G).append(0, 0, *kv(np.random.default_rng(i)))
    assert len(os.listdir("/proc/self/fd")) == fds
    st = admin.status()
    assert st["clients"] == 0 and st["sessions"] == 0 and st["used_bytes"] == 0
    assert admin.audit()["clean"]


# --- INT8 blocks, garbage collection, threads ---------------------------------------------


def test_int8_blocks_are_viewed_with_their_scales(client):
    rng = np.random.default_rng(16)
    g = kvcd.Geometry(1, 4, 2, 8, 1024)
    keys = {}
    with client.open_session(g, policy="conf", budget=64, params={"int8": 1}) as s:
        for t in range(300):
            k, v = kv(rng, g=g)
            keys[t] = k
            s.append(0, t, k, v)
            s.attend(0, rng.standard_normal((4, 8), dtype=np.float32))
            s.step(t, rng.standard_normal(100).astype(np.float32))
            client.flush()
        view = s.layer_view(0)
        assert view.n_q8 == s.q8_tokens(0) > 0 and view.q8_blocks
        q8 = view.q8_blocks[0]
        assert q8.q8 and q8.keys.dtype == np.int8 and q8.kscale.shape == (2, 8) and q8.vscale.shape == (2, 16)
        n = min(view.n_q8, view.block_tokens)
        for h in range(2):
            for j in range(n):
                orig = keys[int(q8.pos[h, j])][h]
                back = q8.keys[h, j].astype(np.float32) * q8.kscale[h]
                # within two quantization steps of the channel: a token requantized when it moved
                # between INT8 blocks was rounded twice; a wrong layout would be far off
                assert np.all(np.abs(back - orig) <= 2 * q8.kscale[h] + 1e-6), (back, orig)
        fp_pos = view.gather("pos")
        assert fp_pos.min() > q8.pos[:, :n].max()  # INT8 holds the oldest kept tokens


def test_an_array_of_a_layer_view_keeps_its_session_open(client, admin):
    import gc

    s = client.open_session(G)
    s.append(0, 0, np.full((2, 8), 3.0, np.float32), np.zeros((2, 8), np.float32))
    sid = s.id
    keys = s.layer_view(0).blocks[0].keys
    del s
    gc.collect()
    assert any(r["id"] == sid for r in admin.sessions())
    assert keys[0, 0, 0] == 3.0
    del keys
    gc.collect()
    assert all(r["id"] != sid for r in admin.sessions())


def test_geometry_takes_numpy_dtypes_and_aliases():
    assert kvcd.Geometry(1, 1, 1, 1, 1, dtype=np.float16).dtype == "float16"
    assert kvcd.Geometry(1, 1, 1, 1, 1, dtype="bf16").dtype == "bfloat16"
    assert kvcd.Geometry(1, 1, 1, 1, 1, dtype=np.float32) == kvcd.Geometry(1, 1, 1, 1, 1)


def test_a_session_dropped_by_the_garbage_collector_is_closed(client, admin):
    import gc

    s = client.open_session(G)
    sid = s.id
    assert any(r["id"] == sid for r in admin.sessions())
    del s
    gc.collect()
    assert all(r["id"] != sid for r in admin.sessions())
    assert client.sessions == []


def test_a_client_shared_by_threads_serializes_their_calls(client):
    errors = []

    def work(seed):
        try:
            rng = np.random.default_rng(seed)
            with client.open_session(G, policy="window", budget=16) as s:
                for t in range(200):
                    s.append(0, t, *kv(rng))
                    s.attend(0, rng.standard_normal((4, 8), dtype=np.float32))
                    s.step(t, rng.standard_normal(20).astype(np.float32))
                    client.flush()
                assert s.layer_tokens(0) <= s.max_tokens
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads) and errors == []
