#!/usr/bin/env python3
"""bench/transformers_bench.py: kvcd.transformers.KvcdCache against transformers' DynamicCache on
SmolLM2 (issue 20's targets): decode time per token and the process's resident memory at a long
context, one thread.

    build/venv-torch/bin/python bench/transformers_bench.py --build build/dev [--context 4096]
        [--decode 32] [--chunk 128] [--rounds 2] [--modes dynamic,full,window,h2o]

Each (mode, round) runs in a child process of its own (so that its RSS is its own): it loads the
model, prefills a --context-token prompt (SmolLM2's tokens of a repeated story text; what the
tokens say does not matter here) in --chunk-token pieces (default 128: a budgeted session
holds at most its limit, so a longer prompt goes in piece by piece with kvcd's plan applied
between pieces, the policy's slack set to the chunk; every mode is prefilled the same way), then decodes --decode tokens greedily by hand (one forward per
token, argmax) and reports the median decode time per token, VmRSS and VmHWM after the run and
after loading the model. kvcd modes talk to a kvcd this script starts for the run (a private
runtime directory, --capacity 1G); window and h2o run at a budget of a quarter of the context.
Rounds are interleaved (dynamic, full, window, ... then again) and the table gives the median
over rounds, so that the shared machine's load falls on every mode alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.environ.get("KVC_SMOLLM2", os.path.expanduser("~/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf"))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def child(mode: str, context: int, decode: int, sock: str, chunk: int) -> dict:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    import kvcd
    from kvcd.transformers import KvcdCache, load_smollm2
    from transformers import DynamicCache

    model, tok = load_smollm2(MODEL)
    text = "Once upon a time, in a small village by the sea, there lived an old fisherman and his cat. " * 400
    ids = tok(text, add_special_tokens=False)["input_ids"][:context]
    assert len(ids) == context
    rss_model = _status_kib("VmRSS")
    client = None
    if mode == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        client = kvcd.connect(sock, name=f"bench-{mode}")
        budget = 0 if mode == "full" else context // 4
        # slack = the prefill chunk: the session's limit (budget + slack) must hold the kept
        # tokens plus one chunk
        cache = KvcdCache(client, model, policy=mode, budget=budget,
                          params=None if mode == "full" else {"slack": chunk})
    times = []
    with torch.no_grad():
        t0 = time.perf_counter()
        # in chunks: a budgeted session holds at most its limit, so a prompt longer than that
        # goes in piece by piece, kvcd's plan applied between pieces (every mode alike)
        for i in range(0, len(ids), chunk):
            out = model(torch.tensor([ids[i:i + chunk]]), cache=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        nxt = int(out.logits[0, -1].argmax())
        gen = [nxt]
        for _ in range(decode - 1):
            t = time.perf_counter()
            out = model(torch.tensor([[nxt]]), cache=cache, use_cache=True)
            nxt = int(out.logits[0, -1].argmax())
            times.append(time.perf_counter() - t)
            gen.append(nxt)
    res = {
        "mode": mode,
        "context": context,
        "decode_ms": 1000 * statistics.median(times),
        "prefill_s": prefill_s,
        "rss_kib": _status_kib("VmRSS"),
        "hwm_kib": _status_kib("VmHWM"),
        "rss_model_kib": rss_model,
        "tokens": gen,
    }
    if client is not None:
        res["stored_tokens"] = cache.session.layer_tokens(0)
        stats = cache.close()
        res["peak_tokens"] = stats.peak_tokens
        client.close()
    return res


def start_kvcd(build: str) -> tuple:
    root = tempfile.mkdtemp(prefix="kvcd-bench-")
    run = os.path.join(root, "run")
    notify = os.path.join(root, "notify")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(notify)
    ns.settimeout(20)
    proc = subprocess.Popen([os.path.join(build, "bin", "kvcd"), "--runtime-dir", run, "--capacity", "1G"],
                            env=dict(os.environ, NOTIFY_SOCKET=notify), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    end = time.monotonic() + 20
    while time.monotonic() < end:
        if b"READY=1" in ns.recv(4096):
            break
    ns.close()
    return proc, run, root


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="dynamic,full,window,h2o")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--child", default=None)
    ap.add_argument("--socket", default=None)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.context, a.decode, a.socket, a.chunk)))
        return 0
    build = os.path.abspath(a.build)
    os.environ["KVC_LIBRARY"] = os.path.join(build, "lib", "libkvc.so")
    proc, run, root = start_kvcd(build)
    results: dict = {}
    try:
        for r in range(a.rounds):
            for mode in a.modes.split(","):
                out = subprocess.run([sys.executable, __file__, "--child", mode, "--socket", run, "--context",
                                      str(a.context), "--decode", str(a.decode), "--chunk", str(a.chunk)], capture_output=True, text=True,
                                     env=dict(os.environ, HF_HUB_OFFLINE="1"))
                if out.returncode != 0:
                    print(f"round {r} {mode} failed: {out.stderr[-2000:]}", file=sys.stderr)
                    continue
                res = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault(mode, []).append(res)
                print(f"round {r} {mode}: {res['decode_ms']:.1f} ms/token, RSS {res['rss_kib'] / 1024:.0f} MiB",
                      file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        shutil.rmtree(root, ignore_errors=True)
    base = results.get("dynamic")
    bd = statistics.median(x["decode_ms"] for x in base) if base else None
    brss = statistics.median(x["rss_kib"] - x["rss_model_kib"] for x in base) if base else None
    print(f"| mode | budget | decode ms/token | vs DynamicCache | prefill s | RSS MiB | RSS over the model MiB"
          f" | vs DynamicCache | tokens held | same tokens as DynamicCache |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, rs in results.items():
        d = statistics.median(x["decode_ms"] for x in rs)
        rss = statistics.median(x["rss_kib"] for x in rs) / 1024
        over = statistics.median(x["rss_kib"] - x["rss_model_kib"] for x in rs)
        same = base is not None and rs[0]["tokens"] == base[0]["tokens"]
        budget = {"dynamic": "-", "full": "all"}.get(mode, str(a.context // 4))
        print(f"| {mode} | {budget} | {d:.1f} | {d / bd:.3f}x | {statistics.median(x['prefill_s'] for x in rs):.1f}"
              f" | {rss:.0f} | {over / 1024:.0f} | {over / brss:.3f}x | {rs[0].get('stored_tokens', a.context + a.decode - 1)}"
              f" | {'yes' if same else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
