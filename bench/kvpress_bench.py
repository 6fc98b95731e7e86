#!/usr/bin/env python3
"""bench/kvpress_bench.py: kvcd's policies (through kvcd.transformers.KvcdCache) against kvpress's
presses on SmolLM2, needle in a haystack, the same kept tokens (issue 20, "The peer, side by side").

    build/venv-kvpress/bin/python bench/kvpress_bench.py --build build/dev [--length 2048]
        [--needles 3] [--ratios 0.5,0.75] [--decode 16] [--chunk 64] [--out FILE.jsonl]

`make bench-kvpress` runs it in the venv of `make kvpress-deps` (kvpress 0.5.5, transformers 5.2.0,
torch 2.15.0). One process, one thread, the model loaded once (transformers' GGUF loader, float32,
HF_HUB_OFFLINE=1); kvcd is started by this script (a private runtime directory).

The prompts are niah.c's (kvc-eval --task niah), rebuilt here by the same procedure: the stories
of ../shared/data/tinystories/validation-sample.txt from story 200 on (the test split), joined by
blank lines from a random story and cut at --length tokens; the needle "The secret code of the
<colour> door is <4 digits>. " after the sentence end nearest depth (i + 0.5) / needles; niah.c's
intro and question in SmolLM2's chat template (its default system prompt); the answer prefix "The
secret code of the <colour> door is" after the assistant tag. The random choices use niah.c's
xorshift64 generator and default seed in niah.c's order (start story, colour, value per needle),
so --length L --needles K gives kvc-eval --task niah --lengths L --needles K's needles (the text
cut by transformers' tokenizer, which matches the engine's on SmolLM2's golden prompts; not
compared token for token here).

Each needle, each configuration: the context (the prompt up to the question) is prefilled, then
the rest of the prompt (question, template, answer prefix) and the answer's tokens go in as one
forward, teacher-forced. Exact match: every answer token is the argmax at its position (the greedy
answer begins with the value); log p: the answer's tokens' summed log-probability. Then --decode
tokens are decoded greedily one forward each: the decode tokens/s is the median step's.

- "full": transformers' DynamicCache, nothing compressed.
- kvpress: the press as a context manager around the context's prefill (one forward): it
  compresses each layer's cache to (1 - ratio) of the context as the layer's prefill ends, before
  the question is seen; the question and answer then go in uncompressed.
- kvcd: KvcdCache with the policy at budget = (1 - ratio) x context tokens per layer, the context
  prefilled in --chunk-token forwards with kvcd's plans between them (slack = the chunk: a layer
  holds at most budget + chunk), prompt_tokens = the context (the prefill policies compress it
  once it is in); the policies that rank by attention score with the last 64 queries of each
  forward (KvcdCache's prefill_window) and with every decode query.

"held" in the table is what layer 0 held when the answer was read: the compressed context plus
the question for kvpress; kvcd's is between budget and budget + slack, plus the question.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.environ.get("KVC_SMOLLM2", os.path.expanduser("~/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
DATA = os.path.join(ROOT, "..", "shared", "data", "tinystories", "validation-sample.txt")
TEST_FIRST = 200  # niah.c's NIAH_TEST_FIRST
SEED = 0x243F6A8885A308D3  # niah.c's default seed of the niah task
COLOURS = ["blue", "red", "green", "yellow", "white", "black", "brown", "pink", "purple", "orange", "grey", "golden"]
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # chat.h's default
INTRO = b"Read the text below. Somewhere in it is a secret code.\n\n"
PRESSES = ["streaming_llm", "snapkv", "tova", "knorm", "expected_attention"]
POLICIES = ["window", "h2o", "snapkv", "conf"]


class XorShift:
    """niah.c's next_rand: xorshift64 (13, 7, 17)."""

    def __init__(self, seed: int) -> None:
        self.s = seed

    def next(self) -> int:
        x = self.s
        x ^= (x << 13) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 7
        x ^= (x << 17) & 0xFFFFFFFFFFFFFFFF
        self.s = x
        return x


def split_stories(data: bytes) -> List[bytes]:
    marker = b"Once upon a time"
    out, p = [], data.find(marker)
    while p >= 0:
        nx = data.find(marker, p + 1)
        out.append(data[p: nx if nx >= 0 else len(data)].rstrip(b"\n "))
        p = nx
    return out


def chat_ids(tok: Any, user: str) -> List[int]:
    text = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    return tok(text, add_special_tokens=False)["input_ids"]


