"""kvcd.client: the Pythonic face of libkvc: a Client (one connection), its Sessions (one per
sequence), numpy arrays in and out.

Thin by design: every method is one libkvc call (or a loop of them) and nothing is cached that
libkvc already knows. Arrays go to libkvc by pointer; the only copies made here are the ones
libkvc's float interface forces: a float16 array becomes float32 before kvc_append() or
kvc_attend() (libkvc then stores it in the session's dtype). Non-contiguous arrays and other
dtypes are refused rather than copied behind the caller's back.

Ownership: a Session belongs to its Client. Closing the Client (or leaving its ``with`` block)
closes every session it still has (kvc_disconnect does), and the Session objects then refuse
further calls. A Session left to the garbage collector is closed then. libkvc is not
thread-safe; each Client serializes its own calls with a lock, so a client shared between
threads is correct, only not parallel (use one client per thread for that).

Layer views (Session.layer_view) are numpy arrays over the mapped pool: no copy; what they show is
current until the session's next append or flush (a plan may compact the layer). Blocks of a
shared prefix are mapped read-only by libkvc, and their arrays are read-only too, so a write
raises instead of crashing the process. The arrays keep what they point at alive: a session
closed while an array of one of its views lives is closed for every call at once, but in libkvc
and kvcd only when the last such array goes (its blocks are not given to another session under
it), and a client closed then keeps its connection and its mapping until then (numpy cannot be
told that memory went away: unmapping under a live array was a SIGSEGV, issue 28).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np

from . import _lib
from .errors import KvcDtypeError, KvcError, KvcInvalid, KvcNotSupported, error_for

ArrayLike = np.ndarray

_DTYPES = {
    "float32": _lib.KVC_DTYPE_F32,
    "f32": _lib.KVC_DTYPE_F32,
    "float16": _lib.KVC_DTYPE_F16,
    "f16": _lib.KVC_DTYPE_F16,
    "bfloat16": _lib.KVC_DTYPE_BF16,
    "bf16": _lib.KVC_DTYPE_BF16,
}
_DTYPE_NAMES = {
    _lib.KVC_DTYPE_F32: "float32",
    _lib.KVC_DTYPE_F16: "float16",
    _lib.KVC_DTYPE_BF16: "bfloat16",
}
# the numpy dtype a block's keys and values are viewed as (numpy has no bfloat16: its raw bits)
_VIEW_DTYPES = {
    _lib.KVC_DTYPE_F32: np.dtype(np.float32),
    _lib.KVC_DTYPE_F16: np.dtype(np.float16),
    _lib.KVC_DTYPE_BF16: np.dtype(np.uint16),
}
_PHASES = {"decode": _lib.KVC_PHASE_DECODE, "prefill": _lib.KVC_PHASE_PREFILL}


def _raise(code: int, message: str) -> None:
    raise error_for(code, message)


def _bytes(s: Optional[str], what: str = "a string") -> Optional[bytes]:
    """s as a C string: None stays None; anything but a str is KvcDtypeError, and a NUL inside it
    KvcInvalid (C would read only the part before it: "full\\0x" would run as "full")."""
    if s is None:
        return None
    if not isinstance(s, str):
        raise KvcDtypeError(22, f"{what} must be a str, not {type(s).__name__}")
    if "\0" in s:
        raise KvcInvalid(22, f"{what} {s!r} holds a NUL character")
    return s.encode()


def _int(what: str, v: Any, lo: int, hi: int) -> int:
    """v as a Python int in [lo, hi]: a bool, float or anything but an integer is KvcDtypeError
    (ctypes would truncate a float and wrap an integer out of range silently)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise KvcDtypeError(22, f"{what} must be an integer, not {type(v).__name__}")
    v = int(v)
    if not lo <= v <= hi:
        raise KvcInvalid(22, f"{what}={v} is out of range [{lo}, {hi}]")
    return v


def _u32(what: str, v: Any) -> int:
    return _int(what, v, 0, 2**32 - 1)


def _u64(what: str, v: Any) -> int:
    return _int(what, v, 0, 2**64 - 1)


def _i32(what: str, v: Any) -> int:
    return _int(what, v, -(2**31), 2**31 - 1)


def _floats(what: str, a: Any, shapes: Sequence[Tuple[int, ...]]) -> np.ndarray:
    """a as a C-contiguous float32 array of one of the shapes (float16 is converted, the one copy
    the binding makes); KvcDtypeError / KvcInvalid otherwise."""
    if not isinstance(a, np.ndarray):
        raise KvcDtypeError(22, f"{what} must be a numpy array, not {type(a).__name__}")
    if a.dtype != np.float32 and a.dtype != np.float16:
        raise KvcDtypeError(22, f"{what} must be float32 or float16, not {a.dtype}")
    if a.shape not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise KvcInvalid(22, f"{what} has shape {a.shape}, expected {want}")
    if not a.flags.c_contiguous:  # before the float16 conversion, whose copy would hide it
        raise KvcInvalid(22, f"{what} is not C-contiguous (np.ascontiguousarray makes a copy)")
    return a.astype(np.float32) if a.dtype == np.float16 else a


