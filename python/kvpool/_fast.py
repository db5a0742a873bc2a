"""The per-step calls through cffi (ABI mode, no compile step) when it is installed.

A ctypes call costs about twice a cffi one, and getting a numpy array's address
through ctypes (``from_buffer`` + ``addressof``) more than ``ffi.from_buffer``;
on a decode step that is most of the binding's overhead. So kvp_step_begin,
kvp_append, kvp_step_end and kvp_read go through cffi when ``import cffi``
works (Debian: python3-cffi), on the same loaded library (dlopen of the same
path returns the same handle), and through ctypes otherwise. Everything else
stays on ctypes. ``KVPOOL_NO_CFFI=1`` in the environment turns this off.
"""

from __future__ import annotations

import os

from . import _lib

CDEF = """
typedef struct { const void *k, *v; void *stream; } kvp_kv;
typedef struct {
  size_t struct_size; uint32_t head; int out_dtype; void *k_out, *v_out; void *positions_out; /* uint32_t * */
  uint32_t capacity_tokens; uint32_t n_tokens; void *stream;
} kvp_read_req;
int kvp_step_begin(void *pool, uint64_t seq, uint32_t n_tokens, uint32_t flags);
int kvp_append(void *pool, uint64_t seq, uint32_t layer, const kvp_kv *kv);
int kvp_step_end(void *pool, uint64_t seq);
int kvp_read(void *pool, uint64_t seq, uint32_t layer, kvp_read_req *req);
"""

ffi = None
C = None
if not os.environ.get("KVPOOL_NO_CFFI"):
    try:
        import cffi

        _ffi = cffi.FFI()
        _ffi.cdef(CDEF)
        C = _ffi.dlopen(_lib.path)
        ffi = _ffi
        if (ffi.sizeof("kvp_kv") != __import__("ctypes").sizeof(_lib.KV)
                or ffi.sizeof("kvp_read_req") != __import__("ctypes").sizeof(_lib.ReadReq)):
            ffi = C = None  # a layout disagreement: stay on ctypes, whose layout the tests check
    except Exception:  # no cffi, or it cannot load the library: ctypes does everything
        ffi = C = None

#: "cffi" when the per-step calls go through cffi, else "ctypes"
backend = "cffi" if ffi is not None else "ctypes"
