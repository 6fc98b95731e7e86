#!/usr/bin/env python3
"""bench/kvpress_bench.py: kvcd's policies (through kvcd.transformers.KvcdCache) against kvpress's
presses on SmolLM2, needle in a haystack, the same kept tokens (issue 20, "The peer, side by side").

    build/venv-kvpress/bin/python bench/kvpress_bench.py --build build/dev [--length 2048]
        [--needles 3] [--ratios 0.5,0.75] [--decode 16] [--chunk 64] [--out FILE.jsonl]
    build/venv-kvpress/bin/python bench/kvpress_bench.py --tokens niah_tokens.txt \
        --questions niah_questions.txt --raw RAW [--presses kvzip,snapkv,streaming_llm] [--ratios ...]

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
  the question is seen; the question and answer then go in uncompressed, at their own positions
  (position_ids, as kvpress's pipeline passes them: without them a compressed cache's length
  would be taken for the next position, and the question would sit next to the kept tokens).
  KVzip ("kvzip") scores the context by making the model repeat it (2-3 times the prefill's
  cost), across layers (not each layer at the ratio), and evicts by masking keys in place
  (kvpress's attention_patch): the cache keeps every token, and "bytes" counts the unmasked.
- kvcd: KvcdCache with the policy at budget = (1 - ratio) x context tokens per layer, the context
  prefilled in --chunk-token forwards with kvcd's plans between them (slack = the chunk: a layer
  holds at most budget + chunk), prompt_tokens = the context (the prefill policies compress it
  once it is in); the policies that rank by attention score with the last 64 queries of each
  forward (KvcdCache's prefill_window) and with every decode query.

"held" in the table is what layer 0 held when the answer was read: the compressed context plus
the question for kvpress; kvcd's is between budget and budget + slack, plus the question.

With --tokens (issue 27, bench/niah-peers.sh): the needles are kvc-eval's own, dumped by `kvc-eval
--task niah --dump-tokens` (token ids, so no tokenizer stands between them), the context ends at
the dump's question position, and only the full cache and the presses run (kvc-eval scores kvcd);
each result is a llama-tiers raw line (run_dumped) for `llama-tiers niah-report`, with the bytes
held at the answer over all layers as a fraction of the full cache's (held_fraction).
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
           "knorm": kvpress.KnormPress, "expected_attention": kvpress.ExpectedAttentionPress,
           "kvzip": kvpress.KVzipPress}[name]
    return cls(compression_ratio=ratio)


def kvzip_tokenizer(tok: Any) -> None:
    """KVzipPress loads its tokenizer with AutoTokenizer.from_pretrained(model.config.name_or_path):
    a GGUF's folder, which has no tokenizer files. It gets the GGUF's (the same vocabulary and chat
    template) instead; it tokenizes its own prompts with it ("Repeat the previous context exactly."
    and the chat template's prefix and suffix), never the needles."""
    from kvpress.presses import kvzip_press

    class Tokenizer:
        @staticmethod
        def from_pretrained(*args: Any, **kwargs: Any) -> Any:
            return tok

    kvzip_press.AutoTokenizer = Tokenizer


def held_fraction(model: Any, cache: Any, seen: int) -> float:
    """What a DynamicCache holds, over all layers and KV heads, as a fraction of every position
    seen (the bytes at any one precision as a fraction of the full cache's): the tokens a press
    left, less the keys a head-wise press (KVzip, kvpress's attention_patch) masks in place."""
    held = 0.0
    for li, layer in enumerate(cache.layers):
        masked = getattr(model.model.layers[li].self_attn, "masked_key_indices", None)
        held += layer.keys.shape[2] - (len(masked[0]) / layer.keys.shape[1] if masked is not None else 0)
    return held / (seen * len(cache.layers))


def feed(model: Any, ids: List[int], cache: Any, kw: str, chunk: int, last_only: bool = False, start: int = 0) -> Any:
    """ids, at positions start on, through the model in forwards of at most chunk tokens; with a
    KvcdCache, each forward ends at the session's limit at the latest (KvcdCache.room(): a budgeted
    policy plans when a layer reaches it). The positions are passed, as kvpress's pipeline passes
    them: a compressed DynamicCache's length is not the position of the next token. The logits of
    every position ([n, vocab]), or of the last (last_only)."""
    import torch

    out, i = [], 0
    while i < len(ids):
        n = min(chunk, len(ids) - i, cache.room() if hasattr(cache, "room") else chunk)
        pos = torch.arange(start + i, start + i + n)[None]
        o = model(torch.tensor([ids[i:i + n]]), position_ids=pos, use_cache=True,
                  logits_to_keep=1 if last_only else 0, **{kw: cache})
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
            logits = feed(model, rest + answer[:-1], cache, kw, chunk if kind == "kvcd" else len(rest) + len(answer),
                          start=len(ctx))
            logp = torch.log_softmax(logits[len(rest) - 1:].double(), dim=-1)
            res["hit"] = all(int(logp[i].argmax()) == t for i, t in enumerate(answer))
            res["logp"] = float(sum(logp[i, t] for i, t in enumerate(answer)))
            res["held"] = (cache.session.layer_tokens(0) if kind == "kvcd" else int(cache.layers[0].keys.shape[2]))
            if kind != "kvcd":
                res["bytes"] = held_fraction(model, cache, len(ctx) + len(rest) + len(answer) - 1)
            pos, nxt, times = len(ctx) + len(rest) + len(answer) - 1, int(logits[-1].argmax()), []
            for i in range(decode):
                t = time.perf_counter()
                out = model(torch.tensor([[nxt]]), position_ids=torch.tensor([[pos + i]]), use_cache=True,
                            **{kw: cache})
                nxt = int(out.logits[0, -1].argmax())
                times.append(time.perf_counter() - t)
            if times:
                res["decode_tps"] = 1.0 / statistics.median(times)
    except Exception as e:  # a press or policy that does not run here is reported, not hidden
        res["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        if kind == "kvcd" and cache is not None:
            stats = cache.close()
            if stats is not None:
                res["peak_tokens"] = stats.peak_tokens
    return res


def read_needles(tokens: str, questions: str) -> List[Dict[str, Any]]:
    """The needles of `kvc-eval --task niah --dump-tokens`: niah_tokens.txt's "needle LENGTH K
    N_PROMPT N_ANSWER ids answer" (the prompt ends with the answer's prefix) and
    niah_questions.txt's "LENGTH K QUESTION DEPTH" (the context a press compresses ends at QUESTION)."""
    where = {}
    for line in open(questions):
        f = line.split()
        where[(int(f[0]), int(f[1]))] = (int(f[2]), float(f[3]))
    needles = []
    for line in open(tokens):
        f = line.split()
        if not f or f[0] != "needle":
            continue
        length, index, n_prompt, n_answer = (int(x) for x in f[1:5])
        ids = [int(x) for x in f[5:]]
        if len(ids) != n_prompt + n_answer:
            raise ValueError(f"{tokens}: needle {length} {index} has {len(ids)} ids, not {n_prompt + n_answer}")
        question, depth = where[(length, index)]
        needles.append({"length": length, "index": index, "depth": depth, "prompt": ids[:n_prompt],
                        "question": question, "answer": ids[n_prompt:]})
    return needles


def run_dumped(model: Any, needles: List[Dict[str, Any]], configs: List[Tuple[str, str, float]], raw: str,
               kw: str) -> None:
    """--tokens: every configuration (the full cache and the presses) on every dumped needle, one
    llama-tiers raw line each into raw ("needle LENGTH K NAME HIT LOGP BYTES", NAME kvpress-full or
    PRESS@RATIO), flushed per line; lines already in raw are not run again. A configuration that
    fails says so in raw.errors ("LENGTH K NAME ERROR") and on stderr, and has no raw line."""
    done = set()
    if os.path.exists(raw):
        for line in open(raw):
            f = line.split()
            if len(f) >= 4 and f[0] == "needle":
                done.add((int(f[1]), int(f[2]), f[3]))
    with open(raw, "a") as sink, open(raw + ".errors", "a") as errors:
        for nd in needles:
            for kind, name, ratio in configs:
                label = "kvpress-full" if kind == "full" else f"{name}@{ratio:.2f}"
                if (nd["length"], nd["index"], label) in done:
                    continue
                r = run_one(model, nd, kind, name, ratio, None, len(nd["prompt"]), 0, kw)
                r["length"] = nd["length"]
                print(json.dumps(r), file=sys.stderr, flush=True)
                if "error" in r:
                    errors.write(f"{nd['length']} {nd['index']} {label} {r['error']}\n")
                    errors.flush()
                    continue
                sink.write(f"needle {nd['length']} {nd['index']} {label} {int(r['hit'])} {r['logp']:.6f}"
                           f" {r['bytes']:.6f}\n")
                sink.flush()


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
    ap.add_argument("--tokens", default=None, help="kvc-eval --task niah --dump-tokens's niah_tokens.txt: score"
                    " its needles with the full cache and the presses (no kvcd) into --raw")
    ap.add_argument("--questions", default=None, help="with --tokens: its niah_questions.txt")
    ap.add_argument("--raw", default=None, help="with --tokens: llama-tiers raw lines (appended, resumed)")
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
    kvzip_tokenizer(tok)
    ratios = [float(x) for x in a.ratios.split(",")]
    configs = [("full", "full", 0.0)]
    configs += [("kvpress", p, r) for r in ratios for p in a.presses.split(",") if p]
    if a.tokens:
        if not a.questions or not a.raw:
            ap.error("--tokens needs --questions and --raw")
        run_dumped(model, read_needles(a.tokens, a.questions), configs, a.raw, kw)
        return 0
    needles = build_needles(tok, a.length, a.needles)
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