def _f32p(a: np.ndarray) -> int:
    """The address of a's first element (a checked by _floats). c_char.from_buffer is the
    cheapest way numpy and ctypes offer (a third of ndarray.ctypes.data); it needs a writable
    buffer, and a read-only array goes through the array interface."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):
        return a.__array_interface__["data"][0]


_T = TypeVar("_T", bound="_Closes")


class _Closes:
    """A context manager that closes itself at the end of the block, and when it is collected
    (errors there are dropped: the interpreter may be shutting down)."""

    def close(self) -> Any:
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


@dataclass(frozen=True)
class Geometry:
    """A model's attention shape, per session: ``n_kv_heads`` divides ``n_heads``; ``dtype`` is how
    kvcd stores keys and values ("float32", "float16" or "bfloat16"); ``max_tokens`` the model's
    context length."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_tokens: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        # one spelling: "float32", "float16" or "bfloat16" (numpy dtypes and "f16"-style aliases
        # are taken); an unknown one is refused when the session opens
        d = self.dtype
        if not isinstance(d, str):
            try:
                d = np.dtype(d).name
            except TypeError:
                d = str(d)
        object.__setattr__(self, "dtype", _DTYPE_NAMES.get(_DTYPES.get(d, 0), d))

    def _c(self) -> _lib.CGeometry:
        d = _DTYPES.get(self.dtype)
        if d is None:
            raise KvcInvalid(22, f"dtype {self.dtype!r}: float32, float16 or bfloat16")
        for f in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "max_tokens"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or not 0 <= v < 2**32:
                raise KvcInvalid(22, f"geometry {f}={v!r} is not a 32-bit unsigned integer")
            if v == 0:
                raise KvcInvalid(22, f"geometry {f} is 0")
        # kvcd refuses these too, but its refusal of a malformed OpenSession comes back without the
        # request's id and libkvc then waits for its timeout: say it here, at once
        if self.n_heads % self.n_kv_heads:
            raise KvcInvalid(22, f"n_kv_heads {self.n_kv_heads} does not divide n_heads {self.n_heads}")
        return _lib.CGeometry(self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim, d, self.max_tokens)


@dataclass(frozen=True)
class Summary:
    """kvc_summarize's summary of one step's logits: normalized entropy, top-1 probability, top-1
    minus top-2 margin, and the top-1 token."""

    entropy: float
    top1_prob: float
    margin: float
    top1: int

    def _c(self) -> _lib.CSummary:
        return _lib.CSummary(self.entropy, self.top1_prob, self.margin, self.top1)

    @property
    def confidence(self) -> float:
        """CONF-KV's confidence of the summary with the default weights, as kvcd computes it."""
        c = self._c()
        return float(_lib.load().kvc_confidence(ctypes.byref(c)))


def summarize(logits: ArrayLike) -> Summary:
    """The summary of a 1-D float32 (or float16) logits vector."""
    if isinstance(logits, np.ndarray) and logits.ndim != 1:
        raise KvcInvalid(22, f"logits has shape {logits.shape}, expected one dimension")
    a = _floats("logits", logits, [getattr(logits, "shape", ())])
    out = _lib.CSummary()
    r = _lib.load().kvc_summarize(_f32p(a), a.shape[0], ctypes.byref(out))
    if r < 0:
        _raise(r, f"kvc_summarize over {a.shape[0]} logits")
    return Summary(out.entropy, out.top1_prob, out.margin, out.top1)


@dataclass(frozen=True)
class SessionStats:
    """A session's accounting (kvc_session_stats). While the session is open, libkvc counts
    ``steps``, ``plans_applied`` and ``blocks_moved`` itself; ``plans``, the peaks and ``bytes``
    are kvcd's figures, which arrive with close() (zero until then)."""

    steps: int
    plans: int
    plans_applied: int
    blocks_moved: int
    peak_tokens: int
    peak_layer_blocks: int
    peak_bytes: int
    bytes: int

    @classmethod
    def _of(cls, c: _lib.CSessionStats) -> "SessionStats":
        return cls(*(getattr(c, f) for f, _ in _lib.CSessionStats._fields_))


@dataclass(frozen=True)
class Handoff:
    """A session traded for a one-time ticket (Session.export): a secret, valid 30 s."""

    session_id: int
    ticket: bytes


class Block:
    """One block of a layer as numpy views onto the pool: ``keys`` and ``values``
    [n_kv_heads, block_tokens, head_dim] in the session's dtype (bfloat16 as its uint16 bits; int8
    in an INT8 block, with ``kscale`` [n_kv_heads, head_dim] and ``vscale`` [n_kv_heads,
    block_tokens]), and the side arrays ``pos`` (int32), ``sum``, ``ema``, ``last``, ``logw``
    (float32) [n_kv_heads, block_tokens]. Read-only when the block belongs to a shared prefix."""

    def __init__(self, owner: "Session", address: int, nbytes: int, layout: Dict[str, int], geo: Geometry,
                 q8: bool, writable: bool) -> None:
        self.session = owner
        buf = (ctypes.c_uint8 * nbytes).from_address(address)
        buf._owner = owner  # every view's base is buf: an array alone keeps its session open
        owner._pin(buf)  # ... and its blocks and mapping, past close(), until buf goes
        raw = np.frombuffer(buf, dtype=np.uint8)
        if not writable:
            raw.flags.writeable = False
        h, t, d = geo.n_kv_heads, layout["block_tokens"], geo.head_dim
        elem = np.dtype(np.int8) if q8 else _VIEW_DTYPES[_DTYPES[geo.dtype]]
        kv = h * t * d * elem.itemsize

        def arr(off: int, n: int, dt: Any, shape: Tuple[int, ...]) -> np.ndarray:
            return raw[off : off + n].view(dt).reshape(shape)

        self.address = address
        self.writable = writable
        self.q8 = q8
        self.keys = arr(layout["key"], kv, elem, (h, t, d))
        self.values = arr(layout["value"], kv, elem, (h, t, d))
        if q8:
            self.kscale = arr(layout["kscale"], h * d * 4, np.float32, (h, d))
            self.vscale = arr(layout["vscale"], h * t * 4, np.float32, (h, t))
        side = h * t * 4
        self.pos = arr(layout["pos"], side, np.int32, (h, t))
        self.sum = arr(layout["sum"], side, np.float32, (h, t))
        self.ema = arr(layout["ema"], side, np.float32, (h, t))
        self.last = arr(layout["last"], side, np.float32, (h, t))
        self.logw = arr(layout["logw"], side, np.float32, (h, t))


