"""Deterministic KV-like test data: keys with per-channel offsets (a few large outlier
channels, as real keys have), values as noise; the value of (position, head, channel) does
not depend on how the tokens are split into steps."""

import numpy as np


def kv_tokens(pos0: int, n: int, heads: int, dim: int, kv: int, seed: int = 0) -> np.ndarray:
    """float32 [n, heads, dim] for positions pos0 .. pos0+n-1 (kv 0 = K, 1 = V)."""
    pos = np.arange(pos0, pos0 + n, dtype=np.float64)[:, None, None]
    h = np.arange(heads, dtype=np.float64)[None, :, None]
    d = np.arange(dim, dtype=np.float64)[None, None, :]
    # a smooth, position-dependent pseudo-random field (no RNG state: any split gives the same values)
    noise = np.sin(pos * 12.9898 + h * 78.233 + d * 37.719 + seed * 3.1 + kv * 1.7) * 43758.5453
    noise = (noise - np.floor(noise)) * 2.0 - 1.0
    if kv == 0:
        ch = np.where(d % 17 == 0, 6.0, 0.5) * np.sin(d * 0.7 + h)
        return (ch + 1.5 * noise).astype(np.float32)
    return (1.5 * noise).astype(np.float32)
