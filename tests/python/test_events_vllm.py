"""test_events_vllm.py: kvcd's KV events in vLLM's format, read the way a cluster router reads
vLLM's (msgspec structs, a SUB socket over TCP, the replay ROUTER for what it missed).

The structs below are written from the format as vLLM 0.10.2 defines it
(vllm/distributed/kv_events.py; docs/protocol.md writes it down), not imported from vLLM. When
`make vllm-events` extracted vLLM's own kv_events.py into $KVC_BUILD/vllm/, every payload is
decoded with vLLM's classes too (test_vllms_own_classes_decode_every_message).

The run: kvc-run A (stories260K) holds a prompt while B (the same prefix, another ending) and C
(A's prompt) run to completion, then A finishes. kvcd's events say what the node holds, as vLLM's
block pool does: B announces only the blocks after the shared prefix, C announces nothing, B's
end removes only its own blocks, A's end removes the rest. The subscriber drops B's messages on
purpose and gets them back from the replay socket, and every message of the run is decoded and
checked: sequence numbers gapless from 0, parents known, hashes the documented FNV-1a chain of
the token ids, payloads byte for byte what msgspec itself encodes for the decoded structs.
"""

import glob
import importlib.util
import os
import signal
import subprocess
import sys
import types
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

import kvcd_harness as kh

BLOCK = 16
TOPIC = b"kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
PREFIX = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
          "park with her friends.")
PROMPT_A = PREFIX + " One day"
PROMPT_B = PREFIX + " Her brother Tom had a red kite"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()


def fnv_chain(parent, ids):
    """kvcd's block hash (docs/protocol.md): FNV-1a 64 over the parent hash (8 bytes, little
    endian; 0 for the first block) and the block's token ids (4 bytes each, little endian)."""
    h = 0xCBF29CE484222325
    for b in parent.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in ids):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h or 1


class Subscriber:
    """A router's view of one node: SUB for the live stream, DEALER for replays."""

    def __init__(self, ctx, endpoint, replay_endpoint):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.replay_sock = ctx.socket(zmq.DEALER)
        self.replay_sock.setsockopt(zmq.LINGER, 0)
        self.replay_sock.connect(replay_endpoint)

    def recv(self, timeout_s=kh.DEADLINE_S):
        """The next live message as (seq, payload); fails past the deadline."""
        assert self.sub.poll(int(timeout_s * 1000)), "no KV event within the deadline"
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == TOPIC and len(seq) == 8
        return int.from_bytes(seq, "big"), payload

    def replay(self, start):
        """Every kept message from seq start on, as [(seq, payload)], up to the end marker."""
        self.replay_sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert self.replay_sock.poll(int(kh.DEADLINE_S * 1000)), "no replay answer"
            empty, seq, payload = self.replay_sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))

    def close(self):
        self.sub.close()
        self.replay_sock.close()


class NodeIndex:
    """What a router knows of one node's blocks, kept from the events in sequence order."""

    def __init__(self):
        self.held = {}  # block hash -> its parent (None: first block)
        self.next_seq = 0
        self.batches = {}  # seq -> KVEventBatch
        self.payloads = {}  # seq -> bytes

    def apply(self, seq, payload):
        assert seq == self.next_seq, "out of order: %d after %d" % (seq, self.next_seq - 1)
        self.next_seq += 1
        batch = DECODER.decode(payload)
        assert ENCODER.encode(batch) == payload  # byte for byte msgspec's own encoding
        assert batch.data_parallel_rank == 0
        self.batches[seq] = batch
        self.payloads[seq] = payload
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.held.clear()
            elif isinstance(ev, BlockStored):
                assert ev.block_size == BLOCK and ev.lora_id is None and ev.medium == "CPU"
                assert ev.parent_block_hash is None or ev.parent_block_hash in self.held
                parent = ev.parent_block_hash
                for h in ev.block_hashes:
                    assert h not in self.held, "stored twice without a removal"
                    self.held[h] = parent
                    parent = h
            else:
                assert ev.medium == "CPU"
                for h in ev.block_hashes:
                    assert h in self.held, "removed but never stored"
                    del self.held[h]

    def events(self, lo, hi):
        """The events of messages lo..hi (inclusive)."""
        return [ev for s in range(lo, hi + 1) for ev in self.batches[s].events]


