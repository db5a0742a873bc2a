"""Arrays in and out of the C calls: numpy on the host, torch tensors on the
host or the pool's CUDA device. Every check the C library cannot make (shape,
dtype, contiguity, device) happens here, before the call, and raises
InvalidError naming the argument.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Tuple

from . import _lib
from .errors import InvalidError

try:
    import numpy as np
except ImportError:  # numpy is optional: torch tensors work without it
    np = None

_torch = None  # imported on first use: it is slow to import and often absent


def torch_module():
    """torch, or None when it is not installed (imported once)."""
    global _torch
    if _torch is None:
        try:
            import torch
            _torch = torch
        except ImportError:
            _torch = False
    return _torch or None


# ---- dtypes ----------------------------------------------------------------------------------

DTYPE_NAMES = {
    "f32": _lib.DTYPE_F32, "fp32": _lib.DTYPE_F32, "float32": _lib.DTYPE_F32, "float": _lib.DTYPE_F32,
    "bf16": _lib.DTYPE_BF16, "bfloat16": _lib.DTYPE_BF16,
    "f16": _lib.DTYPE_F16, "fp16": _lib.DTYPE_F16, "float16": _lib.DTYPE_F16, "half": _lib.DTYPE_F16,
}
DTYPE_STR = {_lib.DTYPE_F32: "f32", _lib.DTYPE_BF16: "bf16", _lib.DTYPE_F16: "f16"}
DTYPE_BYTES = {_lib.DTYPE_F32: 4, _lib.DTYPE_BF16: 2, _lib.DTYPE_F16: 2}


_CODE_OF = {}  # dtype objects (numpy, torch) seen before -> kvp_dtype


def dtype_code(d: Any, what: str) -> int:
    """A kvp_dtype from a name ("bf16", "fp16", "f32", ...), a numpy dtype or a torch dtype."""
    if not isinstance(d, str):
        try:
            code = _CODE_OF.get(d)
        except TypeError:  # unhashable
            code = None
        if code is not None:
            return code
    if isinstance(d, str):
        name = d.lower()
    else:
        name = str(d)
        if name.startswith("torch."):
            name = name[6:]
        elif np is not None:
            try:
                name = np.dtype(d).name
            except TypeError:
                pass
    code = DTYPE_NAMES.get(name)
    if code is None:
        raise InvalidError(f"{what}={d!r}: not a dtype (f32, bf16, f16)", "kvpool")
    if not isinstance(d, str):
        _CODE_OF[d] = code
    return code


_NUMPY_DTYPE = {}  # kvp_dtype -> numpy dtype, filled on first use (a failed import is slow)


def numpy_dtype(code: int):
    """The numpy dtype holding a kvp_dtype: float32, float16, and for bf16 ml_dtypes.bfloat16
    when that package is installed, else uint16 (the bf16 bit patterns)."""
    d = _NUMPY_DTYPE.get(code)
    if d is not None:
        return d
    if code == _lib.DTYPE_F32:
        d = np.dtype(np.float32)
    elif code == _lib.DTYPE_F16:
        d = np.dtype(np.float16)
    else:
        try:
            import ml_dtypes
            d = np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            d = np.dtype(np.uint16)
    _NUMPY_DTYPE[code] = d
    return d


def numpy_accepts(code: int):
    """numpy dtypes accepted for a kvp_dtype on input."""
    if code == _lib.DTYPE_BF16:
        out = [np.dtype(np.uint16)]
        try:
            import ml_dtypes
            out.append(np.dtype(ml_dtypes.bfloat16))
        except ImportError:
            pass
        return tuple(out)
    return (numpy_dtype(code),)


#: numpy dtype -> kvp_dtype of read buffers (uint16 holds bf16 bit patterns)
NP_CODE = {}
if np is not None:
    NP_CODE = {np.dtype(np.float32): _lib.DTYPE_F32, np.dtype(np.float16): _lib.DTYPE_F16,
               np.dtype(np.uint16): _lib.DTYPE_BF16}
    try:
        import ml_dtypes
        NP_CODE[np.dtype(ml_dtypes.bfloat16)] = _lib.DTYPE_BF16
    except ImportError:
        pass


def torch_dtype(code: int):
    torch = torch_module()
    return {_lib.DTYPE_F32: torch.float32, _lib.DTYPE_BF16: torch.bfloat16, _lib.DTYPE_F16: torch.float16}[code]


# ---- pointers --------------------------------------------------------------------------------

_c_char_from_buffer = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


def numpy_ptr(a) -> int:
    """Address of a numpy array's first element. from_buffer is about 3x cheaper than
    a.ctypes.data, and needs a writable array (read-only ones take the slow path)."""
    try:
        return _addressof(_c_char_from_buffer(a))
    except (TypeError, ValueError):
        return a.ctypes.data


_raw_stream = None  # torch._C._cuda_getCurrentRawStream when torch has it


def cuda_stream(device: int) -> int:
    """The current CUDA stream of a device (torch's), as the integer cudaStream_t. Through
    torch._C._cuda_getCurrentRawStream where torch has it (what Triton launches use: about
    0.1 us), else torch.cuda.current_stream (a few us: it builds a Stream object)."""
    global _raw_stream
    f = _raw_stream
    if f is None:
        torch = torch_module()
        f = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
            (lambda i: torch.cuda.current_stream(i).cuda_stream)
        _raw_stream = f
    return f(device)


def is_torch(x) -> bool:
    torch = _torch if _torch is not None else torch_module()
    return bool(torch) and isinstance(x, torch.Tensor)


class Input:
    """How a pool accepts K/V: its dtype codes, memory and device, checked per call."""

    __slots__ = ("k_code", "v_code", "cuda", "device", "k_np", "v_np", "k_th", "v_th", "row_elems", "H", "D")

    def __init__(self, k_code: int, v_code: int, cuda: bool, device: int, H: int, D: int):
        self.k_code, self.v_code, self.cuda, self.device, self.H, self.D = k_code, v_code, cuda, device, H, D
        self.k_np = numpy_accepts(k_code) if np is not None else ()
        self.v_np = numpy_accepts(v_code) if np is not None else ()
        self.k_th = self.v_th = None  # torch dtypes, set on first torch input

    def pointer(self, x, n: int, side: str, call: str) -> Tuple[int, Optional[int]]:
        """Check one K or V input of n tokens: (address, CUDA stream or None)."""
        want = (n, self.H, self.D)
        if np is not None and type(x) is np.ndarray:
            if self.cuda:
                raise InvalidError(f"{side}: a numpy array is host memory; this pool's region is on CUDA device "
                                   f"{self.device} (pass a torch CUDA tensor)", call)
            ok = self.k_np if side == "k" else self.v_np
            if x.dtype not in ok:
                code = self.k_code if side == "k" else self.v_code
                raise InvalidError(f"{side}: dtype {x.dtype} does not match the pool's {side}_dtype "
                                   f"{DTYPE_STR[code]} (numpy: {', '.join(str(d) for d in ok)})", call)
            if x.shape != want:
                raise InvalidError(f"{side}: shape {tuple(x.shape)}, expected {want} (step tokens, kv_heads, head_dim)",
                                   call)
            if not x.flags.c_contiguous:
                raise InvalidError(f"{side}: not C-contiguous (use numpy.ascontiguousarray)", call)
            return numpy_ptr(x), None
        if is_torch(x):
            return self._torch_pointer(x, want, side, call)
        raise InvalidError(f"{side}: expected a numpy array or a torch tensor, got {type(x).__name__}", call)

    def _torch_pointer(self, x, want, side: str, call: str) -> Tuple[int, Optional[int]]:
        if self.k_th is None:
            self.k_th, self.v_th = torch_dtype(self.k_code), torch_dtype(self.v_code)
        dt = self.k_th if side == "k" else self.v_th
        if x.dtype != dt:
            raise InvalidError(f"{side}: dtype {x.dtype} does not match the pool's {side}_dtype {dt}", call)
        if tuple(x.shape) != want:
            raise InvalidError(f"{side}: shape {tuple(x.shape)}, expected {want} (step tokens, kv_heads, head_dim)",
                               call)
        if not x.is_contiguous():
            raise InvalidError(f"{side}: not contiguous (call .contiguous())", call)
        dev = x.device
        if self.cuda:
            if dev.type != "cuda" or (dev.index if dev.index is not None else 0) != self.device:
                raise InvalidError(f"{side}: tensor on {dev}; this pool's region is on cuda:{self.device}", call)
            return x.data_ptr(), cuda_stream(self.device)
        if dev.type != "cpu":
            raise InvalidError(f"{side}: tensor on {dev}; this pool's region is host memory (use .cpu(), or a "
                               f"pool with memory='cuda')", call)
        return x.data_ptr(), None