def build_needles(tok: Any, length: int, k: int) -> List[Dict[str, Any]]:
    """niah.c's build_needle for needles 0..k-1 of one haystack length."""
    stories = split_stories(open(DATA, "rb").read())
    rng = XorShift(SEED)
    needles = []
    for index in range(k):
        s = TEST_FIRST + rng.next() % (len(stories) - TEST_FIRST)
        joined = b""
        while len(joined) < length * 5 + 64:
            joined += (b"\n\n" if joined else b"") + stories[s]
            s = s + 1 if s + 1 < len(stories) else TEST_FIRST
        ids = tok(joined.decode("utf-8", "replace"), add_special_tokens=False)["input_ids"]
        hay = tok.decode(ids[:length], clean_up_tokenization_spaces=False).encode()
        colour = COLOURS[rng.next() % len(COLOURS)]
        value = 1000 + rng.next() % 9000
        depth = (index + 0.5) / k
        at = int(depth * len(hay))
        while at < len(hay) and not (at > 1 and hay[at - 1] in b" \n" and hay[at - 2] in b".\n"):
            at += 1
        sentence = f"The secret code of the {colour} door is {value}. ".encode()
        question = f"\n\nQuestion: what is the secret code of the {colour} door? Answer with the number only."
        body = INTRO + hay[:at] + sentence + hay[at:]
        full = chat_ids(tok, (body + question.encode()).decode("utf-8", "replace"))
        without = chat_ids(tok, body.decode("utf-8", "replace"))
        q = 0
        while q < len(full) and q < len(without) and full[q] == without[q]:
            q += 1
        prefix = f"The secret code of the {colour} door is"
        pre = tok(prefix, add_special_tokens=False)["input_ids"]
        fa = tok(f"{prefix} {value}", add_special_tokens=False)["input_ids"]
        assert fa[: len(pre)] == pre and len(fa) > len(pre), "the answer must extend the prefix's tokens"
        needles.append({"index": index, "depth": depth, "colour": colour, "value": value,
                        "prompt": full + pre, "question": max(q - 1, 0), "answer": fa[len(pre):]})
    return needles


def make_press(name: str, ratio: float) -> Any:
    import kvpress

    cls = {"streaming_llm": kvpress.StreamingLLMPress, "snapkv": kvpress.SnapKVPress, "tova": kvpress.TOVAPress,
           "knorm": kvpress.KnormPress, "expected_attention": kvpress.ExpectedAttentionPress}[name]
    return cls(compression_ratio=ratio)


def feed(model: Any, ids: List[int], cache: Any, kw: str, chunk: int, last_only: bool = False) -> Any:
    """ids through the model in forwards of at most chunk tokens; with a KvcdCache, each forward
    ends at the session's limit at the latest (KvcdCache.room(): a budgeted policy plans when a
    layer reaches it). The logits of every position ([n, vocab]), or of the last (last_only)."""
    import torch

    out, i = [], 0
    while i < len(ids):
        n = min(chunk, len(ids) - i, cache.room() if hasattr(cache, "room") else chunk)
        o = model(torch.tensor([ids[i:i + n]]), use_cache=True, logits_to_keep=1 if last_only else 0, **{kw: cache})
        out.append(o.logits[0])
        i += n
    return out[-1] if last_only else torch.cat(out)


