#!/usr/bin/env python3
"""kv_router_index.py: the part of a prefix-aware router that reads kvcd's KV events.

A reference for wiring a router to a fleet of kvcd nodes (docs/operations.md, "Running kvcd on a
fleet"): one SUB socket per node on its events endpoint, a DEALER on its replay endpoint, and an
index of which node holds which block hash. It reads vLLM's format (kvcd --events-format vllm;
vLLM 0.10.2's KVEventBatch), so the same loop reads vLLM engines too, and handles what a router
must: a gap in a node's sequence numbers is filled from its replay socket (or, when the replay
buffer no longer has it, the node's blocks are forgotten until it says more), and
AllBlocksCleared drops everything the node held.

To route a request, hash its prompt's token ids the way kvcd does (kvcd_block_hashes: FNV-1a 64
chains over 16-token blocks) and send it to the node holding the longest run of them (best_node).

    kv_router_index.py --node gpu-a=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 \
                       --node gpu-b=tcp://10.0.0.6:5557,tcp://10.0.0.6:5558

prints one line per batch: the node, the sequence number, the events, and the blocks it holds.
Needs msgspec and pyzmq (tests/python/requirements.txt pins the versions kvcd is tested with).
"""

import argparse
from typing import Any, Optional, Union

import msgspec
import zmq

BLOCK = 16
END_SEQ = (-1).to_bytes(8, "big", signed=True)


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


def kvcd_block_hashes(token_ids):
    """The hashes kvcd publishes for a prompt: one per whole 16-token block, each FNV-1a 64 over
    the previous hash (8 bytes little endian, 0 before the first) and the block's ids (4 bytes
    little endian each); 0 is never a hash (it becomes 1)."""
    hashes, h = [], 0
    for b in range(len(token_ids) // BLOCK):
        x = 0xCBF29CE484222325
        data = h.to_bytes(8, "little") + b"".join(
            t.to_bytes(4, "little") for t in token_ids[b * BLOCK:(b + 1) * BLOCK])
        for byte in data:
            x = ((x ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        h = x or 1
        hashes.append(h)
    return hashes


class Node:
    def __init__(self, ctx, name, events_ep, replay_ep, topic=b"kv-events"):
        self.name, self.held, self.next_seq = name, set(), None
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(events_ep)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay_ep)

    def apply(self, seq, batch):
        self.next_seq = seq + 1
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.held.clear()
            elif isinstance(ev, BlockStored):
                self.held.update(ev.block_hashes)
            else:
                self.held.difference_update(ev.block_hashes)
        print("%s seq %d: %s; holds %d blocks" % (
            self.name, seq, ", ".join(type(e).__name__ for e in batch.events), len(self.held)),
            flush=True)

    def catch_up(self, decoder, upto, timeout_ms=2000):
        """Replays next_seq..upto-1; False when the node no longer keeps all of it."""
        self.replay.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        complete = True
        while self.replay.poll(timeout_ms):
            _, seq_b, payload = self.replay.recv_multipart()
            if seq_b == END_SEQ:
                return complete
            seq = int.from_bytes(seq_b, "big")
            if seq >= upto:
                continue
            complete &= seq == self.next_seq
            self.apply(seq, decoder.decode(payload))
        return False


def best_node(nodes, token_ids):
    """The node holding the longest prefix of the prompt's blocks, and how many blocks."""
    hashes = kvcd_block_hashes(token_ids)
    best, best_n = None, 0
    for node in nodes:
        n = 0
        while n < len(hashes) and hashes[n] in node.held:
            n += 1
        if n > best_n:
            best, best_n = node, n
    return best, best_n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--node", action="append", required=True, metavar="NAME=EVENTS,REPLAY")
    ap.add_argument("--count", type=int, default=0,
                    help="stop once this many messages of all nodes are read (0: never)")
    args = ap.parse_args()
    ctx, decoder = zmq.Context(), msgspec.msgpack.Decoder(type=KVEventBatch)
    nodes = []
    for spec in args.node:
        name, eps = spec.split("=", 1)
        events_ep, replay_ep = eps.split(",")
        nodes.append(Node(ctx, name, events_ep, replay_ep))
    poller = zmq.Poller()
    for n in nodes:
        poller.register(n.sub, zmq.POLLIN)
    for n in nodes:  # what each node published before we connected (from its first message, 0)
        n.next_seq = 0
        if not n.catch_up(decoder, 1 << 64):
            print("%s: its first messages are no longer kept: its blocks may be incomplete" % n.name)
    while not args.count or sum(n.next_seq for n in nodes) < args.count:
        for sock, _ in poller.poll():
            node = next(n for n in nodes if n.sub is sock)
            _, seq_b, payload = sock.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq > node.next_seq and not node.catch_up(decoder, seq):
                print("%s: messages before %d are lost: its blocks are forgotten" % (node.name, seq))
                node.held.clear()
            if seq < node.next_seq:
                continue
            node.apply(seq, decoder.decode(payload))


if __name__ == "__main__":
    main()
