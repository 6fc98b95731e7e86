"""kvcd.transformers: kvcd as the KV cache of a Hugging Face transformers model (5.x Cache API).

    cache = KvcdCache(client, model, policy="window", budget=256)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64, do_sample=False)
    stats = cache.close()

What this module owns: KvcdCache (a transformers ``Cache`` of KvcdLayer objects, one per decoder
layer) and the attention function "kvcd_sdpa" it installs for the policies that rank by
attention. docs/python.md ("transformers") has the decisions and the measurements.

Contract:

- Keys and values live once, in kvcd's pool: ``update`` appends the new tokens to the session
  (kvc_append: libkvc writes them, their positions and zero scores into the layer's blocks) and
  returns tensors gathered from the pool's blocks by kvc_layer_gather (libkvc, C: one memcpy per
  KV head and 16-token block at float32) into one float32 scratch buffer that every layer of the
  cache shares (attention needs one dense [1, kv_heads, n, head_dim] tensor and kvcd's blocks are
  16 tokens of [kv_heads, 16, head_dim] each, so no strided view covers a layer). The scratch is
  overwritten by the next layer's update: the tensors ``update`` returns are valid until then,
  which is how a decoder's forward uses them. Nothing else holds keys or values.
- Step summaries come from the model's logits: a forward hook on the output embeddings
  summarizes the last position's logits (kvcd.summarize) and queues kvc_step (phase "prefill"
  for a forward of more than one token, else "decode"; the hook acts only after a forward that
  updated this cache). The flush that sends them and applies
  kvcd's plan is lazy: it runs at the next ``get_mask_sizes`` or ``update``, before any tensor of
  the next forward is handed out (the causal mask asks layer 0 for its size before any update,
  and the size it gets already counts the plan). Nothing compacts under a tensor attention reads.
- ``get_seq_length()`` is the number of tokens seen (the next token's position), not the number
  stored. ``get_mask_sizes`` answers (stored + query, seen - stored): the offset makes the mask
  compare the stored tokens as older than every query and the new tokens causally among
  themselves, which is right whatever subset kvcd kept (kept slots stay in position order, all
  before the new ones). RoPE is applied before the cache, so kept keys keep their rotation.
- Scores (sum, EMA, last) for the policies that rank by attention come from the model's own
  attention inputs: "kvcd_sdpa" runs transformers' SDPA attention unchanged (the model's numerics)
  and, for a one-token query, also kvc_attend on the same query over the same cached keys, whose
  only use is the score update (its output is dropped). That doubles the attention work of a
  decode step for those policies; `full` and `window` skip it. A forward of more than one token
  (a prefill) scores with its last ``prefill_window`` queries (default 64, SnapKV's observation
  window; 0: none), each over all the keys stored by then, the forward's later ones included
  (kvc_attend has no causal mask): among the tokens before the window, which are the ones a
  policy chooses from, that changes each query's softmax only by a common factor, so their order
  per query is the causal one.
- Batch size 1, host pools. Every tier of the precision ladder is read (kvc_layer_gather
  dequantizes INT8 and the rotated 4-, 3- and 2-bit tiers, and rotates them back): pass
  ``tiers=["q4"]`` and ``params={"tier_window": 128}`` for a uniform 4-bit cache, or conf's
  ``int8``. The attention is transformers' over the gathered tensors, not kvcd's fused kernel.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import _lib
from .client import Client, Geometry, Session, SessionStats, summarize
from .errors import KvcInvalid, KvcNotSupported

ATTN_IMPLEMENTATION = "kvcd_sdpa"
# the policies whose plans do not read attention scores: no kvc_attend for them
_NO_SCORES = frozenset({"full", "window", "streaming"})

_active = threading.local()  # the KvcdCache whose update ran last in this thread


def _kvcd_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], **kwargs: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers' SDPA attention, plus kvc_attend's score update when the active cache wants it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    cache = getattr(_active, "cache", None)
    if cache is not None and cache._scores:
        n = query.shape[2]
        for i in range(max(0, n - (cache.prefill_window if n > 1 else 1)), n):
            cache._score(int(module.layer_idx), query[:, :, i : i + 1])
    return out


def register() -> None:
    """Registers "kvcd_sdpa" with transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _kvcd_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def geometry_of(config: Any, dtype: str = "float32") -> Geometry:
    """The kvcd Geometry of a Llama-family transformers config."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return Geometry(n_layers=cfg.num_hidden_layers, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
                    max_tokens=cfg.max_position_embeddings, dtype=dtype)


class KvcdLayer(CacheLayerMixin):
    """One decoder layer of a KvcdCache: its keys and values are the session's layer in the pool."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: "KvcdCache", layer: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer = layer
        self.seen = 0  # tokens seen: the position of the next one

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        """transformers 5.2's name of get_max_length (abstract there): no fixed maximum."""
        return -1

    def get_mask_sizes(self, query_length: Any) -> Tuple[int, int]:
        """(kv_length, kv_offset) for a query of query_length tokens (transformers 5.2 passes the
        query's cache_position tensor instead: its length is the query's)."""
        if isinstance(query_length, torch.Tensor):
            query_length = int(query_length.shape[0])
        self.cache._sync()
        stored = self.cache.session.layer_tokens(self.layer)
        return stored + query_length, self.seen - stored

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise KvcNotSupported(95, f"KvcdCache holds one sequence, not a batch of {key_states.shape[0]}")
        if key_states.device.type != "cpu":
            raise KvcNotSupported(95, "KvcdCache keeps keys and values in kvcd's host pool: run the model on CPU")
        c._sync()
        _active.cache = c
        c._forwarding = True
        n = key_states.shape[2]
        if self.layer == 0:
            c._forward_tokens = n
        # [1, kv_heads, n, head_dim] -> [n, kv_heads, head_dim] float32, the layout kvc_append takes
        k = key_states[0].transpose(0, 1).to(torch.float32).contiguous().numpy()
        v = value_states[0].transpose(0, 1).to(torch.float32).contiguous().numpy()
        c.session.append(self.layer, self.seen, k, v)
        self.seen += n
        return self._gather(key_states.dtype)

    def _gather(self, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values, copied out of its blocks into the cache's scratch by
        kvc_layer_gather (one memcpy per KV head and block at float32)."""
        c = self.cache
        lib = _lib.load()
        p = c.session._p()
        n = int(lib.kvc_layer_tokens(p, self.layer))
        c.peak_stored = max(c.peak_stored, n)
        g = c.geometry
        H, D = g.n_kv_heads, g.head_dim
        ks, vs = c._scratch(H * n, D)
        r = lib.kvc_layer_gather(p, self.layer, 0, n, 0, ks.data_ptr(), vs.data_ptr())
        if r < 0:
            c.session._check(r, f"gather layer {self.layer}")
        keys = ks.view(1, H, n, D)
        values = vs.view(1, H, n, D)
        if keys.dtype != dtype:
            keys, values = keys.to(dtype), values.to(dtype)
        return keys, values

    def reset(self) -> None:
        raise KvcNotSupported(95, "a KvcdCache is one session: close it and open another")


class KvcdCache(Cache):
    """A transformers Cache whose layers live in a kvcd session (one sequence).

    ``client`` is a kvcd.Client; ``model`` the transformers model (its config gives the geometry;
    a hook on its output embeddings sends the step summaries; the policies that rank by attention
    switch it to the "kvcd_sdpa" attention, which close() undoes). ``policy``, ``budget``,
    ``params`` and the other keywords go to Client.open_session. ``dtype`` is how kvcd stores the
    keys and values (default: the model's dtype). ``prefill_window``: how many of a prefill's last
    queries add to the attention scores (the policies that rank by attention only)."""

    def __init__(self, client: Client, model: torch.nn.Module, policy: str = "full", budget: int = 0,
                 params: Optional[Dict[str, Any]] = None, dtype: Optional[str] = None, prefill_window: int = 64,
                 **session_kwargs: Any) -> None:
        mdtype = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(
            getattr(model, "dtype", torch.float32), "float32")
        self.geometry = geometry_of(model.config, dtype or mdtype)
        self.client = client
        self.policy = policy
        self.session: Session = client.open_session(self.geometry, policy=policy, budget=budget, params=params,
                                                    **session_kwargs)
        self.prefill_window = max(0, int(prefill_window))
        self.steps = 0  # kvc_step calls made
        self.peak_stored = 0  # the most tokens one layer held when attention read it
        self.stored_after_plans: List[int] = []  # layer 0's length after each applied flush
        self._pending = False
        self._forwarding = False
        self._forward_tokens = 0
        self._scores = policy not in _NO_SCORES
        self._ks: Optional[torch.Tensor] = None
        self._vs: Optional[torch.Tensor] = None
        self._model = model
        self._prev_attn: Optional[str] = None
        head = model.get_output_embeddings()
        if head is None:
            raise KvcInvalid(22, "the model has no output embeddings to take the logits from")
        self._hook = head.register_forward_hook(self._on_logits)
        if self._scores:
            register()
            self._prev_attn = model.config._attn_implementation
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        super().__init__(layers=[KvcdLayer(self, i) for i in range(self.geometry.n_layers)])

    # ---- the model's side ----

    def _on_logits(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if not self._forwarding:  # a forward that did not use this cache
            return
        self._forwarding = False
        logits = output[0, -1].detach().to(torch.float32).contiguous().numpy()
        # the logits may be of the last position only (logits_to_keep): the forward's length is
        # what layer 0 was given
        phase = "prefill" if self._forward_tokens > 1 else "decode"
        self.step(logits, phase=phase)

    def step(self, logits: np.ndarray, phase: str = "decode") -> None:
        """Queues the summary of one step's logits; the next update or mask query flushes it. The
        hook calls this itself; call it only for a model driven without the hook."""
        self.session.step(self.steps, summarize(logits), phase=phase)
        self.steps += 1
        self._pending = True

    def _sync(self) -> None:
        """Sends the queued summaries and applies kvcd's plan (between forwards only)."""
        if self._pending:
            self._pending = False
            self.client.flush()
            self.stored_after_plans.append(self.session.layer_tokens(0))

    def _score(self, layer: int, query: torch.Tensor) -> None:
        q = query[0, :, 0, :].to(torch.float32).contiguous().numpy()
        self.session.attend(layer, q)

    def _scratch(self, rows: int, D: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """rows x D float32 rows of keys and of values, shared by every layer (grown by doubling)."""
        if self._ks is None or self._ks.shape[0] < rows:
            cap = max(rows, 2 * (self._ks.shape[0] if self._ks is not None else 0), 1024)
            self._ks = torch.empty(cap, D, dtype=torch.float32)
            self._vs = torch.empty(cap, D, dtype=torch.float32)
        assert self._vs is not None
        return self._ks[:rows], self._vs[:rows]

    # ---- Cache ----

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def room(self) -> int:
        """How many tokens the next forward may add without passing the session's limit in any
        layer (kvcd's pending plan applied first): the size of the next chunk of a prompt that is
        prefilled piece by piece (a budgeted policy plans when a layer reaches its limit)."""
        self._sync()
        return self.session.max_tokens - max(self.layer_tokens())

    def layer_tokens(self) -> List[int]:
        """The tokens each layer holds in kvcd now."""
        return [self.session.layer_tokens(i) for i in range(self.geometry.n_layers)]

    def crop(self, max_length: int) -> None:
        raise KvcNotSupported(95, "KvcdCache cannot be cropped (kvcd owns what is kept)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if beam_idx.numel() != 1 or int(beam_idx[0]) != 0:
            raise KvcNotSupported(95, "KvcdCache holds one sequence: no beam search")

    def close(self) -> Optional[SessionStats]:
        """Flushes what is queued, removes the hook (and the attention switch), closes the session
        and returns kvcd's final accounting. A second close returns the same."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
            if self._prev_attn is not None:
                self._model.set_attn_implementation(self._prev_attn)
                self._prev_attn = None
        if getattr(_active, "cache", None) is self:
            _active.cache = None
        if not self.session.closed:
            self._sync()
        self._ks = self._vs = None
        return self.session.close()

    def __enter__(self) -> "KvcdCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load_smollm2(gguf_path: str, dtype: torch.dtype = torch.float32) -> Tuple[Any, Any]:
    """SmolLM2 (or any Llama GGUF) as a transformers model and tokenizer, dequantized from the
    GGUF by transformers' loader, offline (nothing from a model hub). Sets HF_HUB_OFFLINE=1."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(os.path.abspath(os.path.expanduser(gguf_path)))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    model.eval()
    return model, tok


__all__: Iterable[str] = ["KvcdCache", "KvcdLayer", "register", "geometry_of", "load_smollm2", "ATTN_IMPLEMENTATION"]
