"""kvpool.Pool: one pool of the C library, as a Python object.

The methods map one to one onto include/kvpool.h (``add`` is kvp_seq_add,
``append`` is kvp_append, ...); where C takes a struct, Python takes keyword
arguments with the C defaults, and where C writes into caller buffers,
Python returns arrays. A failed call raises the exception class of its
status with kvp_last_error()'s message, and leaves the pool as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import threading
from ctypes import byref, c_size_t, c_uint32, c_void_p
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import _arrays, _fast, _lib
from ._arrays import np
from .errors import InvalidError, RegionFullError, error_for

lib = _lib.lib
_ENOSPC = -4
_ffi, _C = _fast.ffi, _fast.C
_ndarray = np.ndarray if np is not None else type(None)
_get_ident = threading.get_ident
_READ_REQ_BYTES = ctypes.sizeof(_lib.ReadReq)
_U32 = np.dtype(np.uint32) if np is not None else None
_NP_CODE = _arrays.NP_CODE
_np_empty = np.empty if np is not None else None
_c_char_from_buffer, _addressof = ctypes.c_char.from_buffer, ctypes.addressof
if _ffi is not None:  # parsed once: a type given as a string is parsed on every call
    _REQ_T = _ffi.typeof("kvp_read_req *")
    # the per-step calls, bound once (an attribute lookup on the library object per call otherwise)
    _from_buffer, _NULL = _ffi.from_buffer, _ffi.NULL
    _c_step_begin, _c_append, _c_step_end, _c_read = _C.kvp_step_begin, _C.kvp_append, _C.kvp_step_end, _C.kvp_read
_BUF_ERRORS = (ValueError, TypeError, BufferError)  # what from_buffer raises for an array C cannot take

DIMS = {"page_type": _lib.DIM_PAGE_TYPE, "kv": _lib.DIM_KV, "layer": _lib.DIM_LAYER, "head": _lib.DIM_HEAD,
        "codec": _lib.DIM_CODEC, "seq": _lib.DIM_SEQ}


def _usage(u: _lib.Usage) -> Dict[str, int]:
    return {"requested_bytes": u.requested_bytes, "allocated_bytes": u.allocated_bytes, "pages": u.npages}


@dataclass
class BlockInfo:
    """One retained token range of one block, as a view describes it (kvp_view_block).

    Attributes:
        head: KV head.
        pos0: position of the block's token 0.
        first: first retained token (index within the block); positions pos0+first ... +n_tokens-1.
        n_tokens: retained tokens from ``first`` on.
        cap_tokens: the block's capacity in tokens.
        codecs: spec names of the codecs of its K and V pages, e.g. ("int8", "int8").
        pages: {(side, page type): (address, requested bytes)} for the pages the block has,
            side "k" or "v", page type "raw", "codes", "scales", "centroids", "assign", "outliers", "meta".
            Addresses are in the pool's memory (host or device) and valid while the view is held.
    """
    head: int
    pos0: int
    first: int
    n_tokens: int
    cap_tokens: int
    codecs: Tuple[Optional[str], Optional[str]]
    pages: Dict[Tuple[str, str], Tuple[int, int]] = field(default_factory=dict)

    @property
    def positions(self) -> range:
        """The positions of the retained tokens of this range."""
        return range(self.pos0 + self.first, self.pos0 + self.first + self.n_tokens)


class PoolView:
    """Pinned blocks of one (sequence, layer) (kvp_view_acquire), for kernels that read pages
    directly. Use as a context manager; the blocks stay valid (even if evicted meanwhile) until
    :meth:`release`.

    Attributes:
        seq, layer: what is viewed.
        blocks: list of :class:`BlockInfo`, by head, then position.
    """

    def __init__(self, pool: "Pool", seq: int, layer: int):
        self._pool = pool
        ptr = ctypes.POINTER(_lib.View)()
        pool._call(lib.kvp_view_acquire, "kvp_view_acquire", pool._handle(), seq, layer, byref(ptr))
        self._ptr = ptr
        v = ptr.contents
        self.seq, self.layer = v.seq, v.layer
        self.blocks: List[BlockInfo] = []
        names: Dict[int, Optional[str]] = {}
        for i in range(v.n_blocks):
            b = v.blocks[i]
            for cid in b.codec:
                if cid not in names:
                    names[cid] = _lib.codec_name(cid)
            pages = {}
            for s, side in enumerate("kv"):
                for t, tname in enumerate(_lib.PAGE_TYPES):
                    addr = b.page[s][t]
                    if addr:
                        pages[(side, tname)] = (addr, b.page_bytes[s][t])
            self.blocks.append(BlockInfo(b.head, b.block_pos0, b.first, b.n_tokens, b.cap_tokens,
                                         (names[b.codec[0]], names[b.codec[1]]), pages))

    def page_bytes(self, block: int, side: str, page_type: str) -> bytes:
        """A copy of one page's requested bytes (host pools only), while the view is held."""
        if self._ptr is None:
            raise InvalidError("the view was released", "PoolView.page_bytes")
        if self._pool._cuda:
            raise InvalidError("page_bytes reads host memory; this pool's pages are on the device",
                               "PoolView.page_bytes")
        addr, n = self.blocks[block].pages[(side, page_type)]
        return ctypes.string_at(addr, n)

    def release(self) -> None:
        """Unpin the blocks (kvp_view_release). Idempotent."""
        if self._ptr is not None and self._pool._h is not None:
            lib.kvp_view_release(self._pool._h, self._ptr)
        self._ptr = None

    def __enter__(self) -> "PoolView":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"PoolView(seq={self.seq}, layer={self.layer}, blocks={len(self.blocks)})"


