#!/usr/bin/env python3
"""bench/tiers_quanto.py: transformers' QuantizedCache (the quanto backend, 4 and 2 bits) on the exact
token sequences of `kvc-eval --task tiers` (issue 26, the peers beside kvcd's tiers) and of `kvc-eval
--task niah --suite ladder` (issue 27: needles only). Run by bench/tiers-peers.sh (QUANTO=1) and
bench/niah-peers.sh in build/venv-kvpress (`make kvpress-deps`, with optimum-quanto).

    tiers_quanto.py --model GGUF --tokens tiers_tokens.txt --raw RAW [--part needles|docs|all]

The model is SmolLM2 dequantized to float32 by transformers' GGUF loader; the reference is its
DynamicCache (float32: the reference of this table is f32, not f16). QuantizedCache(backend quanto,
nbits 4 or 2, q_group_size 64, residual_length 128, axis 0 for keys and values: the defaults) keeps
the last tokens (up to 128) in float32 and quantizes the rest, like kvcd's tiers; but it quantizes
only what an earlier forward pass stored: the tokens of one forward attend to each other in full
precision. So:

  needles  the prompt (haystack and question) is one prefill, in full precision; the cache is then
           quantized and only the answer's tokens (teacher-forced one at a time, exact match as
           tiers.c scores it) meet quantized keys and values. The prefill is run once with a
           DynamicCache and its keys and values handed to each QuantizedCache through update(),
           which is what QuantizedCache does with a prefill (quantize everything it is given,
           return it unquantized), so the first answer token's logits are the reference's.
  docs     teacher-forced in chunks of --chunk (128) tokens, all configurations in lockstep: each
           chunk attends to the earlier chunks quantized (less the residual) and to itself in
           full precision. Scored from position 143 on, as tiers.c: NLL, KL(f32 || type), top-1.
           One forward of the whole document would quantize nothing.

RAW gets llama-tiers' raw lines ("doc D TYPE SCORED NLL KL TOP1", "needle LENGTH K TYPE HIT LOGP
BYTES": the answer's summed log probability, and the bytes the cache holds when the answer is read
as a fraction of the same cache at FP16, fp16_fraction's), appended and flushed per sequence, so
`llama-tiers report` and `niah-report` make the tables.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

SCORE_FROM = 144  # tiers.c: TIERS_WINDOW + 16


def read_seqs(path):
    seqs = []
    for line in open(path):
        f = line.split()
        if f[0] == "doc":
            seqs.append({"kind": "doc", "index": int(f[1]), "ids": [int(x) for x in f[3:]]})
        elif f[0] == "needle":
            n_prompt, n_answer = int(f[3]), int(f[4])
            ids = [int(x) for x in f[5:]]
            assert len(ids) == n_prompt + n_answer
            seqs.append({"kind": "needle", "length": int(f[1]), "index": int(f[2]), "n_prompt": n_prompt, "ids": ids})
    return seqs


def fp16_fraction(cache) -> float:
    """The bytes a cache holds as a fraction of the same tokens at FP16: quanto's packed values at
    their bits, each group's scale and shift at 2 bytes (as a half-precision model stores them; this
    float32 run keeps them in float32, twice that), unquantized (residual) tokens at 2 bytes. A
    DynamicCache is 1."""
    held = full = 0.0
    for layer in cache.layers:
        for q, r in ((getattr(layer, "_quantized_keys", None), layer.keys),
                     (getattr(layer, "_quantized_values", None), layer.values)):
            n = r.numel() if r is not None else 0
            held += 2 * n
            full += 2 * n
            if q is not None:
                groups = q._scale.numel() + (q._shift.numel() if getattr(q, "_shift", None) is not None else 0)
                held += q.numel() * layer.nbits / 8 + 2 * groups
                full += 2 * q.numel()
    return held / full


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--raw", required=True)
    ap.add_argument("--part", default="all", choices=["needles", "docs", "all"])
    ap.add_argument("--nbits", default="4,2")
    ap.add_argument("--chunk", type=int, default=128)
    a = ap.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache, QuantizedCache

    torch.set_num_threads(1)
    d, f = os.path.split(os.path.abspath(os.path.expanduser(a.model)))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    nbits = [int(x) for x in a.nbits.split(",")]
    names = ["f32"] + [f"quanto-int{b}" for b in nbits]

    def new_cache(b):
        if b is None:
            return DynamicCache(config=model.config)
        return QuantizedCache("quanto", model.config, nbits=b, q_group_size=64, residual_length=128)

    raw = open(a.raw, "a")
    t0 = time.time()
    seqs = [s for s in read_seqs(a.tokens) if a.part == "all" or s["kind"] + "s" == a.part]
    with torch.inference_mode():
        for s in seqs:
            ids = s["ids"]
            if s["kind"] == "needle":
                np_ = s["n_prompt"]
                ref = new_cache(None)
                out = model(input_ids=torch.tensor([ids[:np_]]), past_key_values=ref, use_cache=True, logits_to_keep=1)
                lp = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
                first, first_logp = int(lp.argmax()), float(lp[ids[np_]])
                caches = [ref]
                for b in nbits:
                    q = new_cache(b)
                    for li, layer in enumerate(ref.layers):
                        q.update(layer.keys.clone(), layer.values.clone(), li)
                    caches.append(q)
                for name, cache in zip(names, caches):
                    hit, logp = first == ids[np_], first_logp
                    for p in range(np_, len(ids) - 1):
                        o = model(input_ids=torch.tensor([[ids[p]]]), past_key_values=cache, use_cache=True)
                        lp = torch.log_softmax(o.logits[0, -1].double(), dim=-1)
                        hit = hit and int(lp.argmax()) == ids[p + 1]
                        logp += float(lp[ids[p + 1]])
                    raw.write(f"needle {s['length']} {s['index']} {name} {int(hit)} {logp:.6f}"
                              f" {fp16_fraction(cache):.6f}\n")
            else:
                caches = [new_cache(None)] + [new_cache(b) for b in nbits]
                n = len(ids)
                nll = [0.0] * len(caches)
                kl = [0.0] * len(caches)
                top1 = [0.0] * len(caches)
                scored = 0
                for pos in range(0, n - 1, a.chunk):
                    k = min(a.chunk, n - 1 - pos)
                    x = torch.tensor([ids[pos : pos + k]])
                    lps = []
                    for c in caches:
                        o = model(input_ids=x, past_key_values=c, use_cache=True)
                        lps.append(torch.log_softmax(o.logits[0].double(), dim=-1))
                    lo = max(0, SCORE_FROM - 1 - pos)
                    if lo >= k:
                        continue
                    tgt = torch.tensor(ids[pos + 1 + lo : pos + 1 + k])
                    ref = lps[0][lo:k]
                    ref_top = ref.argmax(-1)
                    for ci, lp in enumerate(lps):
                        lp = lp[lo:k]
                        nll[ci] -= float(lp.gather(1, tgt[:, None]).sum())
                        kl[ci] += float((ref.exp() * (ref - lp)).sum()) if ci else 0.0
                        top1[ci] += float((lp.argmax(-1) == ref_top).sum())
                    scored += k - lo
                for ci, name in enumerate(names):
                    raw.write(f"doc {s['index']} {name} {scored} {nll[ci]:.9g} {kl[ci]:.9g} {top1[ci]:.0f}\n")
            raw.flush()
            print(f"tiers_quanto: {s['kind']} {s.get('length', len(ids))} {s['index']} done, {time.time() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
