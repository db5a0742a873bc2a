"""kvpool as the KV cache of Hugging Face ``transformers`` generation.

:class:`KvpoolCache` is a ``transformers.Cache`` whose keys and values live in a
:class:`kvpool.Pool`: each ``update`` appends the layer's new K/V to the pool (one
sequence per batch row) and returns what attention needs, read back from the pool
(dequantized by the pool's codecs, minus what its policy evicted)::

    import kvpool, torch
    from kvpool.hf import KvpoolCache

    pool = kvpool.Pool(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, k_dtype="bf16", v_dtype="bf16",
                       memory="cuda", region_bytes=1 << 30, block_tokens=64)
    out = model.generate(ids, past_key_values=KvpoolCache(pool), max_new_tokens=256)

Where the pool lives:
  - ``memory="cuda"``: K/V go from the model's tensors into the pool's region on the
    current CUDA stream and come back with kvp_read into device tensors. A CUDA pool takes
    every built-in codec (raw, fp8, int8, kivi, nvfp4, kvquant, qvg) through its device ops.
  - ``memory="host"``: any codec (fp8, int8, kivi, nvfp4, qvg, kvquant). K/V are copied to
    the host for the append and back to the model's device after the read: slow, but the
    attention sees exactly what the codec keeps.

Lengths and masks: ``get_seq_length`` is the number of positions seen (what RoPE and
``cache_position`` need, as for a sliding-window cache), and ``get_mask_sizes`` gives the
retained length plus the query, with the offset of the evicted tokens, so a policy that
evicts (``window:sink=4:recent=1024``) frees memory for real and attention reads the kept
tokens only. On the read-back path every head of a layer must retain the same number of
tokens (NotImplementedError otherwise); the fused path below takes per-head policies such as
heatkv, each KV head attending over its own tokens.

Batches: row b of the batch is pool sequence ``seq_ids[b]`` (allocated on the first update).
Beam search and ``num_return_sequences`` reorder and repeat rows through ``kvp_seq_fork``
(sealed blocks are shared, not copied). ``crop`` is not supported (it would need truncation).

Reading back costs one kvp_read per (row, layer, head) and step. Decoding fast: load the
model with ``attn_implementation="kvpool"`` (after :func:`register`, which
``KvpoolCache(..., fused=True)`` calls) and give the cache ``fused=True``. Then each decode
step (one query token per row, a CUDA pool, no padding mask) appends the layer's K/V and runs
kvp_attend_decode: the kernel reads the pages in place, codes dequantized in registers, each
KV head over the tokens it retains (heatkv's per-head evictions included); nothing is read
back. Prefill, padded batches and a model whose attention is not "kvpool" take the read-back
path, so ``fused=True`` is never wrong, at worst not faster::

    kvpool.hf.register()
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="kvpool", ...)
    out = model.generate(ids, past_key_values=KvpoolCache(pool, fused=True), max_new_tokens=256)
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _arrays
from .pool import Pool

try:
    from transformers.cache_utils import Cache
except ImportError as e:  # pragma: no cover - the module is useless without transformers
    raise ImportError("kvpool.hf needs the transformers package") from e

try:  # transformers >= 4.54: a Cache is a list of layer objects
    from transformers.cache_utils import CacheLayerMixin as _LayerBase
except ImportError:  # older: no layer objects
    _LayerBase = object

__all__ = ["KvpoolCache", "register", "kvpool_attention"]

_seq_counter = itertools.count(1 << 40)  # default sequence ids, unique in the process

# The layer a cache updated last on this thread, for the attention call that follows it in the
# same layer's forward: (cache, layer_idx, fused) where fused says the update returned
# placeholders and the attention must read the pool.
_last = threading.local()


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward


def kvpool_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The "kvpool" attention implementation (see :func:`register`). After a fused
    ``KvpoolCache.update`` of this layer: kvp_attend_decode over the pool's pages for the
    step's query ``[batch, q_heads, 1, head_dim]``, returning ``([batch, 1, q_heads, head_dim],
    None)`` as transformers' sdpa does. Otherwise (prefill, another cache, no cache) it is
    transformers' sdpa over the given key and value."""
    ref, layer, fused = getattr(_last, "state", (None, -1, False))
    _last.state = (None, -1, False)
    cache = ref() if ref is not None else None
    idx = getattr(module, "layer_idx", None)
    if cache is not None and layer == idx:
        cache._attention_seen = True
        if fused:
            if attention_mask is None and query.shape[2] == 1 and dropout == 0.0 and \
                    query.shape[1] <= 8 * cache.pool.kv_heads and \
                    not kwargs.get("sliding_window") and not kwargs.get("softcap"):
                return cache._attend(idx, query, scaling), None
            key, value = cache._gather(idx, key.dtype, key.device)  # padding or options: read back
            cache._retained[idx] = key.shape[-2]
    return _sdpa()(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register(name: str = "kvpool") -> None:
    """Register :func:`kvpool_attention` as transformers attention implementation ``name``
    (and sdpa's mask for it), so that a model loaded or configured with
    ``attn_implementation=name`` decodes through KvpoolCache's fused path. Idempotent."""
    from transformers import AttentionInterface
    AttentionInterface.register(name, kvpool_attention)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    except ImportError:  # older transformers: masks do not go by implementation
        pass


class KvpoolLayer(_LayerBase):
    """The per-layer face of a :class:`KvpoolCache` for code that walks ``cache.layers``.
    It holds no tensors (``keys``/``values`` are the last ones returned, for inspection);
    every question goes to the cache."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: "KvpoolCache", layer_idx: int):
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.is_initialized = False
        self._cache = cache
        self._idx = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, *args, **kwargs) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, cache_kwargs=None):
        return self._cache.update(key_states, value_states, self._idx, cache_kwargs)

    def get_seq_length(self, *args, **kwargs) -> int:
        return self._cache.get_seq_length(self._idx)

    def get_mask_sizes(self, query, *args, **kwargs) -> Tuple[int, int]:
        return self._cache.get_mask_sizes(query, self._idx)

    def get_max_cache_shape(self, *args, **kwargs) -> int:
        return -1

    def get_max_length(self, *args, **kwargs) -> int:  # no fixed maximum: the pool's budget decides
        return -1

    def reset(self) -> None:
        self.keys = self.values = None

    def offload(self) -> None:  # the pool decides where bytes live
        pass

    def prefetch(self) -> None:
        pass

    def reorder_cache(self, beam_idx) -> None:  # done once for all layers by the cache
        pass

    def __repr__(self) -> str:
        return f"KvpoolLayer({self._idx})"


class KvpoolCache(Cache):
    """A ``transformers`` Cache backed by a :class:`kvpool.Pool`.

    Args:
        pool: the pool; its geometry must be the model's (layers, KV heads, head_dim).
        seq_ids: pool sequence ids for the batch rows (default: fresh ids, added on the first
            update). Given ids that are not live are added.
        mode, policy, budget_fraction: passed to ``pool.add`` for each row's sequence.
        free_on_close: free the rows' sequences in :meth:`close` (and when the cache is
            garbage collected).
        fused: decode steps through kvp_attend_decode when the model's attention is "kvpool"
            (see the module's text); registers that implementation.
        step_tokens: each row's planned step sizes (``pool.add``'s), for policies that plan
            over a schedule (heatkv): e.g. ``[prompt_len] + [1] * (new_tokens - 1)``.
    """

    is_compileable = False

    def __init__(self, pool: Pool, seq_ids: Optional[Sequence[int]] = None, *, mode: str = "stream",
                 policy: Optional[str] = None, budget_fraction: float = 0.0, free_on_close: bool = True,
                 fused: bool = False, step_tokens: Optional[Sequence[int]] = None):
        layers = [KvpoolLayer(self, i) for i in range(pool.layers)]
        try:
            super().__init__(layers=layers)
        except TypeError:  # a Cache without layer objects
            super().__init__()
        self.layers = layers
        self.pool = pool
        self._given_ids = list(seq_ids) if seq_ids is not None else None
        self._add_kw = dict(mode=mode, policy=policy, budget_fraction=budget_fraction,
                            step_tokens=list(step_tokens) if step_tokens is not None else None)
        self.seq_ids: List[int] = []
        self._owned: List[int] = []  # sequences this cache added (freed on close)
        self._free_on_close = free_on_close
        L = pool.layers
        self._seen = [0] * L      # positions appended per layer
        self._retained = [0] * L  # tokens returned by the last update per layer
        self._step_tokens = 0
        self._in_step = False
        self._host_dtype = _arrays.torch_dtype(pool._cfg.k_dtype)
        self._v_dtype = _arrays.torch_dtype(pool._cfg.v_dtype)
        self.fused = bool(fused) and pool.memory == "cuda"
        self.fused_calls = 0  # layer steps attended by kvp_attend_decode
        self._attention_seen = False  # kvpool_attention ran after one of this cache's updates
        # no policy, of the pool or of this cache's sequences: appends evict nothing (over the
        # budget they fail), so a layer retains every token appended
        self._keeps_all = pool.policy is None and policy is None
        self._prior = False  # some row is a sequence that held tokens before this cache's first update
        self._ids_c = None  # seq_ids as the ctypes array kvp_attend_decode takes, built for _ids_of
        self._ids_of: Optional[List[int]] = None
        self._dev = torch.device("cuda", pool.device) if pool.memory == "cuda" else None
        self._dev_index = pool.device if pool.memory == "cuda" else -1  # Tensor.get_device() of pool memory
        self._shape = (pool.layers, pool.kv_heads, pool.head_dim)
        self._ref = weakref.ref(self)
        if self.fused:
            register()

    # ---- rows and sequences ---------------------------------------------------------------------

    def _new_seq(self, seq: Optional[int] = None) -> int:
        seq = next(_seq_counter) if seq is None else seq
        self.pool.add(seq, **self._add_kw)
        self._owned.append(seq)
        return seq

    def _ensure_rows(self, batch: int) -> None:
        if self.seq_ids:
            if len(self.seq_ids) != batch:
                raise ValueError(f"KvpoolCache: batch of {batch} rows, the cache holds {len(self.seq_ids)}")
            return
        if self._given_ids is not None:
            if len(self._given_ids) != batch:
                raise ValueError(f"KvpoolCache: {len(self._given_ids)} seq_ids for a batch of {batch}")
            live = set(self.pool.sequences)
            self.seq_ids = [s if s in live else self._new_seq(s) for s in self._given_ids]
            self._prior = any(s in live for s in self._given_ids)  # rows that hold tokens already
        else:
            self.seq_ids = [self._new_seq() for _ in range(batch)]

    def close(self) -> None:
        """Free the sequences this cache added (when ``free_on_close``). Idempotent."""
        if self._free_on_close and not self.pool.closed:
            for seq in self._owned:
                try:
                    self.pool.free(seq)
                except Exception:
                    pass
        self._owned = []
        self.seq_ids = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- the Cache API --------------------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Optional[Dict[str, Any]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append the layer's new K/V (``[batch, kv_heads, q_len, head_dim]``) to the pool and
        return the layer's retained K/V ``[batch, kv_heads, n, head_dim]`` for attention, in the
        model's dtype and on its device. Layer 0 begins a step of q_len tokens for every row,
        the last layer ends it. A layer's first step (the prompt) on a pool and cache without
        a policy returns the given K/V themselves: they are what the layer retains, so nothing
        is read back (a lossy codec's error enters from the next step, as in transformers'
        quantized caches)."""
        pool = self.pool
        B, H, S, D = key_states.shape
        L, PH, PD = self._shape
        if H != PH or D != PD:
            raise ValueError(f"KvpoolCache: K/V [{B}, {H}, {S}, {D}] do not match the pool's "
                             f"{PH} KV heads of {PD}")
        if layer_idx >= L:
            raise ValueError(f"KvpoolCache: layer {layer_idx} of a pool of {L} layers")
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states)
        if layer_idx == 0:
            self._ensure_rows(B)
            for seq in self.seq_ids:
                pool.step_begin(seq, S)
            self._in_step, self._step_tokens = True, S
        elif not self._in_step or S != self._step_tokens:
            raise RuntimeError(f"KvpoolCache: layer {layer_idx} updated outside the step layer 0 began")
        on_device = self._dev_index >= 0
        # K/V made here are contiguous [S, H, D] in the pool's dtypes; on the pool's device (or
        # the host) their addresses go straight to kvp_append, else pool.append says what is wrong
        direct = (key_states.get_device() == self._dev_index) if on_device else True  # host pool: made on the CPU here
        stream = _arrays.cuda_stream(self._dev_index) if direct and on_device else None
        if S == 1 and direct and on_device and value_states.get_device() == self._dev_index and \
                key_states.dtype == self._host_dtype and value_states.dtype == self._v_dtype and \
                key_states.is_contiguous() and value_states.is_contiguous():
            # a decode step's contiguous [B, H, 1, D]: row b's K/V are the [1, H, D] rows
            # kvp_append takes, B H D elements apart, with no tensor made
            kp, vp = key_states.data_ptr(), value_states.data_ptr()
            kst, vst = H * D * key_states.element_size(), H * D * value_states.element_size()
            for b, seq in enumerate(self.seq_ids):
                pool._append_ptrs(seq, layer_idx, kp + b * kst, vp + b * vst, stream)
        else:
            self._append_rows(key_states, value_states, layer_idx, direct, stream)
        if layer_idx == L - 1:
            for seq in self.seq_ids:
                pool.step_end(seq)
            self._in_step = False
        self._seen[layer_idx] += S
        # fused: a decode step whose attention is kvpool_attention (seen in an earlier step:
        # another implementation would attend over the placeholders) reads the pool itself
        fused = self.fused and self._attention_seen and S == 1 and direct
        _last.state = (self._ref, layer_idx, fused)
        if fused:
            self._retained[layer_idx] = self._seen[layer_idx]  # read back if a mask needs it
            layer.keys = layer.values = None
            return key_states, value_states
        if self._seen[layer_idx] == S and self._keeps_all and not self._prior:
            # the layer's first step (a prompt) on a pool that evicts nothing: what it retains is
            # exactly these tokens, so attention takes them as given (as DynamicCache would),
            # not read back: a lossy codec's error enters from the next step on
            self._retained[layer_idx] = S
            layer.keys, layer.values = key_states, value_states
            return key_states, value_states
        keys, values = self._gather(layer_idx, key_states.dtype, key_states.device)
        self._retained[layer_idx] = keys.shape[-2]
        layer.keys, layer.values = keys, values
        return keys, values

    def _append_rows(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, direct: bool,
                     stream: Optional[int]) -> None:
        """Append ``[batch, kv_heads, S, head_dim]`` K/V row by row, each made a contiguous
        ``[S, kv_heads, head_dim]`` in the pool's dtypes (on the host for a host pool)."""
        pool = self.pool
        on_device = self._dev_index >= 0
        for b, seq in enumerate(self.seq_ids):
            k = key_states[b].transpose(0, 1)  # [S, H, D]
            v = value_states[b].transpose(0, 1)
            if on_device:
                k = k.to(self._host_dtype).contiguous()
                v = v.to(self._v_dtype).contiguous()
            else:
                k = k.to("cpu", self._host_dtype).contiguous()
                v = v.to("cpu", self._v_dtype).contiguous()
            if direct:
                pool._append_ptrs(seq, layer_idx, k.data_ptr(), v.data_ptr(), stream)
            else:
                pool.append(seq, layer_idx, k, v)

    def _attend(self, layer_idx: int, query: torch.Tensor, scaling: Optional[float]) -> torch.Tensor:
        """kvp_attend_decode of the step's query ``[batch, q_heads, 1, D]``: ``[batch, 1,
        q_heads, D]`` in the query's dtype."""
        self.fused_calls += 1
        B, Hq, S, D = query.shape
        if B != len(self.seq_ids) or D != self._shape[2] or S != 1 or query.get_device() != self._dev_index:
            raise ValueError(f"KvpoolCache: query [{B}, {Hq}, {S}, {D}] on {query.device} for {len(self.seq_ids)} "
                             f"rows of head_dim {self._shape[2]} on {self._dev}")
        # a contiguous bf16 [B, Hq, 1, D] is the [B][Hq][D] rows kvp_attend_decode reads
        q = query if query.dtype == torch.bfloat16 and query.is_contiguous() else \
            query[:, :, 0, :].to(torch.bfloat16).contiguous()
        ids = self._ids_c
        if ids is None or self._ids_of is not self.seq_ids:  # rows remapped (beam search) or new
            ids = self._ids_c = (ctypes.c_uint64 * B)(*self.seq_ids)
            self._ids_of = self.seq_ids
        out = torch.empty((B, 1, Hq, D), dtype=torch.bfloat16, device=self._dev)  # its rows: [B][Hq][D]
        self.pool._attend_ptrs(layer_idx, ids, B, Hq, q.data_ptr(), out.data_ptr(),
                               float(scaling) if scaling is not None else D ** -0.5,
                               _arrays.cuda_stream(self._dev_index))
        return out if query.dtype == torch.bfloat16 else out.to(query.dtype)

    def _gather(self, layer_idx: int, dtype: torch.dtype, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every row's and head's retained tokens of a layer: one kvp_read per (row, head)."""
        pool = self.pool
        B, H, D = len(self.seq_ids), pool.kv_heads, pool.head_dim
        cap = self._seen[layer_idx]
        if pool.memory == "cuda":
            rd = self._host_dtype
            kb = torch.empty((B, H, cap, D), dtype=rd, device=device)
            vb = torch.empty((B, H, cap, D), dtype=rd, device=device)
        else:
            rd = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
            kb = torch.empty((B, H, cap, D), dtype=rd)
            vb = torch.empty((B, H, cap, D), dtype=rd)
        counts = set()
        if self._direct(kb.device):  # one [cap, D] row block per (row, head) of kb and vb, by address
            code = _arrays.dtype_code(rd, "dtype")
            stream = _arrays.cuda_stream(pool.device) if kb.is_cuda else None
            head_bytes = cap * D * kb.element_size()
            kp, vp = kb.data_ptr(), vb.data_ptr()
            read = pool._read_ptrs
            for b, seq in enumerate(self.seq_ids):
                for h in range(H):
                    off = (b * H + h) * head_bytes
                    counts.add(read(seq, layer_idx, h, code, cap, kp + off, vp + off, stream))
        else:
            for b, seq in enumerate(self.seq_ids):
                for h in range(H):
                    counts.add(pool.read_into(seq, layer_idx, h, kb[b, h], vb[b, h]))
        if len(counts) != 1:
            raise NotImplementedError(
                f"KvpoolCache: the heads of layer {layer_idx} retain different token counts {sorted(counts)} "
                "(a per-head policy): attention over ragged heads needs KvpoolCache(fused=True) and "
                "attn_implementation=\"kvpool\"")
        n = counts.pop()
        keys, values = kb[:, :, :n], vb[:, :, :n]
        if keys.device != device or keys.dtype != dtype:
            keys = keys.to(device=device, dtype=dtype, non_blocking=False)
            values = values.to(device=device, dtype=dtype, non_blocking=False)
        return keys, values

    def _direct(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` are in the pool's memory (its CUDA device, or the host
        for a host pool), so that their addresses may go to the C calls unchecked."""
        if self.pool.memory == "cuda":
            return device.type == "cuda" and (device.index if device.index is not None else 0) == self.pool.device
        return device.type == "cpu"

    def get_seq_length(self, layer_idx: Optional[int] = 0, *args, **kwargs) -> int:
        """Positions seen by the layer (tokens appended, evicted ones included): what RoPE and
        cache_position continue from."""
        layer_idx = layer_idx or 0
        return self._seen[layer_idx] if layer_idx < len(self._seen) else 0

    def get_query_offset(self, layer_idx: Optional[int] = 0, *args, **kwargs) -> int:
        """Position of the first query token: the positions seen."""
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query: Any, layer_idx: Optional[int] = 0, *args, **kwargs) -> Tuple[int, int]:
        """(kv_length, kv_offset) for the attention mask: the tokens the layer retains plus the
        query, and the evicted count as offset (kv index i is position i + offset while nothing
        is evicted between the retained ones; a policy evicting during this step returns fewer,
        and attention slices the mask). ``query`` is the query length or cache_position."""
        layer_idx = layer_idx or 0
        q = query if isinstance(query, int) else int(query.shape[0])
        seen = self.get_seq_length(layer_idx)
        kept = self._retained[layer_idx] if layer_idx < len(self._retained) else 0
        return kept + q, seen - kept

    def get_max_cache_shape(self, layer_idx: Optional[int] = 0, *args, **kwargs) -> int:
        """No maximum length (-1): the pool's budget bounds the bytes, not the tokens."""
        return -1

    def get_max_length(self) -> Optional[int]:
        return None

    def get_usable_length(self, new_seq_length: int, layer_idx: Optional[int] = 0) -> int:
        return self.get_seq_length(layer_idx)

    @property
    def is_sliding(self) -> List[bool]:
        return [False] * self.pool.layers

    @property
    def is_initialized(self) -> bool:
        return bool(self.seq_ids)

    @property
    def seen_tokens(self) -> int:
        return self._seen[0]

    def __len__(self) -> int:
        return self.pool.layers

    def __getitem__(self, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of a layer as last returned by update."""
        return self.layers[layer_idx].keys, self.layers[layer_idx].values

    def __iter__(self):
        for layer in self.layers:
            yield layer.keys, layer.values

    def __repr__(self) -> str:
        return f"KvpoolCache(rows={self.seq_ids}, seen={self._seen[0]}, pool={self.pool!r})"

    # ---- batch surgery through fork ------------------------------------------------------------

    def _remap(self, rows: Sequence[int]) -> None:
        """New batch row i is old row rows[i]: each new row is a fork of its old row, then the
        old sequences are freed."""
        if self._in_step:
            raise RuntimeError("KvpoolCache: batch rows change between steps only")
        old = self.seq_ids
        new = []
        for r in rows:
            child = next(_seq_counter)
            self.pool.fork(old[int(r)], child)
            self._owned.append(child)
            new.append(child)
        for seq in old:
            self.pool.free(seq)
            if seq in self._owned:
                self._owned.remove(seq)
        self.seq_ids = new
        for layer in self.layers:
            layer.keys = layer.values = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues beam beam_idx[i] (kvp_seq_fork shares the sealed blocks)."""
        if self.seq_ids:
            self._remap([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times (beam search / num_return_sequences expansion)."""
        if self.seq_ids:
            self._remap([r for r in range(len(self.seq_ids)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the given rows."""
        if self.seq_ids:
            self._remap([int(i) for i in indices.tolist()])

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("KvpoolCache.crop: truncating a sequence is not supported")

    def reset(self) -> None:
        """Free the rows' sequences and start over (the next update adds new ones)."""
        self.close()
        self._given_ids = None
        L = self.pool.layers
        self._seen, self._retained = [0] * L, [0] * L
        self._in_step = False
        for layer in self.layers:
            layer.reset()
