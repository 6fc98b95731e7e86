"""kvcd.errors: the exception classes, one per errno that libkvc and kvcd answer with.

libkvc returns -errno and keeps the reason (kvcd's one-line message included) for
kvc_last_error(); kvcctl --json prints {"error": {"code", "name", "message"}}. Both become the
same exception here: a KvcError subclass chosen by the errno, carrying ``errno``, ``errno_name``
and ``message``. The table README's "Errors" section lists the codes; an errno without a class
of its own raises KvcError itself.

The classes that mean what a builtin exception means also derive from it (KvcInvalid is a
ValueError, KvcTimeout a TimeoutError, KvcPermission a PermissionError, KvcNotConnected a
ConnectionError), so code that catches the builtin keeps working. Argument refusals made in
Python before libkvc is called (a float64 array, a wrong shape) are KvcInvalid too, with EINVAL,
because libkvc would have refused them the same way; a wrong dtype is KvcDtypeError, also a
TypeError.
"""

from __future__ import annotations

import errno as _errno
from typing import Dict, Optional, Type


class KvcError(Exception):
    """A call libkvc or kvcd refused. ``errno`` is the positive code, ``errno_name`` its name
    ("ENOSPC"), ``message`` the reason libkvc or kvcd gave."""

    def __init__(self, code: int, message: str = "", name: Optional[str] = None) -> None:
        self.errno = code
        self.errno_name = name or _errno.errorcode.get(code, f"E{code}")
        self.message = message
        super().__init__(f"{self.errno_name}: {message}" if message else self.errno_name)


class KvcNotPermitted(KvcError):
    """EPERM: a session of another client, a request before Hello."""


class KvcNotFound(KvcError, LookupError):
    """ENOENT: no such session (or plan)."""


class KvcPermission(KvcError, PermissionError):
    """EACCES: a tenant bound to another uid or gid, a socket this user may not open."""


class KvcBusy(KvcError):
    """EBUSY: a limit below what is guaranteed; a Reserve while one waits."""


class KvcInvalid(KvcError, ValueError):
    """EINVAL: a field out of range (geometry, policy, parameter, layer, array shape)."""


class KvcDtypeError(KvcInvalid, TypeError):
    """EINVAL for an array of a dtype the binding does not take (float32 and float16 only)."""


class KvcNoSpace(KvcError):
    """ENOSPC: the pool, a tenant's quota, the policy's per-layer limit or the session's cap."""


class KvcProtocol(KvcError):
    """EPROTO: kvcd and libkvc disagree about the wire (a bug, or mismatched versions)."""


class KvcMessageSize(KvcError):
    """EMSGSIZE: a request over kvcd's frame limit."""


class KvcNotSupported(KvcError):
    """ENOTSUP: not on this pool (CPU attention on a device pool, a plan without a compactor)."""


class KvcShutdown(KvcError):
    """ESHUTDOWN: kvcd is draining, or an operator evicted the session."""


class KvcAlready(KvcError):
    """EALREADY: done once already."""


class KvcStale(KvcError):
    """ESTALE: an old plan, or kvcd came back with another pool."""


class KvcTimeout(KvcError, TimeoutError):
    """ETIMEDOUT: kvcd did not answer within the client's timeout."""


class KvcNotConnected(KvcError, ConnectionError):
    """ENOTCONN (or ECONNREFUSED): kvcd is not there, or closed the connection for good."""


class KvcNoDevice(KvcError):
    """ENODEV / ENXIO: a device pool whose GPU this process cannot reach."""


_BY_ERRNO: Dict[int, Type[KvcError]] = {
    _errno.EPERM: KvcNotPermitted,
    _errno.ENOENT: KvcNotFound,
    _errno.EACCES: KvcPermission,
    _errno.EBUSY: KvcBusy,
    _errno.EINVAL: KvcInvalid,
    _errno.ENOSPC: KvcNoSpace,
    _errno.EPROTO: KvcProtocol,
    _errno.EMSGSIZE: KvcMessageSize,
    _errno.ENOTSUP: KvcNotSupported,
    _errno.ESHUTDOWN: KvcShutdown,
    _errno.EALREADY: KvcAlready,
    _errno.ESTALE: KvcStale,
    _errno.ETIMEDOUT: KvcTimeout,
    _errno.ENOTCONN: KvcNotConnected,
    _errno.ECONNREFUSED: KvcNotConnected,
    _errno.ENODEV: KvcNoDevice,
    _errno.ENXIO: KvcNoDevice,
}


def error_for(code: int, message: str = "", name: Optional[str] = None) -> KvcError:
    """The exception for a positive or negative errno code."""
    code = abs(code)
    return _BY_ERRNO.get(code, KvcError)(code, message, name)
