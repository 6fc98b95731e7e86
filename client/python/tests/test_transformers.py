"""kvcd.transformers.KvcdCache on SmolLM2 (the GGUF of the model cache, loaded by transformers'
own GGUF loader, float32, offline), against transformers' DynamicCache and the golden ids of
../shared/models/smollm2 (made by transformers 5.24.0 + torch 2.15.0, float32, 1 thread).

Run by tests/python/transformers.sh with the venv of `make python-deps`; this file is skipped by
binding.sh's light venv (no torch there). One thread, as the goldens were made.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Dict, List, Tuple

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvcd  # noqa: E402
from kvcd.transformers import KvcdCache, load_smollm2  # noqa: E402
from transformers import DynamicCache  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "..", "..", "..", "shared", "models", "smollm2")
MODEL = os.environ.get("KVC_SMOLLM2", os.path.expanduser("~/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
# generate's cache keyword: ``cache=`` where the model's forward takes it (the newest 5.x),
# ``past_key_values=`` before (5.2, the release kvpress pins: tests/python/transformers-5.2.sh)
from transformers import LlamaForCausalLM  # noqa: E402

CACHE_KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def golden(name: str) -> Dict[str, object]:
    """prompt_ids, new_ids and the prompt text of golden-NAME.txt."""
    with open(os.path.join(SHARED, f"golden-{name}.txt")) as f:
        text = f.read()
    prompt = re.search(r'^# prompt \((\w+)\): (".*")$', text, re.M)
    assert prompt, f"golden-{name}.txt has no prompt line"
    import json

    return {
        "kind": prompt.group(1),
        "prompt": json.loads(prompt.group(2)),
        "prompt_ids": [int(x) for x in re.search(r"^prompt_ids:(.*)$", text, re.M).group(1).split()],
        "new_ids": [int(x) for x in re.search(r"^new_ids:(.*)$", text, re.M).group(1).split()],
    }


@pytest.fixture(scope="module")
def smollm2() -> Tuple[object, object]:
    if not os.path.isfile(MODEL):
        pytest.fail(f"{MODEL} missing: make model")
    torch.set_num_threads(1)
    return load_smollm2(MODEL)


@pytest.fixture
def client(kvcd_daemon):
    with kvcd.connect(kvcd_daemon.dir, name="pytest-transformers") as c:
        yield c


def _generate(model, ids: List[int], n: int, cache, force: bool = False, keyword: str = CACHE_KW) -> List[int]:
    """Greedy generate() of n tokens through cache (given as ``cache=``, the newest 5.x's
    keyword, where there is one, or ``past_key_values=``, still accepted)."""
    x = torch.tensor([ids])
    kw = {"min_new_tokens": n} if force else {}
    kw[keyword] = cache
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["chat-capital", "chat-poem", "story"])
def test_full_matches_dynamic_cache_and_golden(smollm2, client, name):
    model, tok = smollm2
    g = golden(name)
    n = len(g["new_ids"])
    ref = _generate(model, g["prompt_ids"], n, DynamicCache(config=model.config))
    cache = KvcdCache(client, model, policy="full")
    got = _generate(model, g["prompt_ids"], n, cache, keyword="past_key_values" if name == "story" else CACHE_KW)
    stats = cache.close()
    assert ref == g["new_ids"], "transformers' own cache does not reproduce the golden ids"
    assert got == ref
    # every token the model saw went into kvcd, once per layer; nothing was evicted
    seen = len(g["prompt_ids"]) + len(got) - 1  # the last token is sampled, never fed back
    assert cache.get_seq_length() == seen
    assert cache.peak_stored == seen
    assert stats.peak_tokens == seen
    assert cache.steps == len(got)


def test_tokenizer_from_gguf_matches_golden_prompt_ids(smollm2):
    _, tok = smollm2
    for name in ("chat-capital", "story"):
        g = golden(name)
        assert tok(g["prompt"], add_special_tokens=False)["input_ids"] == g["prompt_ids"]


def test_cache_holds_no_copy_of_keys(smollm2, client):
    """The layers keep nothing of their own: keys and values are in kvcd's pool only."""
    model, _ = smollm2
    g = golden("chat-capital")
    cache = KvcdCache(client, model, policy="full")
    _generate(model, g["prompt_ids"], 4, cache)
    for layer in cache.layers:
        assert layer.keys is None and layer.values is None
    tensors = [v for v in vars(cache).values() if isinstance(v, torch.Tensor)]
    # the one scratch (K and V) every layer shares: at most one layer's worth of rows
    assert sum(t.numel() for t in tensors) <= 2 * max(1024, 2 * cache.geometry.n_kv_heads * cache.peak_stored) * 64
    # the pool's keys are what the model computed: layer 0's view equals a fresh DynamicCache's
    ref = DynamicCache(config=model.config)
    _generate(model, g["prompt_ids"], 4, ref)
    view = cache.session.layer_view(0).gather("keys")  # [kv_heads, n, head_dim]
    want = ref.layers[0].keys[0].numpy()[:, : view.shape[1]]
    assert view.shape == want.shape
    assert (view == want).all()
    cache.close()


