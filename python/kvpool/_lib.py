"""The C ABI of libkvpool through ctypes: finding the library, the structs of
include/kvpool.h, and the prototype of every function the package calls.

Nothing here is public: ``kvpool.Pool`` is the interface. The struct layouts
mirror include/kvpool.h field for field; ``python/tests`` compares their
sizes and offsets with the C compiler's (``build/kvpool-pyabi``), so a change
to the header that is not made here fails the tests.

Library lookup order (the first that loads wins):
  1. next to the package: ``kvpool/libkvpool.so*`` (a copy placed there), the
     source tree's ``build/`` (``python/kvpool`` -> ``build/libkvpool.so``), and ``PREFIX/lib``
     of an installed package (``PREFIX/lib/python3*/{site,dist}-packages/kvpool``);
  2. the ``KVPOOL_LIB`` environment variable (a file path);
  3. the system path (``libkvpool.so.0`` through the dynamic loader).

libkvpool does not link jemalloc, whose initial-exec TLS a dlopen cannot place
once the static TLS block is spent (``import torch`` spends it): host metadata
comes from the process's jemalloc when it has one (``LD_PRELOAD``), else from
libc malloc; ``metadata_allocator()`` says which.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from ctypes import (POINTER, Structure, c_char_p, c_double, c_int, c_size_t, c_uint32, c_uint64, c_void_p)
from typing import List, Optional

SONAME = "libkvpool.so.0"

# ---- library lookup ------------------------------------------------------------------------

_here = os.path.dirname(os.path.abspath(__file__))


def candidates() -> List[str]:
    """Paths tried before KVPOOL_LIB and the system path, in order."""
    out = []
    for name in ("libkvpool.so", SONAME):
        out.append(os.path.join(_here, name))
    # source tree: <repo>/python/kvpool -> <repo>/build
    out.append(os.path.normpath(os.path.join(_here, "..", "..", "build", "libkvpool.so")))
    # installed: PREFIX/lib/python3[.X]/{dist,site}-packages/kvpool -> PREFIX/lib
    out.append(os.path.normpath(os.path.join(_here, "..", "..", "..", SONAME)))
    return out


def _load() -> "tuple[ctypes.CDLL, str]":
    tried = []
    for path in candidates():
        if os.path.exists(path):
            try:
                return ctypes.CDLL(path), path
            except OSError as e:
                tried.append(f"{path}: {e}")
    env = os.environ.get("KVPOOL_LIB")
    if env:
        try:
            return ctypes.CDLL(env), env
        except OSError as e:
            tried.append(f"KVPOOL_LIB={env}: {e}")
    for name in (SONAME, ctypes.util.find_library("kvpool")):
        if not name:
            continue
        try:
            return ctypes.CDLL(name), name
        except OSError as e:
            tried.append(f"{name}: {e}")
    raise ImportError("kvpool: cannot load libkvpool (build it with `make`, or set KVPOOL_LIB to its path); tried:\n  "
                      + "\n  ".join(tried or ["(nothing found)"]))


lib, path = _load()

# ---- constants (include/kvpool.h) -----------------------------------------------------------

DTYPE_F32, DTYPE_BF16, DTYPE_F16 = 0, 1, 2
MEM_HOST, MEM_CUDA = 0, 1
SEQ_STREAM, SEQ_STEP = 0, 1
POOL_PREFAULT, POOL_SANITIZE, POOL_DRY, POOL_ALLOW_EXPANSION, POOL_DEVICE_ASYNC = 1, 2, 4, 8, 16
STEP_SCENE_CUT = 1
STATS_JSON, STATS_PROMETHEUS, STATS_TEXT = 0, 1, 2
PAGE_TYPES = ("raw", "codes", "scales", "centroids", "assign", "outliers", "meta")
DIM_PAGE_TYPE, DIM_KV, DIM_LAYER, DIM_HEAD, DIM_CODEC, DIM_SEQ = range(6)

# KVP_STATUS_LIST: (name, value)
STATUS = (("OK", 0), ("EINVAL", -1), ("ENOMEM", -2), ("EBUDGET", -3), ("ENOSPC", -4), ("ENOENT", -5),
          ("EEXIST", -6), ("EDEVICE", -7), ("ECODEC", -8), ("EFORMAT", -9), ("EBUSY", -10), ("ECORRUPT", -11),
          ("ENOTSUP", -12), ("EIO", -13))

# KVP_STATS_LIST: (kind, field, JSON key). kind: G gauge {current, peak, total}, C counter, V value.
STATS_FIELDS = (
    ("G", "bytes_requested", "bytes.requested"), ("G", "bytes_allocated", "bytes.allocated"),
    ("G", "bytes_committed", "bytes.committed"), ("V", "bytes_reserved", "bytes.reserved"),
    ("V", "budget_bytes", "bytes.budget"), ("G", "pages", "pages.live"), ("G", "slabs", "slabs.live"),
    ("G", "extents", "extents.live"), ("C", "allocs", "ops.allocs"), ("C", "frees", "ops.frees"),
    ("C", "grows", "ops.grows"), ("C", "grow_moves", "ops.grow_moves"),
    ("C", "budget_refusals", "ops.budget_refusals"), ("C", "nospc_refusals", "ops.nospc_refusals"),
    ("G", "metadata_bytes", "host.metadata_bytes"), ("G", "tokens_retained", "tokens.retained"),
    ("C", "tokens_evicted", "tokens.evicted"), ("G", "bf16_equivalent_bytes", "bytes.bf16_equivalent"),
    ("G", "sequences", "sequences.live"), ("G", "codec_state_bytes", "bytes.codec_state"),
    ("G", "bytes_retired", "bytes.retired"), ("V", "device_used_bytes", "device.used_bytes"),
    ("V", "device_total_bytes", "device.total_bytes"), ("V", "codec_static_bytes", "bytes.codec_static"),
    ("C", "prefix_query_tokens", "prefix.query_tokens"), ("C", "prefix_hit_tokens", "prefix.hit_tokens"),
    ("G", "prefix_chunks", "prefix.chunks"), ("C", "store_offload_bytes", "store.offload_bytes"),
    ("C", "store_restore_bytes", "store.restore_bytes"), ("C", "store_prefix_tokens", "store.prefix_tokens"),
    ("V", "device_control_bytes", "device.control_bytes"), ("V", "host_pinned_bytes", "host.pinned_bytes"),
)

# ---- structs ---------------------------------------------------------------------------------


class Config(Structure):
    _fields_ = [("struct_size", c_size_t), ("n_layers", c_uint32), ("n_kv_heads", c_uint32),
                ("head_dim", c_uint32), ("k_dtype", c_int), ("v_dtype", c_int), ("memory", c_int),
                ("device", c_int), ("region_bytes", c_uint64), ("budget_bytes", c_uint64),
                ("block_tokens", c_uint32), ("codecs", c_char_p), ("policy", c_char_p), ("flags", c_uint32)]


class SeqConfig(Structure):
    _fields_ = [("struct_size", c_size_t), ("mode", c_int), ("step_tokens", POINTER(c_uint32)),
                ("n_steps", c_uint32), ("budget_fraction", c_double), ("policy", c_char_p),
                ("tokens", POINTER(c_uint32)), ("n_tokens", c_uint32)]


class KV(Structure):
    _fields_ = [("k", c_void_p), ("v", c_void_p), ("stream", c_void_p)]


class ReadReq(Structure):
    _fields_ = [("struct_size", c_size_t), ("head", c_uint32), ("out_dtype", c_int), ("k_out", c_void_p),
                ("v_out", c_void_p), ("positions_out", c_void_p), ("capacity_tokens", c_uint32),
                ("n_tokens", c_uint32), ("stream", c_void_p)]


NPT = len(PAGE_TYPES)


class ViewBlock(Structure):
    _fields_ = [("head", c_uint32), ("block_pos0", c_uint32), ("first", c_uint32), ("n_tokens", c_uint32),
                ("cap_tokens", c_uint32), ("codec", c_uint32 * 2), ("page", (c_void_p * NPT) * 2),
                ("page_bytes", (c_uint64 * NPT) * 2)]


class View(Structure):
    _fields_ = [("seq", c_uint64), ("layer", c_uint32), ("n_blocks", c_uint32), ("blocks", POINTER(ViewBlock))]


class Gauge(Structure):
    _fields_ = [("current", c_uint64), ("peak", c_uint64), ("total", c_uint64)]


class Usage(Structure):
    _fields_ = [("requested_bytes", c_uint64), ("allocated_bytes", c_uint64), ("npages", c_uint64)]


class Stats(Structure):
    _fields_ = ([("struct_size", c_size_t), ("version", c_uint32)]
                + [(f, Gauge if k == "G" else c_uint64) for k, f, _ in STATS_FIELDS]
                + [("page_types", Usage * NPT), ("kv", Usage * 2)])


class SeqUsage(Structure):
    _fields_ = [("seq", c_uint64), ("usage", Usage)]


class SeqDesc(Structure):
    _fields_ = [("struct_size", c_size_t), ("mode", c_int), ("n_steps", c_uint32), ("n_positions", c_uint32),
                ("in_step", c_int), ("tokens_retained", c_uint64), ("tokens_evicted", c_uint64),
                ("retained_tokens", c_void_p), ("evicted_tokens", c_void_p), ("page_types", Usage * NPT)]


class LayerInfo(Structure):
    _fields_ = [("struct_size", c_size_t), ("codec", c_char_p * 2), ("group_tokens", c_uint32 * 2),
                ("block_tokens", c_uint32 * 2), ("step_block_tokens", c_uint32 * 2),
                ("bytes_per_token", ctypes.c_double * 2), ("source_bytes_per_token", ctypes.c_double * 2)]


class GatherItem(Structure):
    _fields_ = [("seq", c_uint64), ("layer", c_uint32), ("row0", c_uint32), ("n_rows", c_uint32)]


class GatherReq(Structure):
    _fields_ = [("struct_size", c_size_t), ("items", POINTER(GatherItem)), ("n_items", c_uint32),
                ("k_out", c_void_p), ("v_out", c_void_p), ("positions_out", c_void_p),
                ("capacity_rows", c_uint32), ("workspace", c_void_p), ("workspace_bytes", c_uint64),
                ("n_rows", c_uint32), ("n_launches", c_uint32), ("workspace_needed", c_uint64),
                ("stream", c_void_p)]


class AttendReq(Structure):
    _fields_ = [("struct_size", c_size_t), ("layer", c_uint32), ("seqs", POINTER(c_uint64)), ("batch", c_uint32),
                ("n_q_heads", c_uint32), ("q", c_void_p), ("scale", ctypes.c_float), ("out", c_void_p),
                ("out_dtype", c_int), ("workspace", c_void_p), ("workspace_bytes", c_uint64),
                ("split_tokens", c_uint32), ("workspace_needed", c_uint64), ("n_splits", c_uint32),
                ("token_heads", c_uint64), ("bytes_read", c_uint64), ("stream", c_void_p)]


class CodecVtableHead(Structure):
    """The first fields of kvp_codec_vtable (include/kvpool_codec.h): enough for the name."""
    _fields_ = [("abi_version", c_uint32), ("name", c_char_p)]


STRUCTS = {"kvp_config": Config, "kvp_seq_config": SeqConfig, "kvp_kv": KV, "kvp_read_req": ReadReq,
           "kvp_view_block": ViewBlock, "kvp_view": View, "kvp_gauge": Gauge, "kvp_usage": Usage,
           "kvp_stats": Stats, "kvp_seq_usage": SeqUsage, "kvp_seq_desc": SeqDesc,
           "kvp_layer_info": LayerInfo, "kvp_gather_item": GatherItem, "kvp_gather_req": GatherReq,
           "kvp_attend_req": AttendReq}

# ---- prototypes ------------------------------------------------------------------------------

P = c_void_p  # kvp_pool *


def _proto(name: str, restype, *argtypes) -> None:
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)


_proto("kvp_version", c_char_p)
_proto("kvp_metadata_allocator", c_char_p)
_proto("kvp_strerror", c_char_p, c_int)
_proto("kvp_err_name", c_char_p, c_int)
_proto("kvp_last_error", c_char_p)
_proto("kvp_config_init", None, POINTER(Config))
_proto("kvp_pool_create", c_int, POINTER(Config), POINTER(c_void_p))
_proto("kvp_pool_destroy", None, P)
_proto("kvp_stats_get", c_int, P, POINTER(Stats))
_proto("kvp_stats_breakdown", c_int, P, c_int, c_uint64, POINTER(Usage))
_proto("kvp_stats_top_sequences", c_int, P, c_uint32, POINTER(SeqUsage), POINTER(c_uint32))
_proto("kvp_stats_write", c_int, P, c_int, c_char_p, c_size_t, POINTER(c_size_t))
_proto("kvp_check", c_int, P)
_proto("kvp_seq_config_init", None, POINTER(SeqConfig))
_proto("kvp_seq_add", c_int, P, c_uint64, POINTER(SeqConfig))
_proto("kvp_seq_free", c_int, P, c_uint64)
_proto("kvp_seq_fork", c_int, P, c_uint64, c_uint64)
_proto("kvp_step_begin", c_int, P, c_uint64, c_uint32, c_uint32)
_proto("kvp_append", c_int, P, c_uint64, c_uint32, POINTER(KV))
_proto("kvp_step_end", c_int, P, c_uint64)
_proto("kvp_evict", c_int, P, c_uint64, c_uint32, c_uint32, c_uint32)
_proto("kvp_read", c_int, P, c_uint64, c_uint32, POINTER(ReadReq))
_proto("kvp_view_acquire", c_int, P, c_uint64, c_uint32, POINTER(POINTER(View)))
_proto("kvp_view_release", None, P, POINTER(View))
_proto("kvp_reclaim", c_int, P)
_proto("kvp_seq_info", c_int, P, c_uint64, POINTER(SeqDesc))
_proto("kvp_layer_info_init", None, POINTER(LayerInfo))
_proto("kvp_pool_info", c_int, P, c_uint32, POINTER(LayerInfo))
_proto("kvp_gather_req_init", None, POINTER(GatherReq))
_proto("kvp_gather", c_int, P, POINTER(GatherReq))
_proto("kvp_attend_req_init", None, POINTER(AttendReq))
_proto("kvp_attend_decode", c_int, P, POINTER(AttendReq))
_proto("kvp_store_open", c_int, c_char_p, POINTER(c_void_p))
_proto("kvp_store_close", None, c_void_p)
_proto("kvp_store_traffic", c_int, c_void_p, POINTER(c_uint64), POINTER(c_uint64))
_proto("kvp_store_set_stream", c_int, c_void_p, c_void_p)
_proto("kvp_seq_offload", c_int, P, c_uint64, c_void_p)
_proto("kvp_seq_restore", c_int, P, c_uint64, c_void_p)
_proto("kvp_prefix_publish", c_int, P, c_uint64, c_void_p, POINTER(c_uint32))
_proto("kvp_prefix_fetch", c_int, P, c_uint64, c_void_p, POINTER(c_uint32))
_proto("kvp_codec_find", c_int, c_char_p, POINTER(c_uint32))
_proto("kvp_codec_get", POINTER(CodecVtableHead), c_uint32)


def status(name: str) -> int:
    """The value of KVP_<name> ("ENOSPC" -> -4)."""
    return dict(STATUS)[name]


def last_error() -> str:
    """kvp_last_error() of this thread, decoded."""
    s = lib.kvp_last_error()
    return s.decode("utf-8", "replace") if s else ""


def version() -> str:
    """kvp_version(): the version of the library actually loaded."""
    return lib.kvp_version().decode()


def metadata_allocator() -> str:
    """kvp_metadata_allocator(): "jemalloc" or "libc"."""
    return lib.kvp_metadata_allocator().decode()


def codec_name(codec_id: int) -> Optional[str]:
    """The spec name of a registered codec id, or None."""
    vt = lib.kvp_codec_get(codec_id)
    if not vt:
        return None
    return vt.contents.name.decode()
