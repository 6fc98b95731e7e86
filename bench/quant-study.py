#!/usr/bin/env python3
"""quant-study.py: candidate KV-cache quantizers measured on SmolLM2's real keys, values and queries.

Input: one or more dumps written by bench/kv-dump (post-RoPE q, k, v and the plain cache's attention
output o of a few layers, every position of a text). For every (text, layer, KV head) and every
candidate, the keys and values of all T tokens are quantized the way kvcd would store them (per KV
head, per 16-token block of one layer) and dequantized; then, for every query position t >= 128
(--from) of the KV head's query heads, the causal attention over positions 0..t is computed with the
dequantized keys and values and compared with the exact one:

  key / value rel MSE   sum ||x' - x||^2 / sum ||x||^2 over all tokens
  logit err             RMS over j <= t of (q.k'_j - q.k_j)/sqrt(D), divided by the standard deviation
                        over j <= t of the exact logits q.k_j/sqrt(D) (the logits' spread)
  o err                 ||o' - o|| / ||o||, o the attention output (softmax with 1/sqrt(64))
  KL                    KL(p || p') of the attention distributions over j <= t, nats
  o err w128, KL w128   the same with the most recent 128 positions (t-127..t) exact, as kvcd's
                        recent full-precision window keeps them (everything older quantized)

each averaged over texts, layers, query heads and positions. Bits per value count the codes and the
metadata (scales, zero points, norms) at the stated precision (f16 unless the name says f32).

Also: the Lloyd-Max codebooks for N(0,1) at 1-4 bits (Lloyd iteration on a fine grid, checked against
the closed-form conditional means), and the cost of a second rounding (kvcd's INT8 tier, then
requantized to 4, 3 or 2 bits from the dequantized values, against quantizing the float directly).

  build/venv/bin/python bench/quant-study.py [--from 128] [--stride 1] [--only lm] DUMP...
"""
import argparse
import math
import sys
import time

import numpy as np

BLOCK = 16  # kvcd's block: 16 tokens of one layer

# ---------------------------------------------------------------------------------------------
# dumps


def load_dump(path):
    with open(path, "rb") as f:
        hdr = np.frombuffer(f.read(64), dtype="<i4")
        if hdr[0] != 0x504D444B or hdr[1] != 1:
            raise SystemExit(f"{path}: not a kv-dump file")
        n_dump, T, H, KVH, D = (int(x) for x in hdr[2:7])
        layers = np.frombuffer(f.read(4 * n_dump), dtype="<i4").tolist()
        tokens = np.frombuffer(f.read(4 * T), dtype="<i4")
        out = {}
        for l in layers:
            q = np.frombuffer(f.read(4 * T * H * D), dtype="<f4").reshape(T, H, D)
            k = np.frombuffer(f.read(4 * T * KVH * D), dtype="<f4").reshape(T, KVH, D)
            v = np.frombuffer(f.read(4 * T * KVH * D), dtype="<f4").reshape(T, KVH, D)
            o = np.frombuffer(f.read(4 * T * H * D), dtype="<f4").reshape(T, H, D)
            out[l] = (q, k, v, o)
    return dict(T=T, H=H, KVH=KVH, D=D, layers=layers, tokens=tokens, data=out)


# ---------------------------------------------------------------------------------------------
# Lloyd-Max codebooks for N(0, 1)


def lloyd_max(bits, lo=-12.0, hi=12.0, n=2_400_001, tol=1e-15, max_iter=1_000_000):
    """Lloyd iteration on a grid of n points over [lo, hi] weighted by the N(0,1) density: thresholds
    at the midpoints of the centroids, centroids the conditional means of their cells. The cells'
    masses and first moments are the cumulative trapezoid integrals over the grid, read at the
    thresholds by linear interpolation (so a threshold is not snapped to a grid point)."""
    x = np.linspace(lo, hi, n)
    h = x[1] - x[0]
    f = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    F = np.concatenate([[0.0], np.cumsum(0.5 * h * (f[1:] + f[:-1]))])  # int_lo^x phi
    xf = x * f
    G = np.concatenate([[0.0], np.cumsum(0.5 * h * (xf[1:] + xf[:-1]))])  # int_lo^x t phi(t) dt
    L = 1 << bits
    c = np.array([math.sqrt(2) * _erfinv(2 * (i + 0.5) / L - 1) for i in range(L)])
    for it in range(max_iter):
        t = 0.5 * (c[1:] + c[:-1])
        Ft = np.concatenate([[F[0]], np.interp(t, x, F), [F[-1]]])
        Gt = np.concatenate([[G[0]], np.interp(t, x, G), [G[-1]]])
        new = np.diff(Gt) / np.diff(Ft)
        new = 0.5 * (new - new[::-1])  # the density is symmetric: keep the codebook exactly so
        done = np.max(np.abs(new - c)) < tol
        c = new
        if done:
            break
    t = 0.5 * (c[1:] + c[:-1])
    return c, t, it + 1


