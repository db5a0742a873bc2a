"""kvpool: a KV-cache memory manager (the C library libkvpool), from Python.

A pool reserves one region (host memory or one CUDA allocation), stores the
keys and values of many sequences in variable-size pages under a strict byte
budget, compresses them with a codec per layer and K/V (raw, fp8, int8, kivi,
nvfp4, qvg, kvquant), evicts by policy (window, heatkv, ...), and accounts for
every byte it holds::

    import numpy as np, kvpool
    with kvpool.Pool(layers=2, kv_heads=2, head_dim=64, k_dtype="fp16", v_dtype="fp16",
                     codecs="kv=int8", region_bytes=64 << 20, budget_bytes=32 << 20) as pool:
        pool.add(1)
        pool.step_begin(1, 16)
        for layer in range(2):
            pool.append(1, layer, k, v)            # numpy [16][2][64] float16
        pool.step_end(1)
        k1, v1, pos = pool.read(1, 0, head=1)
        print(pool.stats()["bytes.allocated"]["current"])

See ``help(kvpool.Pool)`` for the calls, ``kvpool.Error`` for the
exceptions, and ``kvpool.hf.KvpoolCache`` for a Hugging Face transformers
cache backed by a pool. The package needs no compile step: it loads
libkvpool.so through ctypes (see ``kvpool.library_path``).
"""

from . import _lib
from .errors import (BudgetError, BusyError, CodecError, CorruptError, DeviceError, Error, ExistsError,
                     FormatError, InvalidError, NoMemoryError, NotFoundError, NotSupportedError,
                     RegionFullError, StoreIOError)
from .pool import BlockInfo, Pool, PoolView
from .store import Store

#: path (or name) of the libkvpool that was loaded
library_path: str = _lib.path
#: version of the loaded library ("MAJOR.MINOR.PATCH")
__version__: str = _lib.version()


def metadata_allocator() -> str:
    """Where the library's host metadata comes from (kvp_metadata_allocator): "jemalloc" (an
    arena of the libjemalloc.so.2 the process has, e.g. through ``LD_PRELOAD``) or "libc"."""
    return _lib.metadata_allocator()


def strerror(status: int) -> str:
    """kvp_strerror: the description of a status."""
    return _lib.lib.kvp_strerror(status).decode()


def last_error() -> str:
    """kvp_last_error: this thread's message of its last failed call."""
    return _lib.last_error()


def bf16_to_f32(a):
    """numpy: bf16 bit patterns (uint16) to float32."""
    import numpy as np
    return (np.asarray(a, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(a):
    """numpy: float32 to bf16 bit patterns (uint16), rounding to nearest even (NaN stays NaN)."""
    import numpy as np
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(a, np.float32))
    return np.where(nan, np.uint16(0x7FC0), r)


__all__ = ["Pool", "PoolView", "Store", "BlockInfo", "Error", "InvalidError", "NoMemoryError", "BudgetError",
           "RegionFullError", "NotFoundError", "ExistsError", "DeviceError", "CodecError", "FormatError",
           "BusyError", "CorruptError", "NotSupportedError", "StoreIOError", "library_path", "metadata_allocator", "strerror", "last_error",
           "bf16_to_f32", "f32_to_bf16"]
