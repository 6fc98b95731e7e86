"""kvcd._lib: finding libkvc and declaring its C API to ctypes (the only file that knows kvc.h).

The structures below mirror client/lib/kvc.h field for field; a field added there at the end of a
structure is added here at the end too. Every function gets its argtypes and restype, so a wrong
argument is a TypeError from ctypes instead of a corrupted stack.

Where the library comes from, first found wins:
  1. ``$KVC_LIBRARY``: a path to libkvc.so (the build tree sets it for the tests);
  2. the package's own directory (a wheel that bundles libkvc.so.0 / libkvc.so);
  3. the system's library path: ``ctypes.util.find_library("kvc")``, then the names libkvc.so.0
     and libkvc.so as the dynamic loader resolves them (ldconfig, ``LD_LIBRARY_PATH``).
The library is loaded on first use, not at import, so ``import kvcd`` works on a machine without
it (``pip show``, documentation builds) and the error says where it looked.

ctypes (not cffi, not a compiled extension) because the package then installs anywhere without a
compiler, and ctypes releases the GIL around each call: kvc_flush() waiting on kvcd does not stop
other Python threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from ctypes import (
    POINTER,
    Structure,
    c_char_p,
    c_float,
    c_int,
    c_int32,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)
from typing import List, Optional

SONAMES = ("libkvc.so.0", "libkvc.so")

KVC_DTYPE_F32 = 1
KVC_DTYPE_F16 = 2
KVC_DTYPE_BF16 = 3
KVC_PHASE_DECODE = 0
KVC_PHASE_PREFILL = 1


class Options(Structure):
    _fields_ = [
        ("socket", c_char_p),
        ("name", c_char_p),
        ("timeout_ms", c_int),
        ("plan_lag", c_uint32),
        ("resume_ms", c_int),
        ("daemon_user", c_char_p),
    ]


class CGeometry(Structure):
    _fields_ = [
        ("n_layers", c_uint32),
        ("n_heads", c_uint32),
        ("n_kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("dtype", c_int),
        ("max_tokens", c_uint32),
    ]


class Param(Structure):
    _fields_ = [("key", c_char_p), ("value", c_char_p)]


class SessionConfig(Structure):
    _fields_ = [
        ("geometry", CGeometry),
        ("policy", c_char_p),
        ("budget_tokens", c_uint32),
        ("params", POINTER(Param)),
        ("n_params", c_size_t),
        ("tenant", c_char_p),
        ("prompt_tokens", c_uint32),
        ("prompt_token_ids", POINTER(c_uint32)),
        ("n_prompt_token_ids", c_size_t),
        ("min_bytes", c_uint64),
        ("max_bytes", c_uint64),
        ("priority", c_int32),
        ("handoff", c_int),
        ("share_prefix", c_int),
        ("model_id", c_char_p),
        ("tiers", c_char_p),
        ("rotation_seed", c_uint64),
        ("budget_bytes", c_uint64),
    ]


class CSessionStats(Structure):
    _fields_ = [
        ("steps", c_uint64),
        ("plans", c_uint64),
        ("plans_applied", c_uint64),
        ("blocks_moved", c_uint64),
        ("peak_tokens", c_uint32),
        ("peak_layer_blocks", c_uint32),
        ("peak_bytes", c_uint64),
        ("bytes", c_uint64),
    ]


class CHandoff(Structure):
    _fields_ = [("session_id", c_uint64), ("ticket", c_uint8 * 16)]


class CLayerView(Structure):
    _fields_ = [
        ("n_tokens", c_uint32),
        ("n_blocks", c_uint32),
        ("block_tokens", c_uint32),
        ("block_bytes", c_uint64),
        ("blocks", POINTER(c_void_p)),
        ("n_q8", c_uint32),
        ("n_q8_blocks", c_uint32),
        ("q8_block_bytes", c_uint64),
        ("q8_blocks", POINTER(c_void_p)),
    ]


class CSummary(Structure):
    _fields_ = [
        ("entropy", c_float),
        ("top1_prob", c_float),
        ("margin", c_float),
        ("top1", c_uint32),
    ]


_client_p = c_void_p
_session_p = c_void_p
# float arrays go as plain addresses (numpy's __array_interface__): building a POINTER(c_float)
# through ndarray.ctypes costs more than the call it feeds
_f32_p = c_void_p

# name: (restype, argtypes)
_PROTOTYPES = {
    "kvc_connect": (c_int, [POINTER(Options), POINTER(c_void_p)]),
    "kvc_disconnect": (c_void_p, [_client_p]),
    "kvc_last_error": (c_char_p, [_client_p]),
    "kvc_default_runtime_dir": (c_int, [c_char_p, c_size_t]),
    "kvc_session_open": (c_int, [_client_p, POINTER(SessionConfig), POINTER(c_void_p)]),
    "kvc_session_close": (c_int, [_session_p, POINTER(CSessionStats)]),
    "kvc_session_id": (c_uint64, [_session_p]),
    "kvc_session_budget": (c_uint32, [_session_p]),
    "kvc_session_max_tokens": (c_uint32, [_session_p]),
    "kvc_session_export": (c_int, [_session_p, POINTER(CHandoff)]),
    "kvc_session_import": (c_int, [_client_p, POINTER(CHandoff), POINTER(c_void_p)]),
    "kvc_session_last_step": (c_uint64, [_session_p, POINTER(c_int)]),
    "kvc_session_reserve": (c_int, [_session_p, c_uint32]),
    "kvc_append": (c_int, [_session_p, c_uint32, c_int32, _f32_p, _f32_p]),
    "kvc_attend": (c_int, [_session_p, c_uint32, _f32_p, _f32_p]),
    "kvc_layer_tokens": (c_uint32, [_session_p, c_uint32]),
    "kvc_session_shared_tokens": (c_uint32, [_session_p]),
    "kvc_layer_q8_tokens": (c_uint32, [_session_p, c_uint32]),
    "kvc_session_tiers": (c_uint32, [_session_p]),
    "kvc_session_tier_name": (c_char_p, [_session_p, c_uint32]),
    "kvc_layer_tier_tokens": (c_uint32, [_session_p, c_uint32, c_uint32]),
    "kvc_session_bytes": (c_uint64, [_session_p]),
    "kvc_layer_set_scores": (c_int, [_session_p, c_uint32, c_uint32, c_uint32, _f32_p]),
    "kvc_layer_get_scores": (c_int, [_session_p, c_uint32, c_uint32, c_uint32, _f32_p]),
    "kvc_session_budget_bytes": (c_uint64, [_session_p]),
    "kvc_full_cache_bytes": (c_uint64, [POINTER(CGeometry), c_uint32]),
    "kvc_layer_view": (c_int, [_session_p, c_uint32, POINTER(CLayerView)]),
    "kvc_layer_gather": (c_int, [_session_p, c_uint32, c_uint32, c_uint32, c_uint32, _f32_p, _f32_p]),
    "kvc_pool_is_device": (c_int, [_client_p]),
    "kvc_pool_base": (c_void_p, [_client_p]),
    "kvc_pool_device": (c_int, [_client_p]),
    "kvc_append_slots": (c_int, [_session_p, c_uint32, c_uint32]),
    "kvc_summarize": (c_int, [_f32_p, c_uint32, POINTER(CSummary)]),
    "kvc_confidence": (c_float, [POINTER(CSummary)]),
    "kvc_step": (c_int, [_session_p, c_uint64, c_int, POINTER(CSummary)]),
    "kvc_flush": (c_int, [_client_p]),
    "kvc_poll": (c_int, [_client_p, c_int]),
    "kvc_session_get_stats": (None, [_session_p, POINTER(CSessionStats)]),
}


class LibraryNotFound(ImportError):
    """libkvc could not be loaded from any of the places kvcd looks (the message lists them)."""


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None


def _candidates() -> List[str]:
    out: List[str] = []
    env = os.environ.get("KVC_LIBRARY")
    if env:
        out.append(env)
    here = os.path.dirname(os.path.abspath(__file__))
    out.extend(os.path.join(here, n) for n in SONAMES)
    found = ctypes.util.find_library("kvc")
    if found:
        out.append(found)
    out.extend(SONAMES)
    return out


def load() -> ctypes.CDLL:
    """The loaded libkvc, with every prototype declared. Raises LibraryNotFound."""
    global _lib, _path
    if _lib is not None:  # every call comes here: no lock once loaded
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        env = os.environ.get("KVC_LIBRARY")
        for cand in _candidates():
            # a path that is not there is skipped quietly, except $KVC_LIBRARY: naming a library
            # that does not exist is a mistake worth an error, not a fall-back to another one
            if os.sep in cand and not os.path.exists(cand):
                if cand == env:
                    raise LibraryNotFound(f"$KVC_LIBRARY names {cand}, which does not exist")
                tried.append(f"{cand} (absent)")
                continue
            try:
                lib = ctypes.CDLL(cand)
            except OSError as e:
                if cand == env:
                    raise LibraryNotFound(f"$KVC_LIBRARY={cand}: {e}") from e
                tried.append(f"{cand} ({e})")
                continue
            for name, (res, args) in _PROTOTYPES.items():
                fn = getattr(lib, name)
                fn.restype = res
                fn.argtypes = args
            _lib, _path = lib, cand
            return lib
        raise LibraryNotFound("libkvc not found; tried: " + "; ".join(tried))


def path() -> Optional[str]:
    """Where the loaded libkvc came from (None before the first use)."""
    return _path