def lloyd_max_extrapolated(bits):
    """The grid's error is O(h^2): Lloyd on grids of step h and h/2, Richardson-extrapolated."""
    c1, _, i1 = lloyd_max(bits, n=1_200_001)
    c2, _, i2 = lloyd_max(bits, n=2_400_001)
    c = (4 * c2 - c1) / 3
    return c, 0.5 * (c[1:] + c[:-1]), c1, c2, i1 + i2


def lloyd_polish(c, iters=2000):
    """The same Lloyd iteration with the cells' closed-form conditional means E[X | a < X < b] =
    (phi(a) - phi(b)) / (Phi(b) - Phi(a)), started from the grid's codebook (its fixed point to
    float64 precision)."""
    L = len(c)
    e = [float(x) for x in c]
    for _ in range(iters):
        th = [-math.inf] + [0.5 * (e[j] + e[j + 1]) for j in range(L - 1)] + [math.inf]
        ne = []
        for j in range(L):
            a, b = th[j], th[j + 1]
            pa = 0.0 if a == -math.inf else _phi(a)
            pb = 0.0 if b == math.inf else _phi(b)
            ne.append((pa - pb) / (_Phi(b) - _Phi(a)))
        ne = [0.5 * (ne[j] - ne[L - 1 - j]) for j in range(L)]
        if max(abs(x - y) for x, y in zip(ne, e)) == 0:
            e = ne
            break
        e = ne
    c = np.array(e)
    return c, 0.5 * (c[1:] + c[:-1])