@pytest.fixture(scope="module")
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def start_node(*extra):
    port, replay_port = kh.free_tcp_port(), kh.free_tcp_port()
    node = kh.Kvcd(["--events-format", "vllm", "--events-endpoint", "tcp://127.0.0.1:%d" % port,
                    "--events-replay-endpoint", "tcp://127.0.0.1:%d" % replay_port, *extra])
    return node, "tcp://127.0.0.1:%d" % port, "tcp://127.0.0.1:%d" % replay_port


def history(sub, index, start=0):
    """Replays from start into index (which must be at start) and returns the last seq."""
    for seq, payload in sub.replay(start):
        index.apply(seq, payload)
    return index.next_seq - 1


def stored_hashes(events):
    return [h for ev in events if isinstance(ev, BlockStored) for h in ev.block_hashes]


def removed_hashes(events):
    return [h for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]


@pytest.fixture(scope="module")
def shared_prefix_run(zctx):
    node, ep, replay_ep = start_node("--events-replay-buffer", "1000", "--events-token-ids")
    sub = Subscriber(zctx, ep, replay_ep)
    run = {}
    try:
        truth = NodeIndex()  # from replays: everything kvcd kept, in order
        a = kh.kvc_run(node, PROMPT_A, "-n", "120", "--stop-at", "64")
        kh.wait_stopped(a)  # its prompt (under 64 tokens) is in the cache and announced
        last_a = history(sub, truth)
        held_a = dict(truth.held)
        kh.finish(kh.kvc_run(node, PROMPT_B, "-n", "80"))
        kh.finish(kh.kvc_run(node, PROMPT_A, "-n", "80"))  # C: A's prompt again
        a.send_signal(signal.SIGCONT)
        kh.finish(a)

        # the live stream, as a router consumes it: the first two messages after A's are
        # dropped on purpose and fetched from the replay socket when the gap shows
        live = NodeIndex()
        received, skipped, replayed = {}, [], []
        while True:
            seq, payload = sub.recv()
            received[seq] = payload
            if seq < live.next_seq:
                continue  # had it from a replay
            if seq > last_a and len(skipped) < 2:
                skipped.append(seq)  # on purpose
                continue
            if seq > live.next_seq:  # a gap: ask for it
                for rseq, rpayload in sub.replay(live.next_seq):
                    if rseq < seq:
                        replayed.append(rseq)
                        live.apply(rseq, rpayload)
            live.apply(seq, payload)
            if seq > last_a and not live.held:  # A's end removed the last block
                break
        run.update(truth=truth, live=live, last_a=last_a, held_a=held_a, received=received,
                   skipped=skipped, replayed=replayed)
        run["last"] = history(sub, truth, last_a + 1)
        assert run["last"] == live.next_seq - 1
    finally:
        sub.close()
        run["rc"] = node.stop()
    return run


def test_kvcd_starts_with_all_blocks_cleared_as_message_0(shared_prefix_run):
    truth = shared_prefix_run["truth"]
    assert [type(e) for e in truth.batches[0].events] == [AllBlocksCleared]
    assert shared_prefix_run["rc"] == 0


def test_every_message_of_the_run_decodes_with_gapless_sequence_numbers(shared_prefix_run):
    run = shared_prefix_run
    live, truth = run["live"], run["truth"]
    assert sorted(live.payloads) == list(range(run["last"] + 1))
    assert live.payloads == truth.payloads  # the live stream and the replays agree
    for seq, payload in run["received"].items():
        assert payload == truth.payloads[seq]
    kinds = {type(ev) for b in truth.batches.values() for ev in b.events}
    assert kinds == {AllBlocksCleared, BlockStored, BlockRemoved}
    assert not live.held  # everything stored was removed


def test_the_replay_socket_gives_back_what_the_subscriber_skipped(shared_prefix_run):
    run = shared_prefix_run
    assert len(run["skipped"]) == 2
    assert set(run["skipped"]) <= set(run["replayed"])


def test_runs_of_one_prefix_announce_its_blocks_once(shared_prefix_run):
    run = shared_prefix_run
    truth, last_a, held_a = run["truth"], run["last_a"], run["held_a"]
    a_blocks = stored_hashes(truth.events(0, last_a))
    assert len(a_blocks) >= 2 and set(a_blocks) == set(held_a)
    later = truth.events(last_a + 1, run["last"])
    b_stored = [ev for ev in later if isinstance(ev, BlockStored)]
    # B: only what follows the shared prefix, its parent one of A's blocks
    assert b_stored and b_stored[0].parent_block_hash in held_a
    shared = a_blocks.index(b_stored[0].parent_block_hash) + 1
    assert shared >= 1 and not set(stored_hashes(b_stored)) & set(held_a)
    # C (A's prompt) announced nothing; B's end removed its own blocks only, A's end the rest
    removals = [ev for ev in later if isinstance(ev, BlockRemoved)]
    assert len(removals) == 2
    assert set(removed_hashes(removals[:1])) == set(stored_hashes(b_stored))
    assert set(removed_hashes(removals[1:])) == set(a_blocks)
    assert len(stored_hashes(later)) == len(stored_hashes(b_stored))


