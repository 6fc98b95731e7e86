"""prefix_peer.py SOCKET_DIR TOKEN_ID...: one process of test_prefix_share.py, a client that runs a
prompt through kvcd with share_prefix=True, as an inference process with a system prompt would.

Its "model" is deterministic: the keys and values of token t at position p are drawn from a
generator seeded by (t, p), so a second process that attaches a shared prefix can check that the
blocks it got hold exactly what it would have computed itself. It prints one JSON line per stage
and waits on stdin between them (the test drives it; nothing sleeps):

1. after open: {"session", "shared_tokens", "attached_ok"} (the attached slots compared with its own)
2. after computing the rest of the prompt, its prefill step and a flush: {"stored"}
3. after a line on stdin, closes the session and prints kvcd's final {"peak_bytes", "steps"}.
"""

from __future__ import annotations

import json
import sys
from typing import List, Tuple

import numpy as np

import kvcd

G = kvcd.Geometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_tokens=256)
MODEL_ID = "pytest-prefix-peer"


def token_kv(token: int, pos: int, layer: int) -> Tuple[np.ndarray, np.ndarray]:
    """The "model's" keys and values of one token at one position, [n_kv_heads, head_dim] each."""
    rng = np.random.default_rng([token, pos, layer])
    shape = (G.n_kv_heads, G.head_dim)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def main(argv: List[str]) -> int:
    sock, ids = argv[1], [int(t) for t in argv[2:]]
    with kvcd.connect(sock, name="prefix-peer") as c:
        s = c.open_session(G, prompt_token_ids=ids, share_prefix=True, model_id=MODEL_ID)
        shared = s.shared_tokens
        ok = True
        for layer in range(G.n_layers if shared else 0):
            keys = s.layer_view(layer).gather("keys")  # [n_kv_heads, shared, head_dim]
            for pos in range(shared):
                ok = ok and bool(np.array_equal(keys[:, pos], token_kv(ids[pos], pos, layer)[0]))
        say(session=s.id, shared_tokens=shared, attached_ok=ok)
        for layer in range(G.n_layers):  # only the tokens past the attached prefix are computed
            kv = [token_kv(ids[p], p, layer) for p in range(shared, len(ids))]
            s.append(layer, shared, np.stack([k for k, _ in kv]), np.stack([v for _, v in kv]))
        s.step(0, np.ones(8, np.float32), phase="prefill")
        c.flush()  # the step that lets kvcd publish the prompt's whole blocks
        say(stored=s.layer_tokens(0))
        sys.stdin.readline()
        final = s.close()
        assert final is not None
        say(peak_bytes=final.peak_bytes, steps=final.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