def _erfinv(y):
    # Newton on erf; only for the initial codebook
    x = 0.0
    for _ in range(100):
        x -= (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


def _phi(x):
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _Phi(x):
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def lm_closed_form_check(c, t):
    """Max |centroid - E[X | cell]| with the cells' closed-form conditional means, and the MSE."""
    edges = [-math.inf] + list(t) + [math.inf]
    worst, mse = 0.0, 0.0
    for i in range(len(c)):
        a, b = edges[i], edges[i + 1]
        pa = 0.0 if a == -math.inf else _phi(a)
        pb = 0.0 if b == math.inf else _phi(b)
        mass = _Phi(b) - _Phi(a)
        mean = (pa - pb) / mass
        worst = max(worst, abs(mean - c[i]))
        # E[(X - c)^2 ; cell] = E[X^2; cell] - 2c E[X; cell] + c^2 mass
        ax = 0.0 if a == -math.inf else a * _phi(a)
        bx = 0.0 if b == math.inf else b * _phi(b)
        ex2 = mass + ax - bx
        mse += ex2 - 2 * c[i] * (pa - pb) + c[i] * c[i] * mass
    return worst, mse


# ---------------------------------------------------------------------------------------------
# quantizers: X [T, D] (one layer, one KV head, all tokens) -> X' [T, D]


def f16(x):
    return x.astype(np.float16).astype(np.float64)


def meta(x, prec):
    return f16(x) if prec == "f16" else x.astype(np.float32).astype(np.float64)


def q_sym_groups(X, b, g, prec="f16"):
    """llama.cpp q4_0 / q8_0 generalised: per token, groups of g, d = m / -2^(b-1) with m the value of
    largest magnitude (its sign kept: it lands on the extra negative level), codes -2^(b-1)..2^(b-1)-1."""
    T, D = X.shape
    Xg = X.reshape(T, D // g, g)
    i = np.argmax(np.abs(Xg), axis=2)
    m = np.take_along_axis(Xg, i[..., None], axis=2)
    half = 1 << (b - 1)
    d = meta(m / -half, prec)
    inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0)
    q = np.clip(np.floor(Xg * inv + half + 0.5), 0, 2 * half - 1) - half
    return (q * d).reshape(T, D)


def q_asym_groups(X, b, g, prec="f16"):
    """llama.cpp q4_1 generalised: per token, groups of g, min and scale (f16 each)."""
    T, D = X.shape
    Xg = X.reshape(T, D // g, g)
    mn = meta(Xg.min(axis=2, keepdims=True), prec)
    mx = Xg.max(axis=2, keepdims=True)
    d = meta((mx - mn) / ((1 << b) - 1), prec)
    inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0)
    q = np.clip(np.round((Xg - mn) * inv), 0, (1 << b) - 1)
    return (q * d + mn).reshape(T, D)


def q_kivi_keys_asym(X, b, prec="f16"):
    """KIVI keys: per channel over each 16-token block, asymmetric (scale and zero per channel)."""
    T, D = X.shape
    Xb = X.reshape(T // BLOCK, BLOCK, D)
    mn = meta(Xb.min(axis=1, keepdims=True), prec)
    mx = Xb.max(axis=1, keepdims=True)
    d = meta((mx - mn) / ((1 << b) - 1), prec)
    inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0)
    q = np.clip(np.round((Xb - mn) * inv), 0, (1 << b) - 1)
    return (q * d + mn).reshape(T, D)


def q_kivi_keys_sym(X, b, prec="f16"):
    """Keys per channel over each 16-token block, symmetric, one scale per channel (kvcd's INT8 key
    rule at b bits: s = max|x| / (2^(b-1)-1), codes -(2^(b-1)-1)..2^(b-1)-1)."""
    T, D = X.shape
    Xb = X.reshape(T // BLOCK, BLOCK, D)
    lv = (1 << (b - 1)) - 1
    s = meta(np.abs(Xb).max(axis=1, keepdims=True) / lv, prec)
    q = np.clip(np.round(np.divide(Xb, s, out=np.zeros_like(Xb), where=s != 0)), -lv, lv)
    return (q * s).reshape(T, D)


def q_tok_absmax(X, b, prec="f32"):
    """Values per token (whole head vector), symmetric, s = max|x| / (2^(b-1)-1) (kvcd's INT8 value rule)."""
    lv = (1 << (b - 1)) - 1
    s = meta(np.abs(X).max(axis=1, keepdims=True) / lv, prec)
    q = np.clip(np.round(np.divide(X, s, out=np.zeros_like(X), where=s != 0)), -lv, lv)
    return q * s


def q_int8_kvcd_keys(X):
    return q_kivi_keys_sym(X, 8, "f32")


def q_int8_kvcd_values(X):
    return q_tok_absmax(X, 8, "f32")


def hadamard(D):
    Hm = np.array([[1.0]])
    while Hm.shape[0] < D:
        Hm = np.block([[Hm, Hm], [Hm, -Hm]])
    return Hm / math.sqrt(D)


def rotation(layer, head, D, seed=0x6B7663):
    """The fixed randomized Hadamard rotation of (layer, KV head): R = H_norm diag(signs), y = R x."""
    rng = np.random.default_rng([seed, layer, head])
    signs = rng.choice([-1.0, 1.0], size=D)
    return hadamard(D) * signs[None, :]


CODEBOOKS = {}


def q_lm(Y, b, scale, prec="f16", iters=1):
    """Per-token Lloyd-Max codebook for N(0,1) on (already rotated) rows Y with one scale per row:
    'norm': s = ||y|| / sqrt(D); 'ls': codes from the norm scale, then s = <y, c> / <c, c>
    (iters > 1 alternates codes and scale)."""
    c, t = CODEBOOKS[b]
    T, D = Y.shape
    s = np.linalg.norm(Y, axis=1, keepdims=True) / math.sqrt(D)
    for it in range(iters):
        z = np.divide(Y, s, out=np.zeros_like(Y), where=s != 0)
        C = c[np.searchsorted(t, z)]
        if scale == "ls":
            cc = (C * C).sum(axis=1, keepdims=True)
            s = np.divide((Y * C).sum(axis=1, keepdims=True), cc, out=np.zeros_like(cc), where=cc != 0)
    return C * meta(s, prec)


def q_centered(X, R, fn, prec="f16"):
    """Keys: the per-channel mean over each 16-token block stored (f16), the residual rotated and
    quantized per token by fn."""
    T, D = X.shape
    Xb = X.reshape(T // BLOCK, BLOCK, D)
    mu = meta(Xb.mean(axis=1, keepdims=True), prec)
    Rz = (Xb - mu).reshape(T, D)
    return (fn(Rz @ R.T) @ R).reshape(T // BLOCK, BLOCK, D).__add__(mu).reshape(T, D)


# ---------------------------------------------------------------------------------------------
# candidates: name -> (key quantizer, value quantizer, key bits/value, value bits/value)
# a quantizer is f(X, ctx) with ctx = dict(layer, head, D, R)


def rot(fn):
    def g(X, ctx):
        R = ctx["R"]
        return fn(X @ R.T) @ R

    return g


def candidates(b):
    C = {}
    same = lambda f, bits: (f, f, bits, bits)
    C[f"q{b}_0 sym g32"] = same(lambda X, c: q_sym_groups(X, b, 32), b + 16 / 32)
    C[f"q{b}_0 sym g64"] = same(lambda X, c: q_sym_groups(X, b, 64), b + 16 / 64)
    C[f"q{b}_1 asym g32"] = same(lambda X, c: q_asym_groups(X, b, 32), b + 32 / 32)
    C[f"q{b}_1 asym g64"] = same(lambda X, c: q_asym_groups(X, b, 64), b + 32 / 64)
    C[f"KIVI K ch-asym, V asym g32"] = (lambda X, c: q_kivi_keys_asym(X, b), lambda X, c: q_asym_groups(X, b, 32),
                                        b + 32 / BLOCK, b + 32 / 32)
    C[f"KIVI K ch-sym, V asym g64"] = (lambda X, c: q_kivi_keys_sym(X, b), lambda X, c: q_asym_groups(X, b, 64),
                                       b + 16 / BLOCK, b + 32 / 64)
    C[f"LM norm (no rot)"] = same(lambda X, c: q_lm(X, b, "norm"), b + 16 / 64)
    C[f"RHT + LM norm"] = same(rot(lambda Y: q_lm(Y, b, "norm")), b + 16 / 64)
    C[f"RHT + LM ls"] = same(rot(lambda Y: q_lm(Y, b, "ls")), b + 16 / 64)
    C[f"RHT + LM ls x3"] = same(rot(lambda Y: q_lm(Y, b, "ls", iters=3)), b + 16 / 64)
    C[f"RHT + asym g64"] = same(rot(lambda Y: q_asym_groups(Y, b, 64)), b + 32 / 64)
    C[f"RHT + asym g32"] = same(rot(lambda Y: q_asym_groups(Y, b, 32)), b + 32 / 32)
    C[f"RHT + sym g64"] = same(rot(lambda Y: q_sym_groups(Y, b, 64)), b + 16 / 64)
    C[f"KIVI K ch-asym, V RHT + LM ls"] = (lambda X, c: q_kivi_keys_asym(X, b), rot(lambda Y: q_lm(Y, b, "ls")),
                                           b + 32 / BLOCK, b + 16 / 64)
    C[f"K block-mean + RHT + LM ls, V RHT + LM ls"] = (lambda X, c: q_centered(X, c["R"], lambda Y: q_lm(Y, b, "ls")),
                                                       rot(lambda Y: q_lm(Y, b, "ls")), b + 16 / BLOCK + 16 / 64,
                                                       b + 16 / 64)
    if b < 4:
        C[f"RHT + LM ls x3, K {b + 1} bits, V {b} bits"] = (rot(lambda Y: q_lm(Y, b + 1, "ls", iters=3)),
                                                         rot(lambda Y: q_lm(Y, b, "ls", iters=3)),
                                                         b + 1 + 16 / 64, b + 16 / 64)
    C[f"RHT K + LM ls, V asym g64"] = (rot(lambda Y: q_lm(Y, b, "ls")), lambda X, c: q_asym_groups(X, b, 64),
                                       b + 16 / 64, b + 32 / 64)
    return C


def reference_candidates():
    return {
        "INT8 (kvcd Q8, f32 scales)": (lambda X, c: q_int8_kvcd_keys(X), lambda X, c: q_int8_kvcd_values(X),
                                       8 + 32 / BLOCK, 8 + 32 / 64),
        "f16": (lambda X, c: f16(X), lambda X, c: f16(X), 16, 16),
        "evicted (w128: only the window; all: n/a)": (None, None, 0, 0),
    }


def _chain(X, c, fs):
    for f in fs:
        X = f(X, c)
    return X


def demoted(fk, fv):
    """Through kvcd's INT8 tier first: the INT8 codes dequantized, then quantized again."""
    return (lambda X, c: fk(q_int8_kvcd_keys(X), c), lambda X, c: fv(q_int8_kvcd_values(X), c))


# ---------------------------------------------------------------------------------------------
# metrics


METRICS = ["k_mse", "v_mse", "logit", "o", "kl", "o_w", "kl_w"]


NEG = np.float32(-1e30)  # masked logits: exp() gives an exact 0, differences of two masked ones 0


def lse(L):
    m = L.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(L - m).sum(axis=-1, keepdims=True)))[..., 0]


def softmax_log(L):
    m = L.max(axis=-1, keepdims=True)
    z = L - m
    e = np.exp(z)
    s = e.sum(axis=-1, keepdims=True)
    return e / s, z - np.log(s)


class Unit:
    """One (text, layer, KV head): the exact attention for every query position >= from, computed once.
    Query positions go in chunks; a chunk's columns stop at its last position (causal)."""

    def __init__(self, q, k, v, first, stride, window, chunk=256):
        self.q, self.k, self.v = q, k, v  # q [G, T, D] float32, k v [T, D] float64
        T, D = k.shape
        self.T, self.D = T, D
        self.pos = np.arange(first, T, stride)
        self.window = window
        # chunks of positions within 256 tokens of each other: a chunk's columns stop at its last position
        self.chunks = [c for c in (self.pos[(self.pos >= s) & (self.pos < s + chunk)] for s in range(0, T, chunk))
                       if len(c)]
        self.ref = []
        k32, v32 = k.astype(np.float32), v.astype(np.float32)
        sc = np.float32(1 / math.sqrt(D))
        for P in self.chunks:
            n = int(P[-1]) + 1
            j = np.arange(n)[None, :]
            mask = j <= P[:, None]  # [n, cols]
            recent = (mask & (j > P[:, None] - window))[None]
            L = np.where(mask[None], (q[:, P] @ k32[:n].T) * sc, NEG)
            p, logp = softmax_log(L)
            o = p @ v32[:n]
            cnt = mask.sum(axis=1).astype(np.float32)
            mean = np.where(mask[None], L, 0).sum(axis=2) / cnt
            dev = np.where(mask[None], L - mean[..., None], 0)
            var = (dev * dev).sum(axis=2) / cnt
            self.ref.append(dict(n=n, mask=mask[None], recent=recent, L=L, p=p,
                                 negent=(p * logp).sum(axis=2, dtype=np.float64), o=o,
                                 on=np.linalg.norm(o, axis=2), cnt=cnt, spread=np.sqrt(var)))

    def measure(self, kq, vq):
        """Sums (not means) of each metric over the unit's (query head, position) rows, and the row count."""
        sc = np.float32(1 / math.sqrt(self.D))
        if kq is None:  # evicted: everything older than the window dropped
            return self.measure_evicted()
        k32, v32 = kq.astype(np.float32), vq.astype(np.float32)
        vex = self.v.astype(np.float32)
        sums = dict(logit=0.0, o=0.0, kl=0.0, o_w=0.0, kl_w=0.0)
        rows = 0
        for P, r in zip(self.chunks, self.ref):
            n, mask, rec, Lr, pr = r["n"], r["mask"], r["recent"], r["L"], r["p"]
            L = np.where(mask, (self.q[:, P] @ k32[:n].T) * sc, NEG)
            err = L - Lr  # 0 where masked
            rms = np.sqrt(np.einsum("gnt,gnt->gn", err, err) / r["cnt"])
            sums["logit"] += float((rms / r["spread"]).sum())
            # KL(p || p') = sum p log p - (sum p L' - lse(L'))
            sums["kl"] += float((r["negent"] - (np.einsum("gnt,gnt->gn", pr, L) - lse(L))).sum())
            m = L.max(axis=-1, keepdims=True)
            e = np.exp(L - m)
            o = (e @ v32[:n]) / e.sum(axis=-1, keepdims=True)
            sums["o"] += float((np.linalg.norm(o - r["o"], axis=2) / r["on"]).sum())
            # the recent window exact
            Lw = np.where(rec, Lr, L)
            sums["kl_w"] += float((r["negent"] - (np.einsum("gnt,gnt->gn", pr, Lw) - lse(Lw))).sum())
            m = Lw.max(axis=-1, keepdims=True)
            e = np.exp(Lw - m)
            ow = (np.where(rec, 0, e) @ v32[:n] + np.where(rec, e, 0) @ vex[:n]) / e.sum(axis=-1, keepdims=True)
            sums["o_w"] += float((np.linalg.norm(ow - r["o"], axis=2) / r["on"]).sum())
            rows += L.shape[0] * L.shape[1]
        return sums, rows


def _measure_evicted(self):
    sums = dict(logit=math.nan, o=math.nan, kl=math.nan, o_w=0.0, kl_w=0.0)
    rows = 0
    vex = self.v.astype(np.float32)
    for P, r in zip(self.chunks, self.ref):
        n, rec, Lr, pr = r["n"], r["recent"], r["L"], r["p"]
        Lw = np.where(rec, Lr, NEG)
        sums["kl_w"] = math.inf  # p' is 0 where p is not
        m = Lw.max(axis=-1, keepdims=True)
        e = np.exp(Lw - m)
        ow = (e @ vex[:n]) / e.sum(axis=-1, keepdims=True)
        sums["o_w"] += float((np.linalg.norm(ow - r["o"], axis=2) / r["on"]).sum())
        rows += Lr.shape[0] * Lr.shape[1]
    return sums, rows


Unit.measure_evicted = _measure_evicted


def evaluate(units, cands, progress=""):
    """cands: name -> (fk, fv, kbits, vbits). Returns name -> dict(metric -> mean, per_layer -> {l: o})."""
    acc = {n: dict(k_num=0.0, k_den=0.0, v_num=0.0, v_den=0.0, rows=0, sums=dict(logit=0.0, o=0.0, kl=0.0, o_w=0.0,
                                                                                   kl_w=0.0), layer={})
           for n in cands}
    for ui, (meta_, u) in enumerate(units):
        ctx = dict(layer=meta_["layer"], head=meta_["head"], D=u.D, R=meta_["R"])
        for n, (fk, fv, _, _) in cands.items():
            kq, vq = (fk(u.k, ctx), fv(u.v, ctx)) if fk else (None, None)
            a = acc[n]
            a["k_num"] += float(((kq - u.k) ** 2).sum()) if fk else math.nan
            a["k_den"] += float((u.k ** 2).sum())
            a["v_num"] += float(((vq - u.v) ** 2).sum()) if fk else math.nan
            a["v_den"] += float((u.v ** 2).sum())
            s, rows = u.measure(kq, vq)
            for m in s:
                a["sums"][m] += s[m]
            a["rows"] += rows
            la = a["layer"].setdefault(meta_["layer"], [0.0, 0.0, 0])
            la[0] += s["o"]
            la[1] += s["kl"]
            la[2] += rows
        if progress:
            print(f"\r{progress} {ui + 1}/{len(units)}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    res = {}
    for n, a in acc.items():
        r = dict(k_mse=a["k_num"] / a["k_den"], v_mse=a["v_num"] / a["v_den"])
        for m, v in a["sums"].items():
            r[m] = v / a["rows"]
        r["layer_o"] = {l: x[0] / x[2] for l, x in a["layer"].items()}
        r["layer_kl"] = {l: x[1] / x[2] for l, x in a["layer"].items()}
        r["kbits"], r["vbits"] = cands[n][2], cands[n][3]
        res[n] = r
    return res


def fmt(x):
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf"
    return f"{x:.2e}" if x < 1e-3 else f"{x:.4f}"


def table(res, title, layers):
    print(f"\n### {title}\n")
    print("| candidate | bits K | bits V | bits avg | key rel MSE | value rel MSE | logit err / spread | o err "
          "| KL (nats) | o err w128 | KL w128 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, r in res.items():
        print(f"| {n} | {r['kbits']:.3g} | {r['vbits']:.3g} | {(r['kbits'] + r['vbits']) / 2:.3g} | {fmt(r['k_mse'])} "
              f"| {fmt(r['v_mse'])} | {fmt(r['logit'])} | {fmt(r['o'])} | {fmt(r['kl'])} | {fmt(r['o_w'])} "
              f"| {fmt(r['kl_w'])} |")
    print(f"\no err by layer ({title}):\n")
    print("| candidate | " + " | ".join(f"layer {l}" for l in layers) + " |")
    print("|---|" + "---|" * len(layers))
    for n, r in res.items():
        print(f"| {n} | " + " | ".join(fmt(r["layer_o"][l]) for l in layers) + " |")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dumps", nargs="+")
    ap.add_argument("--from", dest="first", type=int, default=128, help="first query position scored")
    ap.add_argument("--stride", type=int, default=1, help="score every stride-th query position")
    ap.add_argument("--window", type=int, default=128, help="the recent window of the w128 columns")
    ap.add_argument("--bits", default="4,3,2")
    ap.add_argument("--only", default="", help="candidates whose name contains this (quick looks)")
    ap.add_argument("--no-demote", action="store_true")
    a = ap.parse_args()

    print("## Lloyd-Max codebooks for N(0,1)\n")
    print("Lloyd iteration on 1,200,001 and 2,400,001 grid points over [-12, 12] (cumulative trapezoid "
          "integrals read at the thresholds by linear interpolation), thresholds at the midpoints, the two "
          "fixed points Richardson-extrapolated (the grid's error is O(h^2)), then polished by the same "
          "iteration with the cells' closed-form conditional means (the printed constants); |centroid - closed-form conditional mean of its cell| and the codebook's MSE per "
          "coordinate beside.\n")
    for b in (1, 2, 3, 4):
        cg, _, c1, c2, it = lloyd_max_extrapolated(b)
        c, t = lloyd_polish(cg)
        CODEBOOKS[b] = (c, t)
        worst, mse = lm_closed_form_check(c, t)
        print(f"{b} bits ({it} grid iterations; grids h = 2e-5, 1e-5: max |c_h - c_h/2| = "
              f"{np.max(np.abs(c1 - c2)):.1e}; extrapolated grid vs polished fixed point: "
              f"{np.max(np.abs(cg - c)):.1e}; polished: max |c - E[X|cell]| = {worst:.1e}; MSE per coordinate "
              f"= {mse:.9g}):")
        print("  centroids  = {" + ", ".join(f"{x:.9g}" for x in c) + "}")
        print("  thresholds = {" + ", ".join(f"{x:.9g}" for x in t) + "}")
    sys.stdout.flush()

    t0 = time.time()
    units, layers = [], []
    for path in a.dumps:
        d = load_dump(path)
        H, KVH, D, T = d["H"], d["KVH"], d["D"], d["T"]
        G = H // KVH
        T = T // BLOCK * BLOCK
        for l in d["layers"]:
            q, k, v, o = d["data"][l]
            if l not in layers:
                layers.append(l)
            # the dump's own output against a float64 recomputation (the reference is right)
            if l == d["layers"][0]:
                qq, kk, vv = q[:, 0].astype(np.float64), k[:, 0].astype(np.float64), v[:, 0].astype(np.float64)
                L = qq @ kk.T / math.sqrt(D)
                L = np.where(np.tri(len(L), dtype=bool), L, -np.inf)
                p, _ = softmax_log(L)
                oo = p @ vv
                rel = np.linalg.norm(oo - o[:, 0]) / np.linalg.norm(oo)
                print(f"\n{path}: {T} tokens, layers {d['layers']}; dumped o vs float64 recomputation "
                      f"(layer {l}, head 0): rel err {rel:.1e}", file=sys.stderr)
            for g in range(KVH):
                qg = np.ascontiguousarray(q[:T, g * G:(g + 1) * G].transpose(1, 0, 2))
                u = Unit(qg, k[:T, g].astype(np.float64), v[:T, g].astype(np.float64), a.first, a.stride, a.window)
                units.append((dict(layer=l, head=g, R=rotation(l, g, D)), u))
    layers.sort()
    print(f"{len(units)} units ready in {time.time() - t0:.0f}s", file=sys.stderr)
    print(f"\n## Candidates on {len(units)} (text, layer, KV head) units, query positions >= {a.first} "
          f"(stride {a.stride}), texts: {', '.join(a.dumps)}")
    print("Metadata in f16 unless the name says f32. o err / KL: every past token quantized; w128: the "
          f"{a.window} most recent exact.")

    sel = lambda C: {n: v for n, v in C.items() if a.only.lower() in n.lower()}
    ref = evaluate(units, reference_candidates(), "reference")
    table(ref, "references", layers)
    allres = {}
    for b in [int(x) for x in a.bits.split(",")]:
        t1 = time.time()
        res = evaluate(units, sel(candidates(b)), f"{b} bits")
        allres[b] = res
        table(res, f"{b} bits", layers)
        print(f"\n({b} bits: {time.time() - t1:.0f}s)", file=sys.stderr)

    if a.no_demote:
        return
    # second rounding: INT8 (kvcd's Q8) first, then b bits from its dequantized values
    print("\n## Second rounding: kvcd's INT8 tier, then b bits from its dequantized values, against b bits "
          "from the float\n")
    rows = {}
    bits = [int(x) for x in a.bits.split(",")]
    for b in bits:
        C = sel(candidates(b))
        for n in ["RHT + LM ls x3", "RHT + LM ls", "RHT + asym g64", "KIVI K ch-asym, V asym g32", f"q{b}_0 sym g32"]:
            if n not in C:
                continue
            fk, fv, kb, vb = C[n]
            dk, dv = demoted(fk, fv)
            rows[f"{b} bits {n}, via INT8"] = (dk, dv, kb, vb)
    # down the ladder: 4 -> 3, 4 -> 2, 3 -> 2 (and INT8 -> 4 -> 3 -> 2), the picked quantizer
    pick = "RHT + LM ls x3"
    lm = lambda b: rot(lambda Y: q_lm(Y, b, "ls", iters=3))
    chain = lambda fs: (lambda X, c: _chain(X, c, fs))
    for hi, lo in [(4, 3), (4, 2), (3, 2)]:
        if hi in bits and lo in bits and a.only.lower() in pick.lower():
            rows[f"{lo} bits {pick}, via {hi}-bit"] = (chain([lm(hi), lm(lo)]), chain([lm(hi), lm(lo)]), 0, 0)
    if all(b in bits for b in (4, 3, 2)) and a.only.lower() in pick.lower():
        f = chain([lm(4), lm(3), lm(2)])
        rows[f"2 bits {pick}, via INT8, 4-bit, 3-bit"] = (lambda X, c: f(q_int8_kvcd_keys(X), c),
                                                         lambda X, c: f(q_int8_kvcd_values(X), c), 0, 0)
    dres = evaluate(units, rows, "demotion")
    print("| candidate | path | key rel MSE direct | via path | value rel MSE direct | via path | o err direct "
          "| via path | KL direct | via path |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, r in dres.items():
        b = int(n.split()[0])
        name, path = n.split(" bits ", 1)[1].rsplit(", via ", 1)
        base = allres[b][name]
        print(f"| {b} bits {name} | {path} | {fmt(base['k_mse'])} | {fmt(r['k_mse'])} | {fmt(base['v_mse'])} "
              f"| {fmt(r['v_mse'])} | {fmt(base['o'])} | {fmt(r['o'])} | {fmt(base['kl'])} | {fmt(r['kl'])} |")
    print(f"\n(total {time.time() - t0:.0f}s)", file=sys.stderr)


if __name__ == "__main__":
    main()