def run_one(model: Any, nd: Dict[str, Any], kind: str, name: str, ratio: float, client: Any, chunk: int,
            decode: int, kw: str) -> Dict[str, Any]:
    """One needle through one configuration: hit, log p, decode ms per token, tokens held."""
    import contextlib

    import torch
    from transformers import DynamicCache

    from kvcd.transformers import KvcdCache

    ctx, rest = nd["prompt"][: nd["question"]], nd["prompt"][nd["question"]:]
    answer = nd["answer"]
    budget = int(round((1 - ratio) * len(ctx)))
    press: Any = contextlib.nullcontext()
    res: Dict[str, Any] = {"kind": kind, "name": name, "ratio": ratio, "needle": nd["index"], "depth": nd["depth"],
                           "context": len(ctx), "budget": budget if kind != "full" else len(ctx)}
    cache: Any = None
    try:
        if kind == "kvcd":
            # snapkv compresses the prompt once (no hysteresis, no slack parameter)
            cache = KvcdCache(client, model, policy=name, budget=budget,
                              params=None if name == "snapkv" else {"slack": chunk}, prompt_tokens=len(ctx))
        else:
            cache = DynamicCache(config=model.config)
            if kind == "kvpress":
                press = make_press(name, ratio)(model)
        with torch.no_grad():
            t0 = time.perf_counter()
            with press:
                feed(model, ctx, cache, kw, chunk if kind == "kvcd" else len(ctx), last_only=True)
            res["prefill_s"] = time.perf_counter() - t0
            logits = feed(model, rest + answer[:-1], cache, kw, chunk if kind == "kvcd" else len(rest) + len(answer))
            logp = torch.log_softmax(logits[len(rest) - 1:].float(), dim=-1)
            res["hit"] = all(int(logp[i].argmax()) == t for i, t in enumerate(answer))
            res["logp"] = float(sum(logp[i, t] for i, t in enumerate(answer)))
            res["held"] = (cache.session.layer_tokens(0) if kind == "kvcd" else int(cache.layers[0].keys.shape[2]))
            nxt, times = int(logits[-1].argmax()), []
            for _ in range(decode):
                t = time.perf_counter()
                out = model(torch.tensor([[nxt]]), use_cache=True, **{kw: cache})
                nxt = int(out.logits[0, -1].argmax())
                times.append(time.perf_counter() - t)
            res["decode_tps"] = 1.0 / statistics.median(times)
    except Exception as e:  # a press or policy that does not run here is reported, not hidden
        res["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        if kind == "kvcd" and cache is not None:
            stats = cache.close()
            if stats is not None:
                res["peak_tokens"] = stats.peak_tokens
    return res


def start_kvcd(build: str) -> Tuple[subprocess.Popen, str, str]:
    """kvcd in a private runtime directory, waited for through NOTIFY_SOCKET (READY=1)."""
    root = tempfile.mkdtemp(prefix="kvcd-kvpress-")
    run, notify = os.path.join(root, "run"), os.path.join(root, "notify")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(notify)
    ns.settimeout(20)
    def die_with_parent() -> None:  # kvcd gets SIGTERM when this script dies (a killed run)
        import ctypes

        ctypes.CDLL(None).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM

    proc = subprocess.Popen([os.path.join(build, "bin", "kvcd"), "--runtime-dir", run, "--capacity", "1G"],
                            env=dict(os.environ, NOTIFY_SOCKET=notify), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    try:
        while b"READY=1" not in ns.recv(4096):
            pass
    finally:
        ns.close()
    return proc, run, root


def table(rows: List[Dict[str, Any]]) -> str:
    """The markdown table: one row per configuration, over needles."""
    groups: Dict[Tuple[str, str, float], List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["kind"], r["name"], r["ratio"]), []).append(r)
    full = [r for r in rows if r["kind"] == "full" and "error" not in r]
    full_tps = statistics.median(r["decode_tps"] for r in full) if full else float("nan")
    out = ["| method | ratio | kept of the context | held at the answer | exact match | mean log p | decode tok/s |"
           " vs full | prefill s |", "|---|---|---|---|---|---|---|---|---|"]
    for (kind, name, ratio), rs in groups.items():
        label = {"full": "full (DynamicCache)", "kvpress": f"kvpress {name}", "kvcd": f"kvcd {name}"}[kind]
        bad = [r for r in rs if "error" in r]
        if bad:
            out.append(f"| {label} | {ratio:.2f} | {rs[0]['budget']} | - | did not run: {bad[0]['error']} | | | | |")
            continue
        tps = statistics.median(r["decode_tps"] for r in rs)
        out.append(f"| {label} | {ratio:.2f} | {statistics.median(r['budget'] for r in rs):.0f} |"
                   f" {statistics.median(r['held'] for r in rs):.0f} | {sum(r['hit'] for r in rs)}/{len(rs)} |"
                   f" {statistics.mean(r['logp'] for r in rs):.2f} | {tps:.1f} | {tps / full_tps:.2f}x |"
                   f" {statistics.median(r['prefill_s'] for r in rs):.1f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--needles", type=int, default=3)
    ap.add_argument("--ratios", default="0.5,0.75")
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--out", default=None, help="JSON lines, one per needle and configuration")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    build = os.path.abspath(a.build)
    os.environ["KVC_LIBRARY"] = os.path.join(build, "lib", "libkvc.so")
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    import torch

    torch.set_num_threads(1)
    import kvcd
    from kvcd.transformers import load_smollm2
    from transformers import LlamaForCausalLM

    kw = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
    model, tok = load_smollm2(MODEL)
    needles = build_needles(tok, a.length, a.needles)
    ratios = [float(x) for x in a.ratios.split(",")]
    configs = [("full", "full", 0.0)]
    configs += [("kvpress", p, r) for r in ratios for p in a.presses.split(",") if p]
    configs += [("kvcd", p, r) for r in ratios for p in a.policies.split(",") if p]
    proc, run, root = start_kvcd(build)
    rows: List[Dict[str, Any]] = []
    sink = open(a.out, "a") if a.out else None
    try:
        with kvcd.connect(run, name="kvpress-bench") as client:
            for nd in needles:
                for kind, name, ratio in configs:
                    r = run_one(model, nd, kind, name, ratio, client, a.chunk, a.decode, kw)
                    rows.append(r)
                    print(json.dumps(r), file=sys.stderr, flush=True)
                    if sink:
                        sink.write(json.dumps(r) + "\n")
                        sink.flush()
    finally:
        if sink:
            sink.close()
        proc.terminate()
        proc.wait(timeout=20)
        shutil.rmtree(root, ignore_errors=True)
    import transformers

    print(f"SmolLM2-135M-Instruct (float32, 1 thread), haystacks of {a.length} tokens, {a.needles} needles,"
          f" decode {a.decode} tokens, kvcd chunk/slack {a.chunk}; transformers {transformers.__version__},"
          f" torch {torch.__version__}, kvpress {__import__('importlib.metadata').metadata.version('kvpress')}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