def _align64(n: int) -> int:
    return (n + 63) & ~63


def _layout(block_tokens: int, geo: Geometry, q8: bool) -> Dict[str, int]:
    """kernels/block.h's block_layout_init(), in Python (checked against libkvc's block_bytes)."""
    h, t, d = geo.n_kv_heads, block_tokens, geo.head_dim
    eb = 1 if q8 else _VIEW_DTYPES[_DTYPES[geo.dtype]].itemsize
    kv = _align64(h * t * d * eb)
    side = _align64(h * t * 4)
    lay = {"block_tokens": t, "key": 0, "value": kv, "pos": 2 * kv}
    if q8:
        lay["kscale"] = 2 * kv
        lay["vscale"] = lay["kscale"] + _align64(h * d * 4)
        lay["pos"] = lay["vscale"] + side
    lay["sum"] = lay["pos"] + side
    lay["ema"] = lay["sum"] + side
    lay["last"] = lay["ema"] + side
    lay["logw"] = lay["last"] + side
    lay["bytes"] = lay["logw"] + side
    return lay


class LayerView:
    """How one layer lies in the pool (kvc_layer_view): slots [0, n_q8) are INT8 in
    ``q8_blocks``, slots [n_q8, n_tokens) full precision in ``blocks`` (slot s in
    blocks[(s - n_q8) // block_tokens]). Slots [0, shared_tokens) are a shared prefix."""

    def __init__(self, session: "Session", cv: _lib.CLayerView, shared: int) -> None:
        geo = session.geometry
        self.session = session  # keeps the mapping's owner alive as long as the view
        self.n_tokens: int = cv.n_tokens
        self.n_q8: int = cv.n_q8
        self.block_tokens: int = cv.block_tokens
        self.shared_tokens: int = shared
        t = cv.block_tokens
        fp = _layout(t, geo, False)
        if cv.n_blocks and fp["bytes"] != cv.block_bytes:
            raise KvcError(71, f"block layout mismatch: {fp['bytes']} bytes here, {cv.block_bytes} in libkvc")
        q8 = _layout(t, geo, True)
        if cv.n_q8_blocks and q8["bytes"] != cv.q8_block_bytes:
            raise KvcError(71, f"INT8 block layout mismatch: {q8['bytes']} vs {cv.q8_block_bytes}")
        self.blocks: List[Block] = [
            Block(session, cv.blocks[i], fp["bytes"], fp, geo, False, cv.n_q8 + i * t >= shared)
            for i in range(cv.n_blocks)
        ]
        self.q8_blocks: List[Block] = [
            Block(session, cv.q8_blocks[i], q8["bytes"], q8, geo, True, i * t >= shared) for i in range(cv.n_q8_blocks)
        ]

    def gather(self, field: str) -> np.ndarray:
        """A dense copy of one array over the full-precision slots [n_q8, n_tokens): "keys" or
        "values" [n_kv_heads, n, head_dim], or a side array ("pos", "sum", "ema", "last",
        "logw") [n_kv_heads, n]. A copy, unlike the blocks' views."""
        n = self.n_tokens - self.n_q8
        parts = [getattr(b, field) for b in self.blocks]
        if not parts:
            raise KvcInvalid(22, "the layer has no full-precision blocks")
        return np.concatenate(parts, axis=1)[:, :n].copy()


