"""kvcd: Python access to kvcd, the KV-cache daemon, over libkvc (ctypes; no compiled extension).

    import numpy as np, kvcd
    with kvcd.connect(name="demo") as client:
        geo = kvcd.Geometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_tokens=64)
        with client.open_session(geo, policy="window", budget=32) as s:
            s.append(0, 0, k, v); out = s.attend(0, q)
            s.step(0, logits); client.flush()

kvcd.client has the connection and its sessions, kvcd.admin what kvcctl does, kvcd.errors the
exceptions (one per errno). docs/python.md is the guide.

kvcd.admin is imported here, so `import kvcd` is enough for `kvcd.admin.Admin(socket).status()`
(the README's spelling; before issue 30 it needed `import kvcd.admin`). It costs nothing: it
imports only the standard library and this package's own modules, and finds kvcctl at the first
Admin(). kvcd.transformers is not imported: it needs torch, which the package does not require.
"""

from .client import (
    Block,
    Client,
    Geometry,
    Handoff,
    LayerView,
    Session,
    SessionStats,
    Summary,
    connect,
    default_runtime_dir,
    full_cache_bytes,
    summarize,
)
from .errors import (
    KvcAlready,
    KvcBusy,
    KvcDtypeError,
    KvcError,
    KvcInvalid,
    KvcMessageSize,
    KvcNoDevice,
    KvcNoSpace,
    KvcNotConnected,
    KvcNotFound,
    KvcNotPermitted,
    KvcNotSupported,
    KvcPermission,
    KvcProtocol,
    KvcShutdown,
    KvcStale,
    KvcTimeout,
    error_for,
)
from ._lib import LibraryNotFound
from . import admin

__version__ = "0.3.0"

__all__ = [
    "Block", "Client", "Geometry", "Handoff", "LayerView", "Session", "SessionStats", "Summary",
    "admin", "connect", "default_runtime_dir",
    "full_cache_bytes", "summarize", "error_for", "LibraryNotFound",
    "KvcError", "KvcAlready", "KvcBusy", "KvcDtypeError", "KvcInvalid", "KvcMessageSize", "KvcNoDevice",
    "KvcNoSpace", "KvcNotConnected", "KvcNotFound", "KvcNotPermitted", "KvcNotSupported", "KvcPermission",
    "KvcProtocol", "KvcShutdown", "KvcStale", "KvcTimeout",
]