def test_block_hashes_are_the_fnv_chain_of_the_token_ids(shared_prefix_run):
    for batch in shared_prefix_run["truth"].batches.values():
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == BLOCK * len(ev.block_hashes)
                h = ev.parent_block_hash or 0
                for i, want in enumerate(ev.block_hashes):
                    h = fnv_chain(h, ev.token_ids[i * BLOCK:(i + 1) * BLOCK])
                    assert h == want


def load_vllm_kv_events():
    """vLLM 0.10.2's own kv_events.py from $KVC_BUILD/vllm (make vllm-events), or None. It
    imports three names from the rest of vLLM; they are given stand-ins of the same meaning."""
    path = os.path.join(kh.ROOT, os.environ.get("KVC_BUILD", "build"), "vllm", "kv_events.py")
    if not os.path.exists(path):
        return None
    import logging
    stubs = {
        "vllm": types.ModuleType("vllm"),
        "vllm.config": types.ModuleType("vllm.config"),
        "vllm.config.kv_events": types.ModuleType("vllm.config.kv_events"),
        "vllm.logger": types.ModuleType("vllm.logger"),
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.core": types.ModuleType("vllm.v1.core"),
        "vllm.v1.core.kv_cache_utils": types.ModuleType("vllm.v1.core.kv_cache_utils"),
    }
    stubs["vllm.config.kv_events"].KVEventsConfig = object
    stubs["vllm.logger"].init_logger = logging.getLogger
    stubs["vllm.v1.core.kv_cache_utils"].ExternalBlockHash = Union[bytes, int]
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("vllm_kv_events", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def test_vllms_own_classes_decode_every_message(shared_prefix_run):
    vk = load_vllm_kv_events()
    if vk is None:
        pytest.skip("vLLM's kv_events.py is not in $KVC_BUILD/vllm (make vllm-events)")
    dec = msgspec.msgpack.Decoder(type=vk.KVEventBatch)
    names = {vk.BlockStored: BlockStored, vk.BlockRemoved: BlockRemoved,
             vk.AllBlocksCleared: AllBlocksCleared}
    for seq, payload in shared_prefix_run["truth"].payloads.items():
        theirs = dec.decode(payload)
        ours = shared_prefix_run["truth"].batches[seq]
        assert theirs.ts == ours.ts and theirs.data_parallel_rank == 0
        assert len(theirs.events) == len(ours.events)
        for t, o in zip(theirs.events, ours.events):
            assert names[type(t)] is type(o)
            for f in o.__struct_fields__:
                assert getattr(t, f) == getattr(o, f)


def run_to_the_end(zctx, prompt, *extra):
    """A kvcd with extra options, one kvc-run of prompt to completion: the node's history (live
    stream, gaps filled by replays) once the run's blocks are removed, and the last replay."""
    node, ep, replay_ep = start_node(*extra)
    sub = Subscriber(zctx, ep, replay_ep)
    try:
        kh.finish(kh.kvc_run(node, prompt, "-n", "80"))
        seen = {}
        while True:  # until the run's end removed its blocks (the full policy evicts nothing)
            seq, payload = sub.recv()
            seen[seq] = DECODER.decode(payload)
            if isinstance(seen[seq].events[-1], BlockRemoved):
                break
        kept = sub.replay(0)
        for seq, payload in kept:
            seen[seq] = DECODER.decode(payload)
        return seen, kept
    finally:
        sub.close()
        assert node.stop() == 0


def test_token_ids_are_withheld_unless_asked_for_and_hashes_match_across_nodes(zctx):
    with_ids, _ = run_to_the_end(zctx, PROMPT_A, "--events-token-ids", "--events-replay-buffer",
                                 "100")
    without, kept = run_to_the_end(zctx, PROMPT_A, "--events-replay-buffer", "3")
    ev1 = [e for s in sorted(with_ids) for e in with_ids[s].events if isinstance(e, BlockStored)]
    ev2 = [e for s in sorted(without) for e in without[s].events if isinstance(e, BlockStored)]
    assert stored_hashes(ev1) == stored_hashes(ev2) and len(stored_hashes(ev1)) >= 2
    assert all(e.token_ids for e in ev1)
    assert all(e.token_ids == [] for e in ev2)
    # the replay buffer's limit: the last 3 messages, consecutive, ending with the last one
    seqs = [s for s, _ in kept]
    assert len(seqs) == 3 and seqs == list(range(seqs[0], seqs[0] + 3))
    assert seqs[-1] == max(without) and seqs[0] > 0


def test_a_restart_that_lost_the_sessions_starts_again_at_0_with_all_blocks_cleared(zctx):
    port, replay_port = kh.free_tcp_port(), kh.free_tcp_port()
    extra = ["--events-format", "vllm", "--events-endpoint", "tcp://127.0.0.1:%d" % port,
             "--events-replay-buffer", "100", "--events-replay-endpoint",
             "tcp://127.0.0.1:%d" % replay_port]
    node = kh.Kvcd(extra)
    sub = Subscriber(zctx, "tcp://127.0.0.1:%d" % port, "tcp://127.0.0.1:%d" % replay_port)
    a = kh.kvc_run(node, PROMPT_A, "-n", "120", "--stop-at", "64")
    try:
        kh.wait_stopped(a)
        before = NodeIndex()
        history(sub, before)
        assert before.held  # the stopped client holds its prompt's blocks
        assert node.kill() == -signal.SIGKILL
        node.start(extra)  # the same directory and ports; the sessions are gone
        sub.close()  # a fresh connection: the old one may not have noticed the death yet
        sub = Subscriber(zctx, "tcp://127.0.0.1:%d" % port, "tcp://127.0.0.1:%d" % replay_port)
        after = NodeIndex()  # a router that saw the numbers start again
        assert history(sub, after) == 0
        assert [type(e) for e in after.batches[0].events] == [AllBlocksCleared]
        assert not after.held
    finally:
        a.kill()
        a.wait(timeout=kh.DEADLINE_S)
        sub.close()
        assert node.stop() == 0


def test_a_plan_that_evicts_inside_the_prompt_removes_its_blocks_while_the_session_runs(zctx):
    node, ep, replay_ep = start_node("--events-replay-buffer", "100")
    sub = Subscriber(zctx, ep, replay_ep)
    # a window of 24 tokens: by position 64 the prompt's blocks are evicted, the session still open
    a = kh.kvc_run(node, PROMPT_A, "-n", "120", "--policy", "window", "--budget", "24",
                   "--stop-at", "64")
    try:
        kh.wait_stopped(a)
        index = NodeIndex()
        history(sub, index)
        events = index.events(0, index.next_seq - 1)
        assert stored_hashes(events) and sorted(removed_hashes(events)) == sorted(stored_hashes(events))
        assert not index.held
        a.send_signal(signal.SIGCONT)
        kh.finish(a)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(timeout=kh.DEADLINE_S)
        sub.close()
        assert node.stop() == 0


def test_a_malformed_replay_request_is_dropped_and_the_next_answered(zctx):
    node = kh.Kvcd(["--events-format", "vllm", "--events-replay-buffer", "10"])
    d = zctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect("ipc://" + node.path("kvcd.events.replay.sock"))
    try:
        d.send_multipart([b"", b"\x00" * 7])  # a short seq
        d.send_multipart([b"x", b"\x00" * 8])  # no empty delimiter
        d.send_multipart([b"", b"\x00" * 8, b"more"])  # a frame too many
        d.send_multipart([b"", b"\x00" * 8])
        assert d.poll(int(kh.DEADLINE_S * 1000))
        empty, seq, payload = d.recv_multipart()
        assert int.from_bytes(seq, "big") == 0  # the first answer is to the good request
        assert isinstance(DECODER.decode(payload).events[0], AllBlocksCleared)
        assert d.poll(int(kh.DEADLINE_S * 1000))
        assert d.recv_multipart()[1] == END_SEQ
    finally:
        d.close()
        assert node.stop() == 0


@pytest.mark.parametrize("args", [
    ["--events-format", "protobuf"],
    ["--events-replay-buffer", "-1"],
    ["--events-replay-buffer", "1000001"],  # past EVENTS_REPLAY_MAX
    ["--events-endpoint", "udp://1.2.3.4:5"],
    ["--events-replay-endpoint", "tcp://127.0.0.1:1"],  # without a buffer
])
def test_bad_events_options_are_usage_errors(args, tmp_path):
    rc = subprocess.run([kh.bin_path("kvcd"), "--runtime-dir", str(tmp_path / "run"), *args],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        timeout=kh.DEADLINE_S).returncode
    assert rc == 2