class Pool:
    """A kvpool pool: a reserved region (host or CUDA), a strict byte budget, codecs and an
    eviction policy, holding the KV cache of many sequences.

    Use it as a context manager (or call :meth:`close`)::

        import numpy as np, kvpool
        with kvpool.Pool(layers=2, kv_heads=2, head_dim=64, k_dtype="fp16", v_dtype="fp16",
                         codecs="kv=int8", region_bytes=64 << 20, budget_bytes=32 << 20) as pool:
            pool.add(1)                              # a sequence, stream mode
            pool.step_begin(1, 16)                   # a step of 16 tokens
            for layer in range(2):
                pool.append(1, layer, k, v)          # numpy [16][2][64] float16
            pool.step_end(1)
            k1, v1, pos = pool.read(1, 0, head=1)    # [n][64] arrays and the positions
            pool.stats()["bytes.allocated"]["current"]
            pool.check()

    Arguments (the fields of kvp_config, with its defaults):
        layers: transformer layers (n_layers).
        kv_heads: KV heads per layer (n_kv_heads).
        head_dim: elements per head.
        k_dtype, v_dtype: dtype of appended K and V: "bf16", "fp16" or "f32" (or a numpy/torch dtype).
        memory: "host", or "cuda" for a region in one cudaMalloc on ``device`` ("cuda:N" sets it too).
        device: CUDA ordinal.
        region_bytes: bytes reserved at create.
        budget_bytes: strict cap on allocated page bytes; 0 = the region. ``budget`` is an alias.
        block_tokens: tokens per block; 0 = chosen per layer by its codecs (:meth:`layer_info` says what).
        codecs: codec spec, e.g. "kv=int8", "k=bf16,v=fp8;layers=24-31:k=fp8"; None = raw.
        policy: eviction policy spec, e.g. "window:sink=4:recent=1024"; None = none.
        prefault, sanitize, dry, allow_expansion: the KVP_POOL_PREFAULT / SANITIZE / DRY / ALLOW_EXPANSION
            flags (allow_expansion: accept a codec that stores more than the appended dtype).
        device_async: KVP_POOL_DEVICE_ASYNC: a CUDA pool's appends of raw, fp8, int8 and nvfp4 layers
            return without waiting for their stream (non-finite K/V is then not refused).

    Arrays: K and V of a step are ``[n_tokens, kv_heads, head_dim]``, C-contiguous, in the pool's
    dtypes: numpy arrays on a host pool (bf16 as ``uint16`` bit patterns, or ``ml_dtypes.bfloat16``),
    torch tensors on a host pool (CPU tensors) or a CUDA pool (tensors on its device; the copies are
    ordered on ``torch.cuda.current_stream()``). The binding checks shape, dtype, contiguity and
    device before each call.

    Threads: one thread mutates the pool at a time (add, append, evict, ...: the library's writer
    lock serializes them); :meth:`read`, :meth:`view`, :meth:`stats` and :meth:`seq_info` are
    lock-free and may run on other threads beside the writer. The library releases the GIL during
    every call. Do not close the pool while another thread uses it.

    Errors: every failure raises a subclass of :class:`kvpool.Error` (``BudgetError`` for
    KVP_EBUDGET, ...) whose message is kvp_last_error(); the pool is then exactly as before.
    """

    def __init__(self, layers: int = 1, kv_heads: int = 1, head_dim: int = 128, k_dtype: Any = "bf16",
                 v_dtype: Any = "bf16", memory: str = "host", device: int = 0, region_bytes: int = 64 << 20,
                 budget_bytes: int = 0, block_tokens: int = 0, codecs: Optional[str] = None,
                 policy: Optional[str] = None, *, budget: Optional[int] = None, prefault: bool = False,
                 sanitize: bool = False, dry: bool = False, allow_expansion: bool = False,
                 device_async: bool = False):
        self._h: Optional[int] = None
        call = "kvpool.Pool"
        if budget is not None:
            if budget_bytes:
                raise InvalidError("give budget_bytes or budget (an alias), not both", call)
            budget_bytes = budget
        if isinstance(memory, str) and memory.startswith("cuda:"):
            memory, device = "cuda", _int(memory[5:], "memory", call)
        if memory not in ("host", "cuda"):
            raise InvalidError(f"memory={memory!r}: 'host' or 'cuda'", call)
        c = _lib.Config()
        lib.kvp_config_init(byref(c))
        c.n_layers = _int(layers, "layers", call)
        c.n_kv_heads = _int(kv_heads, "kv_heads", call)
        c.head_dim = _int(head_dim, "head_dim", call)
        c.k_dtype = _arrays.dtype_code(k_dtype, "k_dtype")
        c.v_dtype = _arrays.dtype_code(v_dtype, "v_dtype")
        c.memory = _lib.MEM_CUDA if memory == "cuda" else _lib.MEM_HOST
        c.device = _int(device, "device", call)
        c.region_bytes = _int(region_bytes, "region_bytes", call)
        c.budget_bytes = _int(budget_bytes, "budget_bytes", call)
        c.block_tokens = _int(block_tokens, "block_tokens", call)
        self._codecs = codecs.encode() if codecs is not None else None  # kept alive for the call
        self._policy = policy.encode() if policy is not None else None
        c.codecs = self._codecs
        c.policy = self._policy
        c.flags = ((_lib.POOL_PREFAULT if prefault else 0) | (_lib.POOL_SANITIZE if sanitize else 0)
                   | (_lib.POOL_DRY if dry else 0) | (_lib.POOL_ALLOW_EXPANSION if allow_expansion else 0)
                   | (_lib.POOL_DEVICE_ASYNC if device_async else 0))
        h = c_void_p()
        rc = lib.kvp_pool_create(byref(c), byref(h))
        if rc:
            raise error_for(rc, "kvp_pool_create")
        self._h = h.value
        self._cfg = c
        self._cuda = c.memory == _lib.MEM_CUDA
        self._dry = dry
        self._in = _arrays.Input(c.k_dtype, c.v_dtype, self._cuda, c.device, c.n_kv_heads, c.head_dim)
        self._open: Dict[int, int] = {}  # seq -> tokens of its open step
        # seq -> (n, kv_heads, head_dim) of its open step, on a host pool with numpy: the shape
        # the fast append compares its arrays with (one tuple per step, not one per call)
        self._want: Dict[int, Tuple[int, int, int]] = {}
        self._host_np = not self._cuda and np is not None
        self._npos: Dict[int, int] = {}  # seq -> positions used (tokens appended), a read capacity hint
        self._owner = _get_ident()  # the thread that reuses one kvp_kv (ctypes) and one kvp_read_req (cffi)
        self._kv = _lib.KV()
        self._kv_ref = byref(self._kv)
        H, D = c.n_kv_heads, c.head_dim
        self._hd = (H, D)
        self._knp = self._in.k_np
        self._vnp = self._in.v_np
        self._D = D
        if np is not None:  # read()'s default output: kvp_dtype and numpy dtype
            code = self._out_code(None)
            self._read_default = (code, _arrays.numpy_dtype(code))
        self._fh = _ffi.cast("void *", self._h) if _ffi is not None else None
        self._freq = None  # the owner thread's kvp_read_req for the fast read_into (cffi)
        if _ffi is not None:
            self._freq = _ffi.new(_REQ_T)
            self._freq.struct_size = _READ_REQ_BYTES
        self._ws = None  # device scratch of the table-building calls (_workspace)
        self._areq = _lib.AttendReq()  # the creator thread's kvp_attend_req (_attend_ptrs)
        lib.kvp_attend_req_init(byref(self._areq))
        self._areq_ref = byref(self._areq)
        self._rq = _lib.ReadReq()  # the creator thread's ctypes kvp_read_req (read_into, _read_ptrs)
        self._rq.struct_size = _READ_REQ_BYTES
        self._rq_ref = byref(self._rq)
        self._stats_cap = 1 << 16

    # ---- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the pool (kvp_pool_destroy) and its region. Idempotent. No other thread may
        use the pool meanwhile or afterwards."""
        if self._h is not None:
            self._fh = None
            self._want.clear()
            lib.kvp_pool_destroy(self._h)
            self._h = None

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._h is None

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if self._h is None:
            return "Pool(closed)"
        c = self._cfg
        return (f"Pool(layers={c.n_layers}, kv_heads={c.n_kv_heads}, head_dim={c.head_dim}, "
                f"k_dtype={_arrays.DTYPE_STR[c.k_dtype]!r}, v_dtype={_arrays.DTYPE_STR[c.v_dtype]!r}, "
                f"memory={self.memory!r}, codecs={self.codecs!r}, policy={self.policy!r})")

    # ---- geometry -------------------------------------------------------------------------------

    @property
    def layers(self) -> int:
        """Layers of the pool."""
        return self._cfg.n_layers

    @property
    def kv_heads(self) -> int:
        """KV heads per layer."""
        return self._cfg.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Elements per head."""
        return self._cfg.head_dim

    @property
    def k_dtype(self) -> str:
        """dtype of appended K: "f32", "bf16" or "f16"."""
        return _arrays.DTYPE_STR[self._cfg.k_dtype]

    @property
    def v_dtype(self) -> str:
        """dtype of appended V."""
        return _arrays.DTYPE_STR[self._cfg.v_dtype]

    @property
    def memory(self) -> str:
        """"host" or "cuda"."""
        return "cuda" if self._cuda else "host"

    @property
    def device(self) -> int:
        """CUDA ordinal of a CUDA region."""
        return self._cfg.device

    @property
    def codecs(self) -> Optional[str]:
        """The codec spec the pool was created with (None = raw)."""
        return self._codecs.decode() if self._codecs is not None else None

    @property
    def policy(self) -> Optional[str]:
        """The policy spec the pool was created with (None = none)."""
        return self._policy.decode() if self._policy is not None else None

    @property
    def sequences(self) -> List[int]:
        """Ids of the live sequences added through this object."""
        return list(self._npos)

    # ---- plumbing -------------------------------------------------------------------------------

    def _handle(self) -> int:
        h = self._h
        if h is None:
            raise InvalidError("the pool is closed", "kvpool.Pool")
        return h

    @staticmethod
    def _call(fn, name: str, *args) -> None:
        rc = fn(*args)
        if rc:
            raise error_for(rc, name)

    # ---- sequences and steps --------------------------------------------------------------------

    def add(self, seq: int, mode: Optional[str] = None, step_tokens: Optional[Sequence[int]] = None,
            budget_fraction: float = 0.0, policy: Optional[str] = None,
            tokens: Optional[Sequence[int]] = None) -> None:
        """Add a sequence with the caller's 64-bit id (kvp_seq_add).

        Args:
            seq: any 64-bit id not live in the pool (ExistsError otherwise).
            mode: "stream" (blocks fill across steps; the default) or "step" (blocks never
                straddle a step, so evicting a step frees its bytes exactly). Default: "step"
                when ``step_tokens`` is given, else "stream".
            step_tokens: the planned tokens of each step, when known (VAR scales); step_begin
                must then follow it.
            budget_fraction: per-sequence policy budget (0 = none).
            policy: a policy spec for this sequence (None = the pool's).
            tokens: the prompt's token ids, for prefix sharing: chunks of the prompt that the
                pool already holds are attached at once (:meth:`seq_info` ``n_positions`` says
                how many tokens), and :meth:`prefix_fetch` attaches more from a store.
        """
        call = "kvp_seq_add"
        if mode is None:
            mode = "step" if step_tokens else "stream"
        if mode not in ("stream", "step"):
            raise InvalidError(f"mode={mode!r}: 'stream' or 'step'", call)
        sc = _lib.SeqConfig()
        lib.kvp_seq_config_init(byref(sc))
        sc.mode = _lib.SEQ_STEP if mode == "step" else _lib.SEQ_STREAM
        arr = None
        if step_tokens is not None:
            steps = [_int(t, "step_tokens", call) for t in step_tokens]
            arr = (c_uint32 * max(len(steps), 1))(*steps)
            sc.step_tokens = ctypes.cast(arr, ctypes.POINTER(c_uint32))
            sc.n_steps = len(steps)
        sc.budget_fraction = float(budget_fraction)
        pol = policy.encode() if policy is not None else None
        sc.policy = pol
        toks = None
        if tokens is not None:
            ids = [_int(t, "tokens", call) for t in tokens]
            if any(t > 0xFFFFFFFF for t in ids):
                raise InvalidError("tokens: every id must fit 32 bits", call)
            toks = (c_uint32 * max(len(ids), 1))(*ids)
            sc.tokens = ctypes.cast(toks, ctypes.POINTER(c_uint32))
            sc.n_tokens = len(ids)
        self._call(lib.kvp_seq_add, call, self._handle(), _seq(seq), byref(sc))
        self._npos[seq] = self._positions(seq) if tokens else 0

    def _positions(self, seq: int) -> int:
        d = _lib.SeqDesc()
        d.struct_size = ctypes.sizeof(d)
        self._call(lib.kvp_seq_info, "kvp_seq_info", self._handle(), _seq(seq), byref(d))
        return d.n_positions

    # ---- the store tier -------------------------------------------------------------------------

    def offload(self, seq: int, store: "Store") -> None:
        """Write ``seq`` to ``store`` and free it from the pool (kvp_seq_offload); it no longer
        exists here until :meth:`restore`. On failure nothing is freed. Not inside a step
        (BusyError); NotSupportedError for dry pools, policies and row-wise codecs."""
        self._call(lib.kvp_seq_offload, "kvp_seq_offload", self._handle(), _seq(seq), _store(store))
        self._npos.pop(seq, None)
        self._open.pop(seq, None)
        self._want.pop(seq, None)

    def restore(self, seq: int, store: "Store") -> None:
        """Bring an offloaded sequence back under the same id, all or nothing (kvp_seq_restore).
        NotFoundError when the store lacks it, FormatError for a blob of another geometry, codec
        spec or version, or a damaged one."""
        self._call(lib.kvp_seq_restore, "kvp_seq_restore", self._handle(), _seq(seq), _store(store))
        self._npos[seq] = self._positions(seq)

    def prefix_publish(self, seq: int, store: "Store") -> int:
        """Write ``seq``'s prompt chunks that the pool holds to ``store`` under their content keys
        (kvp_prefix_publish); returns the prompt tokens the store now holds. The pool is not
        changed."""
        n = c_uint32()
        self._call(lib.kvp_prefix_publish, "kvp_prefix_publish", self._handle(), _seq(seq), _store(store),
                   byref(n))
        return n.value

    def prefix_fetch(self, seq: int, store: "Store") -> int:
        """Attach the next chunks of ``seq``'s prompt from ``store`` as one step, right after
        :meth:`add` with ``tokens`` (kvp_prefix_fetch); returns the tokens attached (0: the store
        has none of them)."""
        n = c_uint32()
        self._call(lib.kvp_prefix_fetch, "kvp_prefix_fetch", self._handle(), _seq(seq), _store(store), byref(n))
        self._npos[seq] = self._positions(seq)
        return n.value

    def free(self, seq: int) -> None:
        """Free a sequence and every page only it holds (kvp_seq_free); allowed inside a step
        (the step is dropped)."""
        self._call(lib.kvp_seq_free, "kvp_seq_free", self._handle(), _seq(seq))
        self._npos.pop(seq, None)
        self._open.pop(seq, None)
        self._want.pop(seq, None)

    def fork(self, parent: int, child: int) -> None:
        """Fork ``parent`` into a new sequence ``child`` (kvp_seq_fork): sealed blocks are shared,
        open blocks copied. Not inside a step of the parent (BusyError); all or nothing."""
        self._call(lib.kvp_seq_fork, "kvp_seq_fork", self._handle(), _seq(parent), _seq(child))
        self._npos[child] = self._npos.get(parent, 0)

    def step_begin(self, seq: int, n_tokens: int, flags: int = 0, *, scene_cut: bool = False) -> None:
        """Begin a step of ``n_tokens`` for ``seq`` (kvp_step_begin). ``scene_cut=True`` sets
        KVP_STEP_SCENE_CUT (the multishot policy re-binds its shot sink)."""
        if scene_cut:
            flags |= _lib.STEP_SCENE_CUT
        fh = self._fh
        if fh is not None:
            rc = _c_step_begin(fh, seq, n_tokens, flags)
        else:
            rc = lib.kvp_step_begin(self._handle(), seq, n_tokens, flags)
        if rc:
            raise error_for(rc, "kvp_step_begin")
        self._open[seq] = n_tokens
        self._npos[seq] = self._npos.get(seq, 0) + n_tokens
        if self._host_np:
            self._want[seq] = (n_tokens, *self._hd)

    def step_end(self, seq: int) -> None:
        """End the open step of ``seq`` (kvp_step_end); every layer must have been appended."""
        fh = self._fh
        if fh is not None:
            rc = _c_step_end(fh, seq)
        else:
            rc = lib.kvp_step_end(self._handle(), seq)
        if rc:
            raise error_for(rc, "kvp_step_end")
        self._open.pop(seq, None)
        self._want.pop(seq, None)

    @contextlib.contextmanager
    def step(self, seq: int, n_tokens: int, flags: int = 0, *, scene_cut: bool = False) -> Iterator["Pool"]:
        """A step as a context manager: step_begin, then the body's appends, then step_end.
        If the body raises, the step stays open (a failed layer may be appended again) and the
        exception propagates::

            with pool.step(seq, 1):
                for layer in range(pool.layers):
                    pool.append(seq, layer, k[layer], v[layer])
        """
        self.step_begin(seq, n_tokens, flags, scene_cut=scene_cut)
        yield self
        self.step_end(seq)

    def append(self, seq: int, layer: int, k: Any, v: Any) -> None:
        """Append one layer's K and V for the open step (kvp_append).

        ``k`` and ``v`` are ``[n_tokens, kv_heads, head_dim]`` arrays of the step's n tokens, in the
        pool's dtypes and memory (see the class doc). Layers come in order 0..layers-1, each once.
        All or nothing: on failure (BudgetError, RegionFullError, InvalidError for NaN input, ...)
        the pool is as before and the same layer may be appended again.
        """
        # fast path: host numpy arrays of the step's shape and the pool's dtypes (a decode step).
        # Cost with cffi (python 3.11): about 1 us over the C call, mostly the two from_buffer
        # and the call itself; C-contiguity is checked by from_buffer (numpy refuses a plain
        # buffer of a strided array), and such arrays take the checked path, which says why.
        want = self._want.get(seq)
        if (want is not None and type(k) is _ndarray and type(v) is _ndarray and k.shape == want
                and v.shape == want and k.dtype in self._knp and v.dtype in self._vnp):
            fh = self._fh
            if fh is not None:
                try:  # a one-element array of kvp_kv: cffi builds it for the call (no shared struct)
                    kv = [(_from_buffer(k), _from_buffer(v), _NULL)]
                except _BUF_ERRORS:
                    kv = None
                if kv is not None:
                    rc = _c_append(fh, seq, layer, kv)
                    if rc:
                        raise error_for(rc, "kvp_append")
                    return
            elif k.flags.c_contiguous and v.flags.c_contiguous:
                kv = self._kv if _get_ident() == self._owner else _lib.KV()
                kv.k = _arrays.numpy_ptr(k)
                kv.v = _arrays.numpy_ptr(v)
                rc = lib.kvp_append(self._h, seq, layer, byref(kv))
                if rc:
                    raise error_for(rc, "kvp_append")
                return
        self._append_checked(seq, layer, k, v, self._open.get(seq))

    def _append_ptrs(self, seq: int, layer: int, k_ptr: int, v_ptr: int, stream: Optional[int]) -> None:
        """kvp_append from addresses whose arrays the caller has checked (kvpool.hf: contiguous
        ``[n, kv_heads, head_dim]`` tensors of the pool's dtypes, in the pool's memory, n the step's
        tokens; ``stream`` the CUDA stream of a CUDA pool). Through ctypes with the creator
        thread's kvp_kv (an integer is no cffi pointer): about 1.5 us, against about 10 for append
        with a CUDA tensor."""
        if self._h is None:
            raise InvalidError("the pool is closed", "kvpool.Pool")
        if _get_ident() == self._owner:
            kv, ref = self._kv, self._kv_ref
        else:
            kv = _lib.KV()
            ref = byref(kv)
        kv.k, kv.v, kv.stream = k_ptr, v_ptr, stream
        rc = lib.kvp_append(self._h, seq, layer, ref)
        if rc:
            raise error_for(rc, "kvp_append")

    def _read_ptrs(self, seq: int, layer: int, head: int, code: int, cap: int, k_ptr: int, v_ptr: int,
                   stream: Optional[int]) -> int:
        """kvp_read of one head into addresses the caller has checked (kvpool.hf: rows of
        contiguous ``[cap, head_dim]`` tensors of kvp_dtype ``code`` in the pool's memory), no
        positions: the tokens read. Through ctypes with the creator thread's kvp_read_req."""
        if self._h is None:
            raise InvalidError("the pool is closed", "kvpool.Pool")
        if _get_ident() == self._owner:
            req, ref = self._rq, self._rq_ref
        else:
            req = _lib.ReadReq()
            req.struct_size = _READ_REQ_BYTES
            ref = byref(req)
        req.head, req.out_dtype, req.capacity_tokens = head, code, cap
        req.k_out, req.v_out, req.positions_out, req.stream = k_ptr, v_ptr, None, stream
        rc = lib.kvp_read(self._h, seq, layer, ref)
        if rc:
            e = error_for(rc, "kvp_read")
            e.needed = req.n_tokens
            raise e
        return req.n_tokens

    def _append_checked(self, seq: int, layer: int, k: Any, v: Any, n: Optional[int]) -> None:
        """append for everything but the fast path: torch tensors, and the checks that name
        what is wrong."""
        h = self._handle()
        kv = _lib.KV()
        if n is not None:
            inp = self._in
            kv.k, stream = inp.pointer(k, n, "k", "kvp_append")
            kv.v, _ = inp.pointer(v, n, "v", "kvp_append")
            kv.stream = stream
        # else: no open step here; the library says why (unknown sequence, outside a step)
        rc = lib.kvp_append(h, seq, layer, byref(kv))
        if rc:
            raise error_for(rc, "kvp_append")

    def extend(self, seq: int, k: Any, v: Any, flags: int = 0) -> None:
        """One whole step: step_begin, append of every layer, step_end. ``k`` and ``v`` are
        ``[layers, n_tokens, kv_heads, head_dim]`` (or sequences of per-layer arrays). If an
        append fails the step stays open and the exception propagates."""
        if len(k) != self.layers or len(v) != self.layers:
            raise InvalidError(f"extend: {len(k)} K and {len(v)} V layers for a pool of {self.layers}",
                               "kvpool.Pool.extend")
        n = k[0].shape[0]
        self.step_begin(seq, n, flags)
        for layer in range(self.layers):
            self.append(seq, layer, k[layer], v[layer])
        self.step_end(seq)

    def evict(self, seq: int, layer: int, head: int, step: int) -> None:
        """Evict the tokens of one step from one (layer, head) (kvp_evict). NotFoundError if that
        unit is not retained."""
        self._call(lib.kvp_evict, "kvp_evict", self._handle(), _seq(seq), layer, head, step)

    def reclaim(self) -> None:
        """Return retired blocks to the allocator after an RCU grace period (kvp_reclaim)."""
        self._call(lib.kvp_reclaim, "kvp_reclaim", self._handle())

    # ---- reading --------------------------------------------------------------------------------

    def _out_code(self, dtype: Any) -> int:
        if dtype is not None:
            return _arrays.dtype_code(dtype, "dtype")
        c = self._cfg
        return c.k_dtype if c.k_dtype == c.v_dtype else _lib.DTYPE_F32

    def read(self, seq: int, layer: int, head: int, *, dtype: Any = None, k: bool = True, v: bool = True,
             as_torch: bool = False) -> Tuple[Any, Any, Any]:
        """Read (dequantize) the retained tokens of one head of (seq, layer), in position order
        (kvp_read). Lock-free: may run on any thread beside the writer.

        Returns ``(k, v, positions)``: ``[n, head_dim]`` arrays (None for a side not asked with
        ``k=False``/``v=False``) and the ``[n]`` token positions. Host pools return numpy arrays
        (``as_torch=True``: CPU torch tensors); CUDA pools return torch tensors on the pool's device
        (read on the current stream) with CPU positions (int64 tensors with torch). ``dtype``:
        "f32", "bf16" or "f16" (default: the pool's dtype when K and V share it, else f32; numpy
        bf16 is ``uint16`` bit patterns unless ``ml_dtypes`` is installed). A CUDA pool returns its
        stored dtype only.
        """
        fh = self._fh
        if dtype is None and k and v and not as_torch and fh is not None and self._host_np:
            # fast path (cffi, numpy, the default dtype): buffers sized by the positions the
            # sequence used (fresh, so contiguous and writable: no check), one kvp_read; what it
            # returns is those buffers when nothing was evicted, else their first n rows
            code, ndt = self._read_default
            cap = self._npos.get(seq, 0) or 16
            shape = (cap, self._D)
            kb, vb, pb = _np_empty(shape, ndt), _np_empty(shape, ndt), _np_empty(cap, _U32)
            req = self._freq if _get_ident() == self._owner else _ffi.new(_REQ_T, [_READ_REQ_BYTES])
            req.k_out = _from_buffer(kb)
            req.v_out = _from_buffer(vb)
            req.positions_out = _from_buffer(pb)
            req.head = head
            req.out_dtype = code
            req.capacity_tokens = cap
            rc = _c_read(fh, seq, layer, req)
            if rc == 0:
                n = req.n_tokens
                if n == cap:
                    return kb, vb, pb
                if 64 < n < cap // 2:  # a small result does not keep a large buffer alive
                    return kb[:n].copy(), vb[:n].copy(), pb[:n]
                return kb[:n], vb[:n], pb[:n]
            if rc != _ENOSPC:
                e = error_for(rc, "kvp_read")
                e.needed = req.n_tokens
                raise e
            # the writer appended meanwhile: the loop below grows the buffers
        code = self._out_code(dtype)
        use_torch = as_torch or self._cuda
        cap = self._npos.get(seq, 0) or 16
        D = self._cfg.head_dim
        if use_torch:
            torch = _arrays.torch_module()
            if torch is None:
                raise InvalidError("this read returns torch tensors and torch is not installed", "kvp_read")
            dev = torch.device("cuda", self._cfg.device) if self._cuda else torch.device("cpu")
            tdt = _arrays.torch_dtype(code)
        elif np is None:
            raise InvalidError("numpy is not installed (as_torch=True returns torch tensors)", "kvp_read")
        else:
            ndt = _arrays.numpy_dtype(code)
        fast = k and v and not use_torch and self._fh is not None
        for _ in range(8):
            if use_torch:
                kb = torch.empty((cap, D), dtype=tdt, device=dev) if k else None
                vb = torch.empty((cap, D), dtype=tdt, device=dev) if v else None
                pb = torch.empty((cap,), dtype=torch.int32)
            else:
                kb = np.empty((cap, D), ndt) if k else None
                vb = np.empty((cap, D), ndt) if v else None
                pb = np.empty((cap,), np.uint32)
            try:
                if fast:  # buffers made here: no need to check them again
                    n = self._read_fast(self._fh, seq, layer, head, code, cap, kb, vb, pb)
                else:
                    n = self.read_into(seq, layer, head, kb, vb, pb)
            except RegionFullError as e:
                cap = max(e.needed, cap) + 16  # the writer appended meanwhile
                continue
            if n == cap and not use_torch:  # nothing evicted: the buffers are the result
                return kb, vb, pb
            if n < cap // 2 and n > 64:  # do not keep a large buffer alive behind a small result
                kb = kb[:n].clone() if use_torch and k else kb[:n].copy() if k else None
                vb = vb[:n].clone() if use_torch and v else vb[:n].copy() if v else None
            pos = pb[:n].to(torch.int64) if use_torch else pb[:n]
            return (kb[:n] if k else None, vb[:n] if v else None, pos)
        raise RegionFullError("the sequence kept growing while it was read", "kvp_read")

    def read_into(self, seq: int, layer: int, head: int, k_out: Any, v_out: Any,
                  positions_out: Any = None) -> int:
        """Read one head into caller buffers (kvp_read without allocation): ``k_out`` and
        ``v_out`` are ``[capacity, head_dim]`` C-contiguous arrays of one dtype (either may be
        None), in the pool's memory (numpy or CPU torch for a host pool, torch on the pool's
        device for a CUDA pool); ``positions_out`` an optional ``[capacity]`` uint32 numpy array
        or int32 CPU torch tensor. Returns the tokens written; RegionFullError (with ``.needed``)
        if the buffers are too small, and nothing is written then."""
        if type(k_out) is _ndarray and type(v_out) is _ndarray and type(positions_out) is _ndarray and self._host_np:
            # fast path: numpy K, V and positions buffers as a decode loop passes them (K and V of
            # one shape and dtype), the creator thread's kvp_read_req reused. With cffi about
            # 1 us over the C call: the checks below, three from_buffer (which refuse strided and
            # read-only arrays: those, and every other case, take the checked path, which says
            # what is wrong) and the call; ctypes takes about 0.7 us more.
            ks, kd = k_out.shape, k_out.dtype
            if (v_out.shape == ks and len(ks) == 2 and ks[1] == self._D and v_out.dtype is kd and kd in _NP_CODE
                    and positions_out.dtype is _U32 and positions_out.ndim == 1):
                cap = ks[0]
                if positions_out.shape[0] < cap:
                    cap = positions_out.shape[0]
                owner = _get_ident() == self._owner
                fh = self._fh
                try:
                    if fh is not None:
                        req = self._freq if owner else _ffi.new(_REQ_T, [_READ_REQ_BYTES])
                        req.k_out = _from_buffer(k_out, require_writable=True)
                        req.v_out = _from_buffer(v_out, require_writable=True)
                        req.positions_out = _from_buffer(positions_out, require_writable=True)
                    else:
                        if owner:
                            req, ref = self._rq, self._rq_ref
                        else:
                            req = _lib.ReadReq()
                            req.struct_size = _READ_REQ_BYTES
                            ref = byref(req)
                        req.k_out = _addressof(_c_char_from_buffer(k_out))
                        req.v_out = _addressof(_c_char_from_buffer(v_out))
                        req.positions_out = _addressof(_c_char_from_buffer(positions_out))
                    ok = True
                except _BUF_ERRORS:
                    ok = False
                if ok:
                    req.head = head
                    req.out_dtype = _NP_CODE[kd]
                    req.capacity_tokens = cap
                    if fh is not None:
                        rc = _c_read(fh, seq, layer, req)
                    elif self._h is not None:
                        req.stream = None
                        rc = lib.kvp_read(self._h, seq, layer, ref)
                    else:
                        raise InvalidError("the pool is closed", "kvpool.Pool")
                    if rc:
                        e = error_for(rc, "kvp_read")
                        e.needed = req.n_tokens
                        raise e
                    return req.n_tokens
        if (not self._cuda and type(positions_out) in (_ndarray, type(None))
                and type(k_out) in (_ndarray, type(None)) and type(v_out) in (_ndarray, type(None))):
            return self._read_numpy(seq, layer, head, k_out, v_out, positions_out)
        call = "kvp_read"
        outs = [x for x in (k_out, v_out) if x is not None]
        if not outs:
            raise InvalidError("read_into: k_out and v_out are both None", call)
        D = self._cfg.head_dim
        req = _lib.ReadReq()
        req.struct_size = ctypes.sizeof(req)
        req.head = head
        cap = None
        code = None
        for side, x in (("k_out", k_out), ("v_out", v_out)):
            if x is None:
                continue
            ptr, c, rows = self._out_buffer(x, side, D, call)
            if code is not None and c != code:
                raise InvalidError("read_into: k_out and v_out differ in dtype", call)
            code = c
            cap = rows if cap is None else min(cap, rows)
            setattr(req, side, ptr)
        req.out_dtype = code
        if positions_out is not None:
            if np is not None and type(positions_out) is np.ndarray:
                if positions_out.dtype != np.uint32 or positions_out.ndim != 1 or \
                        not positions_out.flags.c_contiguous:
                    raise InvalidError("positions_out: a contiguous 1-D uint32 array", call)
                req.positions_out = _arrays.numpy_ptr(positions_out)
            elif _arrays.is_torch(positions_out):
                torch = _arrays.torch_module()
                if positions_out.dtype != torch.int32 or positions_out.dim() != 1 or \
                        positions_out.device.type != "cpu" or not positions_out.is_contiguous():
                    raise InvalidError("positions_out: a contiguous 1-D int32 CPU tensor", call)
                req.positions_out = positions_out.data_ptr()
            else:
                raise InvalidError("positions_out: a numpy uint32 array or an int32 CPU tensor", call)
            cap = min(cap, positions_out.shape[0])
        if self._cuda:
            torch = _arrays.torch_module()
            req.stream = _arrays.cuda_stream(self._cfg.device)
        req.capacity_tokens = cap
        rc = lib.kvp_read(self._handle(), _seq(seq), layer, byref(req))
        if rc:
            e = error_for(rc, call)
            e.needed = req.n_tokens
            raise e
        return req.n_tokens

    # ---- the device paths: paged gather and attention (CUDA pools, torch tensors) -------------

    def _cuda_torch(self, call: str):
        """torch, the pool's device and its current stream; NotSupportedError on a host pool
        (from the library, which names the reason)."""
        if not self._cuda:
            if call == "kvp_attend_decode":
                req = _lib.AttendReq()
                lib.kvp_attend_req_init(byref(req))
                self._call(lib.kvp_attend_decode, call, self._handle(), byref(req))
            else:
                req = _lib.GatherReq()
                lib.kvp_gather_req_init(byref(req))
                self._call(lib.kvp_gather, call, self._handle(), byref(req))
        torch = _arrays.torch_module()
        if torch is None:
            raise InvalidError("this call takes torch tensors and torch is not installed", call)
        dev = torch.device("cuda", self._cfg.device)
        return torch, dev, torch.cuda.current_stream(dev).cuda_stream

    def _workspace(self, torch, dev, need: int):
        """The pool's device scratch for table-building calls, grown (never shrunk) to need
        bytes. Reuse is stream-ordered by torch's allocator."""
        ws = self._ws
        if ws is None or ws.numel() < need or ws.device != dev:
            ws = self._ws = torch.empty((max(need, 1 << 16),), dtype=torch.uint8, device=dev)
        return ws

    def attend_decode(self, layer: int, seqs: Sequence[int], q: Any, *, scale: Optional[float] = None,
                      out: Any = None, out_dtype: Any = "bf16", split_tokens: int = 0) -> Any:
        """One decode step of attention over the pool's pages (kvp_attend_decode): ``q`` a
        contiguous bf16 CUDA tensor ``[len(seqs), n_q_heads, head_dim]`` on the pool's device,
        n_q_heads a multiple of the pool's KV heads (at most 8 per KV head). Each KV head attends
        over the tokens it retains; the codes are read and dequantized in the kernel. ``scale``
        defaults to 1/sqrt(head_dim). Returns ``out`` (allocated when None: bf16, or f32 with
        ``out_dtype="f32"``), written on the current stream."""
        call = "kvp_attend_decode"
        torch, dev, stream = self._cuda_torch(call)
        D = self._cfg.head_dim
        B = len(seqs)
        if not _arrays.is_torch(q) or q.dtype != torch.bfloat16 or q.device != dev or q.dim() != 3 or \
                q.shape[0] != B or q.shape[2] != D or not q.is_contiguous():
            raise InvalidError(f"q: a contiguous bf16 tensor [{B}, n_q_heads, {D}] on {dev}", call)
        code = self._out_code(out_dtype)
        tdt = _arrays.torch_dtype(code)
        if out is None:
            out = torch.empty(tuple(q.shape), dtype=tdt, device=dev)
        elif not _arrays.is_torch(out) or out.dtype != tdt or out.device != dev or \
                tuple(out.shape) != tuple(q.shape) or not out.is_contiguous():
            raise InvalidError(f"out: a contiguous {out_dtype} tensor of q's shape on {dev}", call)
        ids = (ctypes.c_uint64 * max(B, 1))(*[_seq(x) for x in seqs])
        req = _lib.AttendReq()
        lib.kvp_attend_req_init(byref(req))
        req.layer, req.seqs, req.batch, req.n_q_heads = layer, ids, B, q.shape[1]
        req.q, req.out, req.out_dtype = q.data_ptr(), out.data_ptr(), code
        req.scale = float(scale) if scale is not None else D ** -0.5
        req.split_tokens, req.stream = split_tokens, stream
        ws = self._ws
        for _ in range(4):  # the writer may grow the table between the sizing and the call
            if ws is not None:
                req.workspace, req.workspace_bytes = ws.data_ptr(), ws.numel()
            rc = lib.kvp_attend_decode(self._handle(), byref(req))
            if rc != _lib.status("ENOSPC") or not req.workspace_needed:
                break
            ws = self._workspace(torch, dev, req.workspace_needed)
        if rc:
            raise error_for(rc, call)
        self.last_attend = {"splits": req.n_splits, "token_heads": req.token_heads, "bytes_read": req.bytes_read,
                            "workspace_bytes": req.workspace_needed}
        return out

    def _attend_ptrs(self, layer: int, ids: Any, batch: int, n_q_heads: int, q_ptr: int, out_ptr: int,
                     scale: float, stream: int) -> None:
        """kvp_attend_decode from addresses the caller has checked (kvpool.hf: ``ids`` a ctypes
        uint64 array of ``batch`` live sequence ids, q and out contiguous bf16 ``[batch,
        n_q_heads, head_dim]`` on the pool's device, ``stream`` its current CUDA stream). Through
        the creator thread's kvp_attend_req, set field by field: a few us a call, against tens
        for attend_decode, which checks its tensors and builds a request each time."""
        if self._h is None:
            raise InvalidError("the pool is closed", "kvpool.Pool")
        if _get_ident() == self._owner:
            req, ref = self._areq, self._areq_ref
        else:
            req = _lib.AttendReq()
            lib.kvp_attend_req_init(byref(req))
            ref = byref(req)
        req.layer, req.seqs, req.batch, req.n_q_heads = layer, ids, batch, n_q_heads
        req.q, req.out, req.scale, req.stream = q_ptr, out_ptr, scale, stream
        ws = self._ws
        if ws is not None:
            req.workspace, req.workspace_bytes = ws.data_ptr(), ws.numel()
        rc = lib.kvp_attend_decode(self._h, ref)
        for _ in range(3):  # the table outgrew the workspace (the writer may grow it again meanwhile)
            if rc != _ENOSPC or not req.workspace_needed:
                break
            torch = _arrays.torch_module()
            ws = self._workspace(torch, torch.device("cuda", self._cfg.device), req.workspace_needed)
            req.workspace, req.workspace_bytes = ws.data_ptr(), ws.numel()
            rc = lib.kvp_attend_decode(self._h, ref)
        if rc:
            raise error_for(rc, "kvp_attend_decode")

    def gather(self, items: Sequence[Tuple[int, int]], *, positions: bool = False) -> Tuple[Any, Any, List, Any]:
        """The retained tokens of many (seq, layer) pairs, every KV head, decoded to bf16 on the
        device (kvp_gather): returns ``(k, v, spans, positions)``: ``k``/``v`` ``[rows, kv_heads,
        head_dim]`` bf16 tensors, ``spans`` a list of (first row, rows) per item (heads holding
        fewer tokens leave zero rows), ``positions`` an int32 CPU tensor ``[rows, kv_heads]``
        (-1 past a head's tokens) when asked, else None."""
        call = "kvp_gather"
        torch, dev, stream = self._cuda_torch(call)
        H, D = self._cfg.n_kv_heads, self._cfg.head_dim
        n = len(items)
        arr = (_lib.GatherItem * max(n, 1))()
        for i, (sq, layer) in enumerate(items):
            arr[i].seq, arr[i].layer = _seq(sq), layer
        req = _lib.GatherReq()
        lib.kvp_gather_req_init(byref(req))
        req.items, req.n_items, req.stream = arr, n, stream
        cap = -1
        rows_needed = 256
        enospc = _lib.status("ENOSPC")
        for _ in range(8):  # rows, then workspace, may grow (the writer appends meanwhile)
            if rows_needed > cap:
                cap = rows_needed + 16
                k = torch.empty((cap, H, D), dtype=torch.bfloat16, device=dev)
                v = torch.empty((cap, H, D), dtype=torch.bfloat16, device=dev)
                pos = torch.empty((cap, H), dtype=torch.int32) if positions else None
            req.capacity_rows, req.k_out, req.v_out = cap, k.data_ptr(), v.data_ptr()
            req.positions_out = pos.data_ptr() if pos is not None else None
            ws = getattr(self, "_ws", None)
            if ws is not None:
                req.workspace, req.workspace_bytes = ws.data_ptr(), ws.numel()
            rc = lib.kvp_gather(self._handle(), byref(req))
            if rc != enospc:
                break
            rows_needed = max(req.n_rows, rows_needed)
            if req.workspace_needed > req.workspace_bytes:
                self._workspace(torch, dev, req.workspace_needed)
        if rc:
            raise error_for(rc, call)
        rows = req.n_rows
        spans = [(arr[i].row0, arr[i].n_rows) for i in range(n)]
        return k[:rows], v[:rows], spans, (pos[:rows] if pos is not None else None)

    def _read_fast(self, fh, seq, layer, head, code, cap, k_out, v_out, positions_out) -> int:
        """kvp_read through cffi into numpy buffers whose shapes and dtypes the caller checked:
        the tokens read, or -1 when from_buffer refuses a buffer (strided or read-only: the
        checked path then says which). The owner thread reuses one kvp_read_req."""
        req = self._freq if _get_ident() == self._owner else _ffi.new(_REQ_T, [_READ_REQ_BYTES])
        try:
            req.k_out = _from_buffer(k_out, require_writable=True)
            req.v_out = _from_buffer(v_out, require_writable=True)
            req.positions_out = _from_buffer(positions_out, require_writable=True)
        except _BUF_ERRORS:
            return -1
        req.head = head
        req.out_dtype = code
        req.capacity_tokens = cap
        rc = _c_read(fh, seq, layer, req)
        if rc:
            e = error_for(rc, "kvp_read")
            e.needed = req.n_tokens
            raise e
        return req.n_tokens

    def _read_numpy(self, seq, layer, head, k_out, v_out, positions_out) -> int:
        call = "kvp_read"
        D = self._cfg.head_dim
        cap = None
        code = None
        for side, x in (("k_out", k_out), ("v_out", v_out)):
            if x is None:
                continue
            c = _arrays.NP_CODE.get(x.dtype)
            if x.ndim != 2 or x.shape[1] != D or not x.flags.c_contiguous or c is None or not x.flags.writeable:
                raise InvalidError(f"{side}: {x.dtype} {x.shape}, expected a writable C-contiguous [capacity, {D}] "
                                   f"array of float32, float16, or uint16/bfloat16 for bf16", call)
            if code is not None and c != code:
                raise InvalidError("read_into: k_out and v_out differ in dtype", call)
            code = c
            cap = x.shape[0] if cap is None else min(cap, x.shape[0])
        if code is None:
            raise InvalidError("read_into: k_out and v_out are both None", call)
        if positions_out is not None:
            if (positions_out.dtype is not _U32 or positions_out.ndim != 1 or not positions_out.flags.c_contiguous
                    or not positions_out.flags.writeable):
                raise InvalidError("positions_out: a writable contiguous 1-D uint32 array", call)
            cap = min(cap, positions_out.shape[0])
        if self._h is None:
            raise InvalidError("the pool is closed", "kvpool.Pool")
        if self._fh is not None:
            req = _ffi.new(_REQ_T)
            req.struct_size = _READ_REQ_BYTES
            req.head = head
            req.out_dtype = code
            if k_out is not None:
                req.k_out = _ffi.from_buffer(k_out, require_writable=True)
            if v_out is not None:
                req.v_out = _ffi.from_buffer(v_out, require_writable=True)
            if positions_out is not None:
                req.positions_out = _ffi.from_buffer(positions_out, require_writable=True)
            req.capacity_tokens = cap
            rc = _C.kvp_read(self._fh, seq, layer, req)
        else:
            req = _lib.ReadReq()
            req.struct_size = _READ_REQ_BYTES
            req.head = head
            req.out_dtype = code
            req.k_out = _arrays.numpy_ptr(k_out) if k_out is not None else None
            req.v_out = _arrays.numpy_ptr(v_out) if v_out is not None else None
            req.positions_out = _arrays.numpy_ptr(positions_out) if positions_out is not None else None
            req.capacity_tokens = cap
            rc = lib.kvp_read(self._h, seq, layer, byref(req))
        if rc:
            e = error_for(rc, call)
            e.needed = req.n_tokens
            raise e
        return req.n_tokens

    def _out_buffer(self, x, side, D, call):
        if np is not None and type(x) is np.ndarray:
            if self._cuda:
                raise InvalidError(f"{side}: a numpy array is host memory; this pool reads into cuda:"
                                   f"{self._cfg.device} tensors", call)
            if x.ndim != 2 or x.shape[1] != D or not x.flags.c_contiguous:
                raise InvalidError(f"{side}: shape {x.shape}, expected a C-contiguous [capacity, {D}]", call)
            name = x.dtype.name
            code = _arrays.DTYPE_NAMES.get("bf16" if name == "uint16" else name)
            if code is None:
                raise InvalidError(f"{side}: dtype {x.dtype} (float32, float16, or uint16/bfloat16 for bf16)", call)
            return _arrays.numpy_ptr(x), code, x.shape[0]
        if _arrays.is_torch(x):
            if x.dim() != 2 or x.shape[1] != D or not x.is_contiguous():
                raise InvalidError(f"{side}: shape {tuple(x.shape)}, expected a contiguous [capacity, {D}]", call)
            dev = x.device
            if self._cuda:
                if dev.type != "cuda" or (dev.index or 0) != self._cfg.device:
                    raise InvalidError(f"{side}: tensor on {dev}; this pool reads into cuda:{self._cfg.device}", call)
            elif dev.type != "cpu":
                raise InvalidError(f"{side}: tensor on {dev}; this pool's region is host memory", call)
            return x.data_ptr(), _arrays.dtype_code(x.dtype, side), x.shape[0]
        raise InvalidError(f"{side}: a numpy array or a torch tensor, got {type(x).__name__}", call)

    def view(self, seq: int, layer: int) -> PoolView:
        """Pin the blocks of (seq, layer) and describe them (kvp_view_acquire): a
        :class:`PoolView` context manager whose ``blocks`` give each block's head, positions,
        codecs and page addresses::

            with pool.view(1, 0) as v:
                for b in v.blocks:
                    print(b.head, list(b.positions), b.pages[("k", "codes")])
        """
        self._handle()
        return PoolView(self, _seq(seq), layer)

    def seq_info(self, seq: int, per_stream: bool = False) -> Dict[str, Any]:
        """Describe a sequence (kvp_seq_info), lock-free: mode, n_steps, n_positions, in_step,
        tokens_retained, tokens_evicted, page_types (the pages it references: shared blocks
        count in every sequence that references them). ``per_stream=True`` adds
        retained_tokens and evicted_tokens, ``[layers][kv_heads]`` lists."""
        d = _lib.SeqDesc()
        d.struct_size = ctypes.sizeof(d)
        n = self._cfg.n_layers * self._cfg.n_kv_heads
        if per_stream:
            ret, ev = (c_uint32 * n)(), (c_uint32 * n)()
            d.retained_tokens = ctypes.addressof(ret)
            d.evicted_tokens = ctypes.addressof(ev)
        self._call(lib.kvp_seq_info, "kvp_seq_info", self._handle(), _seq(seq), byref(d))
        out = {"mode": "step" if d.mode == _lib.SEQ_STEP else "stream", "n_steps": d.n_steps,
               "n_positions": d.n_positions, "in_step": bool(d.in_step), "tokens_retained": d.tokens_retained,
               "tokens_evicted": d.tokens_evicted,
               "page_types": {t: _usage(d.page_types[i]) for i, t in enumerate(_lib.PAGE_TYPES)}}
        if per_stream:
            H = self._cfg.n_kv_heads
            out["retained_tokens"] = [list(ret[l * H:(l + 1) * H]) for l in range(self._cfg.n_layers)]
            out["evicted_tokens"] = [list(ev[l * H:(l + 1) * H]) for l in range(self._cfg.n_layers)]
        return out

    def layer_info(self, layer: int) -> Dict[str, Any]:
        """What the pool chose for a layer (kvp_pool_info): per side ``"k"`` and ``"v"``, a dict of
        codec, group_tokens, block_tokens (stream mode), step_block_tokens (step mode: 65536 = a
        whole step), bytes_per_token (a full stream-mode block) and source_bytes_per_token."""
        d = _lib.LayerInfo()
        lib.kvp_layer_info_init(byref(d))
        self._call(lib.kvp_pool_info, "kvp_pool_info", self._handle(), _int(layer, "layer", "layer_info"), byref(d))
        return {side: {"codec": d.codec[i].decode(), "group_tokens": d.group_tokens[i],
                       "block_tokens": d.block_tokens[i], "step_block_tokens": d.step_block_tokens[i],
                       "bytes_per_token": d.bytes_per_token[i], "source_bytes_per_token": d.source_bytes_per_token[i]}
                for i, side in enumerate(("k", "v"))}

    # ---- stats ----------------------------------------------------------------------------------

    def _write(self, fmt: int) -> str:
        h = self._handle()
        n = c_size_t()
        while True:
            buf = ctypes.create_string_buffer(self._stats_cap)
            rc = lib.kvp_stats_write(h, fmt, buf, self._stats_cap, byref(n))
            if rc == _ENOSPC and n.value >= self._stats_cap:
                self._stats_cap = n.value + 4096
                continue
            if rc:
                raise error_for(rc, "kvp_stats_write")
            return buf.raw[:n.value].decode()

    def stats(self) -> Dict[str, Any]:
        """The pool's stats as a dict: kvp_stats_write's JSON, parsed. Keys are the dotted
        names of docs/telemetry.md: ``stats()["bytes.allocated"]["current"]`` (gauges are
        {current, peak, total}; counters and values are numbers), plus page_types, kv, layers,
        heads, codecs, sequences (slices of {requested_bytes, allocated_bytes, pages}) and
        savings.ratio / savings.bytes. Lock-free."""
        return json.loads(self._write(_lib.STATS_JSON))

    def stats_text(self) -> str:
        """The stats as the library's human table (KVP_STATS_TEXT)."""
        return self._write(_lib.STATS_TEXT)

    def prometheus(self) -> str:
        """The stats in the Prometheus text exposition format (KVP_STATS_PROMETHEUS)."""
        return self._write(_lib.STATS_PROMETHEUS)

    def stats_snapshot(self) -> Dict[str, Any]:
        """kvp_stats_get as a dict with the JSON keys (a lock-free snapshot whose ledger figures
        are mutually consistent): gauges {current, peak, total}, counters and values as ints,
        page_types and kv slices."""
        s = _lib.Stats()
        s.struct_size = ctypes.sizeof(s)
        self._call(lib.kvp_stats_get, "kvp_stats_get", self._handle(), byref(s))
        out: Dict[str, Any] = {"version": s.version}
        for kind, f, key in _lib.STATS_FIELDS:
            x = getattr(s, f)
            out[key] = {"current": x.current, "peak": x.peak, "total": x.total} if kind == "G" else x
        out["page_types"] = {t: _usage(s.page_types[i]) for i, t in enumerate(_lib.PAGE_TYPES)}
        out["kv"] = {"k": _usage(s.kv[0]), "v": _usage(s.kv[1])}
        return out

    def breakdown(self, dim: str, index: int) -> Dict[str, int]:
        """One slice of a breakdown (kvp_stats_breakdown): dim is "page_type", "kv", "layer",
        "head", "codec" or "seq"; returns {requested_bytes, allocated_bytes, pages}. NotFoundError
        for an index out of range (or a sequence or codec holding no pages)."""
        if dim not in DIMS:
            raise InvalidError(f"dim={dim!r}: one of {', '.join(DIMS)}", "kvp_stats_breakdown")
        u = _lib.Usage()
        self._call(lib.kvp_stats_breakdown, "kvp_stats_breakdown", self._handle(), DIMS[dim], index, byref(u))
        return _usage(u)

    def top_sequences(self, n: int = 10) -> List[Tuple[int, Dict[str, int]]]:
        """The n sequences holding the most allocated bytes, largest first
        (kvp_stats_top_sequences): [(seq, usage), ...]."""
        arr = (_lib.SeqUsage * max(n, 1))()
        got = c_uint32()
        self._call(lib.kvp_stats_top_sequences, "kvp_stats_top_sequences", self._handle(), n, arr, byref(got))
        return [(arr[i].seq, _usage(arr[i].usage)) for i in range(got.value)]

    def check(self) -> None:
        """Verify every invariant from scratch (kvp_check); CorruptError names the first broken one."""
        self._call(lib.kvp_check, "kvp_check", self._handle())


def _int(x: Any, what: str, call: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        try:
            import operator
            x = operator.index(x)
        except TypeError:
            raise InvalidError(f"{what}={x!r}: an integer", call) from None
    if x < 0:
        raise InvalidError(f"{what}={x}: negative", call)
    return x


def _seq(seq: Any) -> int:
    if isinstance(seq, int) and 0 <= seq < (1 << 64):
        return seq
    raise InvalidError(f"sequence id {seq!r}: an integer in [0, 2**64)", "kvpool")


def _store(store: Any) -> int:
    from .store import Store
    if not isinstance(store, Store):
        raise InvalidError(f"store={store!r}: a kvpool.Store", "kvpool")
    return store._handle()