class Session(_Closes):
    """One sequence's cache in kvcd's pool (Client.open_session). Use it as a context manager or
    call close()."""

    def __init__(self, client: "Client", ptr: int, geometry: Geometry) -> None:
        self._client = client
        self._ptr: Optional[int] = ptr
        self._pins = 0  # live buffers of layer views (Block): while any, libkvc's session stays
        self._closing = False  # close() was called with pins: closed to callers, not yet in libkvc
        self.geometry = geometry
        self._final: Optional[SessionStats] = None
        self._kv_shapes = [(geometry.n_kv_heads, geometry.head_dim), (geometry.n_kv_heads * geometry.head_dim,)]
        self._q_shapes = [(geometry.n_heads, geometry.head_dim), (geometry.n_heads * geometry.head_dim,)]

    def __repr__(self) -> str:
        state = f"id={self.id}" if self._ptr else "closed"
        return f"<kvcd.Session {state} {self.geometry}>"

    def _p(self) -> int:
        if not self._ptr or self._closing or not self._client._ptr:
            raise KvcInvalid(22, "the session is closed")
        return self._ptr

    def _pin(self, buf: Any) -> None:
        self._pins += 1
        weakref.finalize(buf, self._unpin)

    def _unpin(self) -> None:
        """The last array of a view buffer went: a close() deferred for it happens now."""
        with self._client._lock:
            self._pins -= 1
            if self._pins or not self._closing:
                return
            self._closing = False
            try:
                if self._ptr and self._client._live_ptr():
                    self._close_now()
            finally:
                self._ptr = None
                self._client._release_pinned()

    def _check(self, r: int, what: str) -> int:
        if r < 0:
            _raise(r, self._client._last_error() or what)
        return r

    @property
    def closed(self) -> bool:
        return not self._ptr or self._closing or not self._client._ptr

    @property
    def id(self) -> int:
        """kvcd's id of the session (the ID column of kvcctl sessions)."""
        return int(_lib.load().kvc_session_id(self._p()))

    @property
    def budget(self) -> int:
        """The budget kvcd put in force (tokens per layer)."""
        return int(_lib.load().kvc_session_budget(self._p()))

    @property
    def max_tokens(self) -> int:
        """The most tokens one layer may hold before kvcd's next plan makes room."""
        return int(_lib.load().kvc_session_max_tokens(self._p()))

    @property
    def shared_tokens(self) -> int:
        """Tokens of a shared prefix at the front of every layer (already computed elsewhere)."""
        return int(_lib.load().kvc_session_shared_tokens(self._p()))

    @property
    def last_step(self) -> Optional[int]:
        """The last step the session took, or None before its first."""
        stepped = ctypes.c_int(0)
        s = _lib.load().kvc_session_last_step(self._p(), ctypes.byref(stepped))
        return int(s) if stepped.value else None

    def layer_tokens(self, layer: int) -> int:
        """The tokens the layer holds now."""
        self._layer(layer)
        return int(_lib.load().kvc_layer_tokens(self._p(), layer))

    def q8_tokens(self, layer: int) -> int:
        """Of the layer's tokens, how many (the oldest) are held below the dtype (in INT8 for a
        session whose only lower tier is q8)."""
        self._layer(layer)
        return int(_lib.load().kvc_layer_q8_tokens(self._p(), layer))

    @property
    def tiers(self) -> List[str]:
        """The session's tiers, its dtype's first ("f32", "q8", "q4", ...)."""
        lib, p = _lib.load(), self._p()
        return [lib.kvc_session_tier_name(p, t).decode() for t in range(lib.kvc_session_tiers(p))]

    @property
    def bytes(self) -> int:
        """The bytes kvcd charges the session now: every tier's blocks and its plan buffer."""
        return int(_lib.load().kvc_session_bytes(self._p()))

    @property
    def budget_bytes(self) -> int:
        """The byte budget in force (0: none)."""
        return int(_lib.load().kvc_session_budget_bytes(self._p()))

    def tier_tokens(self, layer: int) -> Dict[str, int]:
        """How many of the layer's tokens each tier holds, by tier name."""
        self._layer(layer)
        lib, p = _lib.load(), self._p()
        return {name: int(lib.kvc_layer_tier_tokens(p, layer, t)) for t, name in enumerate(self.tiers)}

    def _layer(self, layer: int) -> None:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.geometry.n_layers:
            raise KvcInvalid(22, f"layer {layer!r} of {self.geometry.n_layers}")

    def reserve(self, n_tokens: int) -> None:
        """Makes room for n_tokens tokens in every layer (a prompt); KvcNoSpace beyond the
        policy's limit or the pool."""
        n_tokens = _u32("n_tokens", n_tokens)
        with self._client._lock:
            self._check(_lib.load().kvc_session_reserve(self._p(), n_tokens), f"reserve {n_tokens}")

    def append(self, layer: int, pos: Union[int, Sequence[int]], k: ArrayLike, v: ArrayLike) -> None:
        """Stores keys and values at the end of the layer: one token ([n_kv_heads, head_dim] or
        flat, at position ``pos``) or n tokens ([n, n_kv_heads, head_dim], at positions
        ``pos``, ``pos + 1``, ... or at the n positions of a sequence). Every array and position
        is checked before the first token goes in; if libkvc refuses a token of a batch (the
        session's limit), the tokens before it stay appended (``layer_tokens`` says how many)."""
        self._layer(layer)
        g = self.geometry
        if isinstance(k, np.ndarray) and k.ndim == 3:
            n = k.shape[0]
            shapes = [(n, g.n_kv_heads, g.head_dim)]
            k = _floats("k", k, shapes)
            v = _floats("v", v, shapes)
            if np.isscalar(pos):
                first = _i32("position", pos)
                positions = list(range(first, first + n))
            else:
                positions = [_i32("position", p) for p in pos]
            if len(positions) != n:
                raise KvcInvalid(22, f"{len(positions)} positions for {n} tokens")
        else:
            k = _floats("k", k, self._kv_shapes)
            v = _floats("v", v, self._kv_shapes)
            positions = [_i32("position", pos)]
        for at in positions:
            if not -(2**31) <= at < 2**31:
                raise KvcInvalid(22, f"position {at} is not a 32-bit integer")
        lib = _lib.load()
        kp, vp = _f32p(k), _f32p(v)
        row = g.n_kv_heads * g.head_dim * 4  # bytes per token of k and v
        with self._client._lock:
            p = self._p()
            for i, at in enumerate(positions):
                self._check(lib.kvc_append(p, layer, at, kp + i * row, vp + i * row), f"append to layer {layer}")

    def attend(self, layer: int, q: ArrayLike, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Decode attention of q ([n_heads, head_dim] or flat) over the layer's cache; updates the
        per-token scores the policies rank by. Returns ``out`` (float32, q's shape; made when not
        given)."""
        self._layer(layer)
        q = _floats("q", q, self._q_shapes)
        if out is None:
            out = np.empty(q.shape, dtype=np.float32)
        elif not isinstance(out, np.ndarray) or out.dtype != np.float32:
            raise KvcDtypeError(22, "out must be a float32 numpy array")
        elif out.shape != q.shape or not out.flags.c_contiguous or not out.flags.writeable:
            raise KvcInvalid(22, f"out must be a writable C-contiguous array of shape {q.shape}")
        with self._client._lock:
            self._check(_lib.load().kvc_attend(self._p(), layer, _f32p(q), _f32p(out)), f"attend layer {layer}")
        return out

    def step(self, step: int, summary: Union[Summary, ArrayLike], phase: str = "decode") -> None:
        """Queues the summary of step ``step`` (strictly increasing) for the next Client.flush();
        ``summary`` is a Summary or the step's logits (summarized here). ``phase`` is "decode" or
        "prefill"."""
        if not isinstance(summary, Summary):
            summary = summarize(summary)
        if phase not in _PHASES:
            raise KvcInvalid(22, f"phase {phase!r}: 'decode' or 'prefill'")
        if not isinstance(step, (int, np.integer)) or not 0 <= step < 2**64:
            raise KvcInvalid(22, f"step {step!r} is not a 64-bit unsigned integer")
        c = summary._c()
        with self._client._lock:
            self._check(_lib.load().kvc_step(self._p(), step, _PHASES[phase], ctypes.byref(c)), f"step {step}")

    def append_slots(self, layer: int, n: int) -> None:
        """Counts n more tokens at the end of the layer that the caller writes itself through
        layer_view() (the slots from the layer's old length on)."""
        self._layer(layer)
        n = _u32("n", n)
        with self._client._lock:
            self._check(_lib.load().kvc_append_slots(self._p(), layer, n), f"append_slots {n}")

    def layer_view(self, layer: int) -> LayerView:
        """The layer's blocks as numpy views onto the pool (no copy; valid until the session's
        next append, flush or close). KvcNotSupported on a device pool (GPU addresses)."""
        self._layer(layer)
        if self._client.is_device:
            raise KvcNotSupported(95, "a device pool's blocks are GPU memory: use kvc_layer_view from C/CUDA")
        cv = _lib.CLayerView()
        with self._client._lock:
            self._check(_lib.load().kvc_layer_view(self._p(), layer, ctypes.byref(cv)), f"layer_view {layer}")
            return LayerView(self, cv, self.shared_tokens)

    def gather(self, layer: int, first: int = 0, n: Optional[int] = None, keys: Optional[np.ndarray] = None,
               values: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
        """A copy of slots [first, first + n) of the layer (n None: to the end) as float32 arrays
        [n_kv_heads, n, head_dim] (kvc_layer_gather: INT8 slots dequantized, f16/bf16 converted).
        ``keys`` and ``values``, when given, are float32 C-contiguous arrays [n_kv_heads, S,
        head_dim] with S >= n: rows [:, :n] are written, the rest left alone, and they are
        returned. KvcNotSupported on a device pool."""
        self._layer(layer)
        if self._client.is_device:
            raise KvcNotSupported(95, "a device pool's blocks are GPU memory: gather them with CUDA")
        first = _u32("first", first)
        held = self.layer_tokens(layer)
        n = max(held - first, 0) if n is None else _u32("n", n)
        g = self.geometry
        outs = []
        for name, a in (("keys", keys), ("values", values)):
            if a is None:
                a = np.empty((g.n_kv_heads, n, g.head_dim), dtype=np.float32)
            elif not isinstance(a, np.ndarray) or a.dtype != np.float32:
                raise KvcDtypeError(22, f"{name} must be a float32 numpy array")
            elif (a.ndim != 3 or a.shape[0] != g.n_kv_heads or a.shape[2] != g.head_dim or a.shape[1] < n
                  or not a.flags.c_contiguous or not a.flags.writeable):
                raise KvcInvalid(22, f"{name} must be a writable C-contiguous array of shape "
                                 f"({g.n_kv_heads}, >= {n}, {g.head_dim}), not {a.shape}")
            outs.append(a)
        with self._client._lock:
            self._check(_lib.load().kvc_layer_gather(self._p(), layer, first, n, outs[0].shape[1], _f32p(outs[0]),
                                                     _f32p(outs[1])), f"gather layer {layer}")
        if keys is None:
            return outs[0][:, :n], outs[1][:, :n]
        return outs[0], outs[1]

    def scores(self, layer: int, first: int = 0, n: Optional[int] = None) -> np.ndarray:
        """The ranking scores (the `sum` side array) of slots [first, first + n) of the layer, a
        float32 array [n_kv_heads, n] (kvc_layer_get_scores: every tier)."""
        self._layer(layer)
        first = _u32("first", first)
        n = max(self.layer_tokens(layer) - first, 0) if n is None else _u32("n", n)
        out = np.empty((self.geometry.n_kv_heads, n), dtype=np.float32)
        with self._client._lock:
            self._check(_lib.load().kvc_layer_get_scores(self._p(), layer, first, n, _f32p(out)),
                        f"scores of layer {layer}")
        return out

    def set_scores(self, layer: int, scores: ArrayLike, first: int = 0) -> None:
        """Writes the ranking scores of slots [first, first + n) of the layer from ``scores``
        [n_kv_heads, n] (kvc_layer_set_scores): an importance of the caller's own, which the
        ranking policies (the ladder's ``score=sum``) read at kvcd's next plan (docs/policies.md,
        "Importance without the question"). Finite values only."""
        self._layer(layer)
        a = np.ascontiguousarray(np.asarray(scores, dtype=np.float32))
        if a.ndim != 2 or a.shape[0] != self.geometry.n_kv_heads:
            raise KvcInvalid(22, f"scores must have shape ({self.geometry.n_kv_heads}, n), not {a.shape}")
        with self._client._lock:
            self._check(_lib.load().kvc_layer_set_scores(self._p(), layer, _u32("first", first), a.shape[1],
                                                         _f32p(a)), f"scores of layer {layer}")

    def stats(self) -> SessionStats:
        """The session's stats as this client knows them (after close(): kvcd's final ones)."""
        if self._final is not None and self.closed:
            return self._final
        c = _lib.CSessionStats()
        _lib.load().kvc_session_get_stats(self._p(), ctypes.byref(c))
        return SessionStats._of(c)

    def export(self) -> Handoff:
        """Trades the session for a one-time ticket another process imports within 30 s
        (Client.import_session); the session is gone here afterwards. Sessions opened with
        handoff=True only."""
        h = _lib.CHandoff()
        with self._client._lock:
            p = self._p()
            r = _lib.load().kvc_session_export(p, ctypes.byref(h))
            if r == 0:
                self._forget()
            self._check(r, "export")
        return Handoff(h.session_id, bytes(h.ticket))

    def _forget(self) -> None:
        self._client._sessions.pop(id(self), None)
        self._ptr = None

    def close(self) -> Optional[SessionStats]:
        """Closes the session (kvcd frees its blocks) and returns kvcd's final accounting. A second
        close returns the same stats; closing a session whose client is closed does nothing.
        While an array of one of its layer views lives, the session is closed to every call at
        once but kept in libkvc and kvcd (its blocks under the array) until the last such array
        goes; close() then returns None."""
        with self._client._lock:
            if not self._ptr or self._closing:
                return self._final
            if not self._client._ptr:  # kvc_disconnect closed it already
                self._ptr = None
                return self._final
            if self._pins:
                self._closing = True
                return None
            return self._close_now()

    def _close_now(self) -> SessionStats:
        c = _lib.CSessionStats()
        p = self._ptr
        self._forget()
        r = _lib.load().kvc_session_close(p, ctypes.byref(c))  # frees the session even on failure
        if r < 0:
            _raise(r, self._client._last_error() or "close")
        self._final = SessionStats._of(c)
        return self._final


def full_cache_bytes(geometry: Geometry, n_tokens: int, fraction: float = 1.0) -> int:
    """``fraction`` of the bytes kvcd charges for ``n_tokens`` tokens in every layer at the
    geometry's dtype (whole 16-token blocks): what a byte budget is a fraction of."""
    g = geometry._c()
    full = int(_lib.load().kvc_full_cache_bytes(ctypes.byref(g), _u32("n_tokens", n_tokens)))
    if not full:
        raise KvcInvalid(22, "kvcd would refuse this geometry")
    return int(fraction * full)


class Client(_Closes):
    """One connection to kvcd (kvcd.connect). A context manager; close() closes every session."""

    def __init__(self, socket: Optional[str] = None, name: Optional[str] = None, plan_lag: int = 0,
                 timeout_ms: int = 0, resume_ms: int = 0, daemon_user: Optional[str] = None) -> None:
        opt = _lib.Options(_bytes(socket, "socket"), _bytes(name, "name"), _i32("timeout_ms", timeout_ms),
                           _u32("plan_lag", plan_lag), _i32("resume_ms", resume_ms),
                           _bytes(str(daemon_user) if isinstance(daemon_user, (int, np.integer))
                                  and not isinstance(daemon_user, bool) else daemon_user, "daemon_user"))
        lib = _lib.load()
        self._ptr: Optional[int] = None
        self._pinned_ptr: Optional[int] = None  # closed with views alive: disconnected when they go
        self._lock = threading.RLock()
        self._sessions: Dict[int, "weakref.ref[Session]"] = {}
        self.socket = socket
        out = ctypes.c_void_p()
        r = lib.kvc_connect(ctypes.byref(opt), ctypes.byref(out))
        if r < 0:
            why = lib.kvc_last_error(None)
            _raise(r, (why or b"").decode(errors="replace") or f"cannot connect to kvcd at {socket or 'the default'}")
        self._ptr = out.value

    def _p(self) -> int:
        if not self._ptr:
            raise KvcInvalid(22, "the client is closed")
        return self._ptr

    def _live_ptr(self) -> Optional[int]:
        """The connection, open or kept for the arrays of views after close()."""
        return self._ptr or self._pinned_ptr

    def _release_pinned(self) -> None:
        """A pinned session was let go: the connection kept for it goes with the last one."""
        if self._pinned_ptr and not any(s._pins for s in (w() for w in list(self._sessions.values())) if s):
            p, self._pinned_ptr = self._pinned_ptr, None
            self._sessions.clear()
            _lib.load().kvc_disconnect(p)

    def _last_error(self) -> str:
        if not self._ptr:
            return ""
        m = _lib.load().kvc_last_error(self._ptr)
        return (m or b"").decode(errors="replace")

    def _check(self, r: int, what: str) -> int:
        if r < 0:
            _raise(r, self._last_error() or what)
        return r

    @property
    def closed(self) -> bool:
        return not self._ptr

    @property
    def is_device(self) -> bool:
        """True when kvcd's pool is GPU memory (kvcd --backend cuda)."""
        return bool(_lib.load().kvc_pool_is_device(self._p()))

    @property
    def pool_device(self) -> int:
        """The CUDA ordinal of a device pool in this process, -1 for host memory."""
        return int(_lib.load().kvc_pool_device(self._p()))

    @property
    def sessions(self) -> List[Session]:
        """The sessions of this client that are still open."""
        return [s for s in (w() for w in list(self._sessions.values())) if s is not None and not s.closed]

    def open_session(self, geometry: Geometry, policy: str = "full", budget: int = 0,
                     params: Optional[Mapping[str, Any]] = None, tenant: Optional[str] = None,
                     prompt_tokens: int = 0, prompt_token_ids: Optional[Iterable[int]] = None,
                     share_prefix: bool = False, model_id: Optional[str] = None, min_bytes: int = 0,
                     max_bytes: int = 0, priority: int = 0, handoff: bool = False,
                     tiers: Optional[Iterable[str]] = None, rotation_seed: int = 0, budget_bytes: int = 0,
                     budget_fraction: Optional[float] = None) -> Session:
        """Opens a session: ``policy`` ("full", "window", "h2o", "conf", ... docs/policies.md)
        with ``budget`` tokens per layer (0: the policy's default) and its ``params`` (numbers or
        words); ``tenant`` (None: the default); ``prompt_tokens`` / ``prompt_token_ids`` the
        prompt (for the prefill policies, KV events, and ``share_prefix`` with ``model_id``);
        ``min_bytes``, ``max_bytes`` and ``priority`` the memory limits (docs/operations.md,
        "Budgets"); ``handoff`` lets the session be exported; ``tiers`` the precision ladder's
        tiers below the dtype, highest first (``["q4"]``, ``["q8", "q4"]``: docs/protocol.md,
        "Tiers"; with ``params={"tier_window": N}`` every token but the newest N at the lowest)
        and ``rotation_seed`` the seed of the rotated tiers. ``budget_bytes`` a byte budget for the
        whole cache as kvcd charges it, or ``budget_fraction`` one as a fraction of the full cache
        of ``geometry.max_tokens`` tokens (docs/policies.md, "Byte budgets": the ``ladder`` policy
        fits it by lowering precision first; token policies get the tokens it buys)."""
        if not isinstance(geometry, Geometry):
            raise KvcDtypeError(22, f"geometry must be a kvcd.Geometry, not {type(geometry).__name__}")
        cfg = _lib.SessionConfig()
        cfg.geometry = geometry._c()
        keep: List[Any] = []  # the C strings and arrays cfg points to, alive through the call
        if policy is None:
            raise KvcDtypeError(22, "policy must be a str, not None")
        cfg.policy = _bytes(policy, "policy")
        cfg.budget_tokens = _u32("budget", budget)
        if params is not None and not isinstance(params, Mapping):
            raise KvcDtypeError(22, f"params must be a mapping, not {type(params).__name__}")
        if params:
            arr = (_lib.Param * len(params))()
            for i, (key, val) in enumerate(params.items()):
                arr[i].key = _bytes(key, "a parameter name")
                if isinstance(val, (bool, np.bool_)):
                    val = int(val)  # "1" / "0", as kvcctl and the C API spell a switch
                elif not isinstance(val, (str, int, float, np.integer, np.floating)):
                    raise KvcDtypeError(22, f"parameter {key}: a number or a word, not {type(val).__name__}")
                arr[i].value = _bytes(str(val), f"parameter {key}")
            cfg.params = ctypes.cast(arr, ctypes.POINTER(_lib.Param))
            cfg.n_params = len(params)
            keep.append(arr)
        cfg.tenant = _bytes(tenant, "tenant")
        cfg.prompt_tokens = _u32("prompt_tokens", prompt_tokens)
        if prompt_token_ids is not None:
            if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Iterable):
                raise KvcDtypeError(22, f"prompt_token_ids must be integers, not {type(prompt_token_ids).__name__}")
            raw = prompt_token_ids if isinstance(prompt_token_ids, np.ndarray) else list(prompt_token_ids)
            ids = np.asarray(raw)
            if ids.size and ids.dtype.kind not in "iu":  # floats were truncated, objects may be anything
                if ids.dtype.kind != "O" or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                                                    for x in ids.ravel()):
                    raise KvcDtypeError(22, f"prompt token ids must be integers, not {ids.dtype}")
            if ids.ndim > 1:
                raise KvcInvalid(22, f"prompt token ids have shape {ids.shape}, expected one dimension")
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= 2**32):
                raise KvcInvalid(22, "prompt token ids must be 32-bit unsigned integers")
            ids32 = np.ascontiguousarray(ids.astype(np.uint32) if ids.size else np.zeros(0, np.uint32))
            keep.append(ids32)
            cfg.prompt_token_ids = ids32.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32))
            cfg.n_prompt_token_ids = ids32.size
            if not prompt_tokens:
                cfg.prompt_tokens = ids32.size
        cfg.min_bytes = _u64("min_bytes", min_bytes)
        cfg.max_bytes = _u64("max_bytes", max_bytes)
        cfg.priority = _i32("priority", priority)
        cfg.handoff = int(bool(handoff))
        cfg.share_prefix = int(bool(share_prefix))
        cfg.model_id = _bytes(model_id, "model_id")
        if tiers is not None:
            if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Iterable):
                raise KvcDtypeError(22, f"tiers must be a list of names, not {type(tiers).__name__}")
            names = list(tiers)
            if not all(isinstance(t, str) and t and "," not in t for t in names):
                raise KvcDtypeError(22, f"tiers must be names such as 'q4', not {names!r}")
            cfg.tiers = _bytes(",".join(names), "tiers") if names else None
        cfg.rotation_seed = _u64("rotation_seed", rotation_seed)
        cfg.budget_bytes = _u64("budget_bytes", budget_bytes)
        if budget_fraction is not None:
            if budget_bytes or isinstance(budget_fraction, bool) or not isinstance(budget_fraction, (int, float)) \
                    or not 0 < budget_fraction <= 1e6:
                raise KvcInvalid(22, "budget_fraction: a number above 0 (and not with budget_bytes)")
            cfg.budget_bytes = full_cache_bytes(geometry, geometry.max_tokens, budget_fraction)
        out = ctypes.c_void_p()
        with self._lock:
            self._check(_lib.load().kvc_session_open(self._p(), ctypes.byref(cfg), ctypes.byref(out)),
                        f"open a {policy} session")
            return self._adopt(out.value, geometry)

    def _adopt(self, ptr: int, geometry: Geometry) -> Session:
        s = Session(self, ptr, geometry)
        self._sessions[id(s)] = weakref.ref(s)
        return s

    def import_session(self, handoff: Handoff, geometry: Geometry) -> Session:
        """Takes over a session another process exported (Session.export). ``geometry`` is the
        exporter's (the model's): kvc.h has no getter for an imported session's geometry, and the
        importer runs the same model anyway."""
        if not isinstance(handoff, Handoff) or not isinstance(geometry, Geometry):
            raise KvcDtypeError(22, "import_session takes a kvcd.Handoff and a kvcd.Geometry")
        if not isinstance(handoff.ticket, (bytes, bytearray)) or len(handoff.ticket) != 16:
            raise KvcInvalid(22, "a ticket is 16 bytes")
        _u64("session_id", handoff.session_id)
        h = _lib.CHandoff(handoff.session_id, (ctypes.c_uint8 * 16)(*handoff.ticket))
        out = ctypes.c_void_p()
        with self._lock:
            self._check(_lib.load().kvc_session_import(self._p(), ctypes.byref(h), ctypes.byref(out)), "import")
            return self._adopt(out.value, geometry)

    def flush(self) -> None:
        """Sends the queued step summaries of every session in one message and applies the plans
        kvcd answers with (up to plan_lag answers may stay outstanding)."""
        with self._lock:
            self._check(_lib.load().kvc_flush(self._p()), "flush")

    def poll(self, timeout_ms: int = 0) -> int:
        """Handles what kvcd sent (plans, grants, an operator's evict), waiting up to timeout_ms
        for the first message; returns how many messages were handled."""
        timeout_ms = _i32("timeout_ms", timeout_ms)
        with self._lock:
            return self._check(_lib.load().kvc_poll(self._p(), timeout_ms), "poll")

    def close(self) -> None:
        """Closes every session of the client and the connection. A second close does nothing.
        Sessions with live arrays of layer views are closed to every call at once, and they and
        the connection (the mapping under the arrays) go when the last of those arrays goes."""
        with self._lock:
            if not self._ptr:
                return
            p, self._ptr = self._ptr, None
            sessions = [s for s in (w() for w in list(self._sessions.values())) if s is not None and s._ptr]
            if any(s._pins for s in sessions):
                self._pinned_ptr = p
                for s in sessions:
                    if s._pins:
                        s._closing = True
                    else:
                        try:
                            s._close_now()
                        except KvcError:
                            pass  # freed in libkvc all the same
                return
            for s in sessions:
                s._ptr = None
            self._sessions.clear()
            _lib.load().kvc_disconnect(p)


