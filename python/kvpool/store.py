"""The store tier from Python: a connection to a blob store (Redis) that pools offload
sequences to, restore them from, and share prompt prefixes through.

    with kvpool.Store("redis://127.0.0.1:6379/0?prefix=myengine:&ttl=3600") as st:
        pool.offload(7, st)          # seq 7 leaves the pool, its blocks now in Redis
        pool.restore(7, st)          # back whole under the same id
        pool.prefix_publish(1, st)   # prompt chunks of seq 1 for other pools / processes
        other.add(2, tokens=prompt)  # same prompt start, in another pool
        other.prefix_fetch(2, st)    # attached from the store instead of recomputed

The URL forms and options (prefix, ttl, max_bytes, timeout_ms) are kvp_store_open's
(include/kvpool.h). A library built without hiredis raises NotSupportedError at open.
One thread at a time uses a store (traffic() excepted: any thread may read it).
"""

from __future__ import annotations

from ctypes import byref, c_uint64, c_void_p
from typing import Any, Optional, Tuple

from . import _lib
from .errors import InvalidError, error_for

lib = _lib.lib


def _stream_handle(stream: Any) -> Optional[int]:
    """A cudaStream_t as an int: None (the legacy default stream), an int, or an object with
    ``cuda_stream`` (torch.cuda.Stream) or ``ptr`` (cupy)."""
    if stream is None:
        return None
    for attr in ("cuda_stream", "ptr"):
        h = getattr(stream, attr, None)
        if h is not None:
            return int(h) or None
    if isinstance(stream, int):
        return stream or None
    raise InvalidError(f"stream={stream!r}: None, an int (cudaStream_t) or a torch.cuda.Stream",
                       "kvp_store_set_stream")


class Store:
    """A connection to a store (kvp_store_open). Close it (or use ``with``) when done; a pool
    does not own the stores it uses."""

    def __init__(self, url: str = "redis://127.0.0.1:6379"):
        self._h: Optional[int] = None
        if not isinstance(url, str):
            raise InvalidError(f"url={url!r}: a string", "kvp_store_open")
        self.url = url
        h = c_void_p()
        rc = lib.kvp_store_open(url.encode(), byref(h))
        if rc:
            raise error_for(rc, "kvp_store_open")
        self._h = h.value
        self._stream: Any = None  # kept alive while the store copies on it

    def _handle(self) -> int:
        h = self._h
        if h is None:
            raise InvalidError("the store is closed", "kvpool.Store")
        return h

    def close(self) -> None:
        """Close the connection (kvp_store_close). Idempotent."""
        if self._h is not None:
            lib.kvp_store_close(self._h)
            self._h = None
            self._stream = None

    @property
    def closed(self) -> bool:
        return self._h is None

    def traffic(self) -> Tuple[int, int]:
        """(sent_bytes, received_bytes): value bytes this handle moved since it was opened
        (kvp_store_traffic); safe from any thread."""
        sent, recv = c_uint64(), c_uint64()
        rc = lib.kvp_store_traffic(self._handle(), byref(sent), byref(recv))
        if rc:
            raise error_for(rc, "kvp_store_traffic")
        return sent.value, recv.value

    def set_stream(self, stream: Any) -> None:
        """The CUDA stream on which transfers through this store copy a CUDA pool's pages
        (kvp_store_set_stream): a torch.cuda.Stream, a raw cudaStream_t int, or None (the
        legacy default stream). Ignored by host pools. An offload waits for the work enqueued
        on it before; a restore or fetch returns with its copies enqueued on it."""
        h = _stream_handle(stream)
        rc = lib.kvp_store_set_stream(self._handle(), h)
        if rc:
            raise error_for(rc, "kvp_store_set_stream")
        self._stream = stream

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"Store({self.url!r}{', closed' if self._h is None else ''})"
