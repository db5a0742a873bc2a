"""Exceptions: one class per KVP_E* status, all under :class:`kvpool.Error`.

Every failed C call raises the class of its status. The exception carries
the status (``.status``, ``.name``), the C function (``.call``) and
``kvp_last_error()``'s message (``.message``), which names the argument,
layer, head or token at fault::

    try:
        pool.append(seq, layer, k, v)
    except kvpool.BudgetError as e:
        print(e.name, e.message)      # KVP_EBUDGET, "append seq 1 layer 0: ..."

Arguments the binding can check before the call (shape, dtype, device,
contiguity) raise :class:`InvalidError` without reaching the library. Where a
builtin exception fits, the class also derives from it (``InvalidError`` is a
``ValueError``, ``NotFoundError`` a ``LookupError``, ...), so generic handlers
work too.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

from . import _lib


class Error(Exception):
    """Base of every kvpool error.

    Attributes:
        status: the negative KVP_E* status (int).
        name: its name, e.g. ``"KVP_EBUDGET"``.
        call: the C function that failed (or the binding's method), e.g. ``"kvp_append"``.
        message: ``kvp_last_error()`` at the time of the failure (or the binding's check).
    """

    status: int = 0

    def __init__(self, message: str = "", call: str = "", status: Optional[int] = None):
        if status is not None:
            self.status = status
        self.name = _lib.lib.kvp_err_name(self.status).decode()
        self.call = call
        self.message = message
        desc = _lib.lib.kvp_strerror(self.status).decode()
        head = f"{call}: " if call else ""
        if not message:
            text = f"{self.name} ({desc})"
        elif message.startswith(self.name + ":"):  # the library's messages begin with the name
            text = message
        else:
            text = f"{self.name}: {message}"
        super().__init__(head + text)


class InvalidError(Error, ValueError):
    """KVP_EINVAL: an invalid argument (also raised by the binding's own checks)."""
    status = -1


class NoMemoryError(Error, MemoryError):
    """KVP_ENOMEM: out of host memory for metadata."""
    status = -2


class BudgetError(Error):
    """KVP_EBUDGET: the byte budget would be passed; nothing changed."""
    status = -3


class RegionFullError(Error):
    """KVP_ENOSPC: the region is full (or an output buffer is too small)."""
    status = -4


class NotFoundError(Error, LookupError):
    """KVP_ENOENT: no such entry (sequence, unit, codec)."""
    status = -5


class ExistsError(Error):
    """KVP_EEXIST: the entry already exists (a live sequence id)."""
    status = -6


class DeviceError(Error):
    """KVP_EDEVICE: a CUDA error (its message is in ``.message``)."""
    status = -7


class CodecError(Error):
    """KVP_ECODEC: a codec failed to encode or decode."""
    status = -8


class FormatError(Error):
    """KVP_EFORMAT: a bad data file (calibration), named in the message."""
    status = -9


class BusyError(Error):
    """KVP_EBUSY: busy (a step is open, a block is pinned)."""
    status = -10


class CorruptError(Error):
    """KVP_ECORRUPT: kvp_check found a broken invariant."""
    status = -11


class NotSupportedError(Error, NotImplementedError):
    """KVP_ENOTSUP: not supported (a CUDA region in a CPU-only build, reads of a dry pool, ...)."""
    status = -12


class StoreIOError(Error, IOError):
    """KVP_EIO: a store tier's connection, timeout or server failed (the message names the key)."""
    status = -13


BY_STATUS: Dict[int, Type[Error]] = {c.status: c for c in (
    InvalidError, NoMemoryError, BudgetError, RegionFullError, NotFoundError, ExistsError, DeviceError,
    CodecError, FormatError, BusyError, CorruptError, NotSupportedError, StoreIOError)}


def error_for(status: int, call: str) -> Error:
    """The exception for a failed C call: its class by status, kvp_last_error()'s message."""
    cls = BY_STATUS.get(status)
    if cls is None:
        return Error(_lib.last_error(), call, status)
    return cls(_lib.last_error(), call)