def connect(socket: Optional[str] = None, name: Optional[str] = None, plan_lag: int = 0, timeout_ms: int = 0,
            resume_ms: int = 0, daemon_user: Optional[str] = None) -> Client:
    """Connects to kvcd: ``socket`` is its runtime directory or kvcd.sock (None: $KVC_SOCKET,
    else $XDG_RUNTIME_DIR/kvcd, else /tmp/kvcd-$UID); ``name`` is shown to operators;
    ``plan_lag`` the steps the client may run ahead of kvcd's answers; ``timeout_ms`` every wait
    on kvcd (0: 10 s); ``resume_ms`` how long to try to resume after a kvcd restart (0: 30 s,
    negative: never); ``daemon_user`` the only user (a name or a uid) kvcd may run as (None:
    $KVC_DAEMON_UID, else root, this process's uid or the user "kvcd"; kvc.h, kvc_options)."""
    return Client(socket, name, plan_lag, timeout_ms, resume_ms, daemon_user)


def default_runtime_dir() -> str:
    """The runtime directory a client uses without a socket."""
    buf = ctypes.create_string_buffer(4096)
    r = _lib.load().kvc_default_runtime_dir(buf, len(buf))
    if r < 0:
        _raise(r, "kvc_default_runtime_dir")
    return buf.value.decode()