def test_a_ladder_session_answers_from_every_tier(smollm2, client):
    """tiers=["q8"] with a 16-token window: the chat's prompt is read back from INT8 (dequantized by
    the gather), and the answer is the full cache's (INT8 costs nothing measurable on SmolLM2)."""
    model, _ = smollm2
    g = golden("chat-capital")
    n = len(g["new_ids"])
    cache = KvcdCache(client, model, policy="full", tiers=["q8"], params={"tier_window": 16})
    got = _generate(model, g["prompt_ids"], n, cache)
    assert cache.session.tiers == ["f32", "q8"]
    tiers = cache.session.tier_tokens(0)
    assert tiers["q8"] >= len(g["prompt_ids"]) - 32 and tiers["f32"] <= 32
    cache.close()
    assert got == g["new_ids"]


@pytest.mark.parametrize("policy", ["window", "h2o", "conf"])
def test_budget_below_length_runs_within_budget_deterministically(smollm2, client, policy):
    model, _ = smollm2
    g = golden("chat-poem")
    budget, n = 48, 64  # 39 prompt tokens + 64 new: more than twice the budget
    runs = []
    for _ in range(2):
        cache = KvcdCache(client, model, policy=policy, budget=budget)
        limit = cache.session.max_tokens
        got = _generate(model, g["prompt_ids"], n, cache, force=True)
        stats = cache.close()
        assert len(got) == n, "generation stopped early"
        assert cache.get_seq_length() == len(g["prompt_ids"]) + n - 1  # positions count every token seen
        # kvcd's accounting: never more than the session's limit in any layer, and evictions happened
        assert stats.peak_tokens <= limit
        assert cache.peak_stored <= limit
        assert stats.plans_applied > 0
        assert min(cache.stored_after_plans) < cache.get_seq_length()
        assert max(cache.stored_after_plans[1:]) <= limit
        runs.append(got)
    assert runs[0] == runs[1], f"{policy} is not deterministic"


def test_positions_and_mask_right_after_eviction(smollm2, client):
    """A multi-token query after eviction (the prompt fed in chunks of 8 to a window of 16): the
    logits of the last chunk through KvcdCache equal those of transformers' DynamicCache holding
    exactly the keys and values kvcd kept, with the chunk at its true positions. This checks the
    mask offset (new tokens causal among themselves, every kept token visible) and the positions
    (get_seq_length is tokens seen, not stored)."""
    model, _ = smollm2
    ids = golden("chat-poem")["prompt_ids"]
    head, tail = ids[:-5], ids[-5:]
    cache = KvcdCache(client, model, policy="window", budget=16)
    with torch.no_grad():
        for i in range(0, len(head), 8):
            model(torch.tensor([head[i:i + 8]]), use_cache=True, **{CACHE_KW: cache})
        cache._sync()  # the plan of the last chunk's step, as the next forward would apply it
        kept = []  # each layer's gather reuses the one scratch: copy it before the next
        for layer in cache.layers:
            k, v = layer._gather(torch.float32)
            kept.append((k.clone(), v.clone()))
        stored = kept[0][0].shape[2]
        assert stored < len(head), "the window evicted nothing"
        assert cache.get_seq_length() == len(head)
        got = model(torch.tensor([tail]), use_cache=True, **{CACHE_KW: cache}).logits[0]
        ref_cache = DynamicCache(config=model.config)
        for l, (k, v) in enumerate(kept):
            ref_cache.update(k, v, l)
        pos = torch.arange(len(head), len(ids))[None]
        want = model(torch.tensor([tail]), position_ids=pos, use_cache=True, **{CACHE_KW: ref_cache}).logits[0]
    cache.close()
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_prompt_longer_than_the_session_limit_is_refused(smollm2, client):
    """The limit: one forward holds at most session.max_tokens (budget + slack) in a layer; a
    longer prompt in one piece is KvcNoSpace (fed in chunks it goes in, as the mask test does)."""
    model, _ = smollm2
    ids = golden("chat-poem")["prompt_ids"]
    cache = KvcdCache(client, model, policy="window", budget=16)
    limit = cache.session.max_tokens
    assert limit < len(ids)
    with torch.no_grad(), pytest.raises(kvcd.KvcNoSpace):
        model(torch.tensor([ids]), use_cache=True, **{CACHE_KW: cache})
    cache.close()
    cache = KvcdCache(client, model, policy="window", budget=16)
    with torch.no_grad():
        model(torch.tensor([ids[:limit]]), use_cache=True, **{CACHE_KW: cache})
    assert cache.session.layer_tokens(0) == limit
    cache.close()
