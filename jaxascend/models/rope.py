"""Rotary position embeddings exactly as transformers' ``modeling_rope_utils`` defines them.

RoPE types (``rope_scaling["rope_type"]``, see :func:`jaxascend.config.validate_rope_scaling`),
with ``dim = int(head_dim * partial_rotary_factor)``, ``j = 0, 2, .., dim - 2`` and the default
inverse frequencies ``1 / theta**(j / dim)``:

* ``default``: as above; attention factor 1.
* ``linear``: default ``/ factor``; 1.
* ``dynamic`` (NTK): default with ``theta * (factor * T / mpe - (factor - 1))**(dim / (dim - 2))``,
  ``T = max(seq_len, max_position_embeddings)``; 1.
* ``yarn``: a ramp between the default frequencies (fast dimensions) and default ``/ factor``
  (slow ones); ``0.1 ln(factor) + 1`` or the mscale ratio or ``attention_factor``.
* ``longrope``: ``1 / (ext * theta**(j / dim))``, ``ext`` = long_factor if ``seq_len > original``
  else short_factor; ``sqrt(1 + ln f / ln original)`` (``f = factor or mpe / original``).
* ``llama3``: wavelength bands kept, divided by factor, or interpolated; 1.

The attention factor multiplies both sin and cos, i.e. q and k (HF's ``attention_scaling``).

dynamic and longrope depend on the sequence length: HF takes ``max(position_ids) + 1`` of each
call. Our sequence length ``T`` is static per compiled step and the trainer feeds positions
``0..T-1`` (``data.seq_len <= max_position_embeddings`` is enforced), so the choice is made from
``T`` at trace time: exactly HF's for those positions (other positions, which the trainer never
passes, still choose by ``T``). dynamic below ``max_position_embeddings``
is therefore the default RoPE; HF's dynamic module also caches the largest length it has seen,
which a fresh HF model (and we) do not. Cached decoding calls over positions ``start..start+t-1``
choose from the traced ``start + t`` instead (``Rotary.angles(positions, length)``), as HF does
with a cache: keys cached before a generation crosses longrope's original length keep the short
factors, in HF as here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxascend.config import validate_rope_scaling


def rotary_dim(head_dim: int, partial_rotary_factor: float = 1.0) -> int:
    """Rotated width of each head, ``int(head_dim * partial_rotary_factor)`` (HF's ``dim``);
    ValueError unless it is even and >= 2."""
    dim = int(head_dim * partial_rotary_factor)
    if dim < 2 or dim % 2:
        raise ValueError(f"model.head_dim: RoPE needs an even rotary dimension >= 2, got {dim} "
                         f"(head_dim {head_dim} x partial_rotary_factor {partial_rotary_factor})")
    return dim


def rope_inverse_frequencies(head_dim: int, theta: float, rope_scaling: Optional[dict], *,
                             seq_len: Optional[int] = None, max_position_embeddings: Optional[int] = None,
                             partial_rotary_factor: float = 1.0) -> np.ndarray:
    """float32 ``[dim // 2]`` inverse frequencies of ``rope_scaling`` (None: default RoPE).

    ``seq_len`` matters for dynamic and longrope only; None gives the values HF's rotary module
    is initialised with (dynamic: the default frequencies; longrope: the short factors).
    dynamic also needs ``max_position_embeddings`` when ``seq_len`` is given.
    """
    scaling = validate_rope_scaling(rope_scaling) or {"rope_type": "default"}
    rope_type = scaling["rope_type"]
    dim = rotary_dim(head_dim, partial_rotary_factor)
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    if rope_type == "dynamic" and seq_len is not None:
        if max_position_embeddings is None:
            raise ValueError("rope_type 'dynamic': needs max_position_embeddings with seq_len")
        if dim == 2:
            raise ValueError("model.head_dim: rope_type 'dynamic' needs a rotary dimension > 2")
        factor, mpe = float(scaling["factor"]), max_position_embeddings
        length = max(seq_len, mpe)
        theta = theta * ((factor * length / mpe) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (theta ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "yarn":
        inv_freq = _yarn(inv_freq, dim, theta, scaling)
    elif rope_type == "longrope":
        long = seq_len is not None and seq_len > scaling["original_max_position_embeddings"]
        ext = np.asarray(scaling["long_factor" if long else "short_factor"], np.float64)
        if ext.shape != inv_freq.shape:
            raise ValueError(f"model.rope_scaling.{'long' if long else 'short'}_factor: needs "
                             f"{dim // 2} numbers (rotary dimension {dim} / 2), got {ext.size}")
        inv_freq = inv_freq / ext
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    return inv_freq.astype(np.float32)


def _yarn(inv_freq: np.ndarray, dim: int, theta: float, scaling: dict) -> np.ndarray:
    """YaRN: dimensions that rotate more than ``beta_fast`` times over the original context keep
    their frequency, those under ``beta_slow`` times are divided by ``factor``, ramp between."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32  # HF: 0 and null both mean "unset"
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _llama3(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """llama3: wavelengths shorter than ``original / high_freq_factor`` are kept, those longer
    than ``original / low_freq_factor`` are divided by ``factor``, and the band between is
    interpolated linearly in ``original / wavelength``."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.where(wavelength < original / high, inv_freq,
                    np.where(wavelength > original / low, inv_freq / factor, interpolated))


def rope_attention_factor(rope_scaling: Optional[dict], max_position_embeddings: Optional[int] = None) -> float:
    """The factor HF multiplies cos and sin by: 1 except for yarn and longrope.

    yarn: ``attention_factor``, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
    when both are set (non-zero), else ``mscale(factor)``, with ``mscale(s, m) = 0.1 m ln s + 1``
    (1 for ``s <= 1``). longrope: ``attention_factor``, else ``sqrt(1 + ln f / ln original)`` with
    ``f = factor or max_position_embeddings / original`` (1 when ``f <= 1``).
    """
    scaling = validate_rope_scaling(rope_scaling) or {"rope_type": "default"}
    rope_type = scaling["rope_type"]
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError(f"rope_type {rope_type!r} without factor: needs max_position_embeddings")
        factor = max_position_embeddings / original
    if rope_type == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


def _frozen(value):
    """Lists (and dicts) as tuples, so the value can be part of a hashable graphdef."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@dataclass(frozen=True)
class Rotary:
    """The RoPE of one attention module, as hashable static module data (part of the graphdef).

        rope = Rotary(head_dim=64, theta=1e6, scaling=Rotary.freeze({"rope_type": "linear", "factor": 8.0}),
                      max_position_embeddings=131072)
        sin, cos = rope.angles(positions)          # float32 [B, T, rotary_dim // 2], scaled
    """

    head_dim: int
    theta: float
    scaling: Optional[tuple] = None  # Rotary.freeze(rope_scaling dict); None: default RoPE
    max_position_embeddings: Optional[int] = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        rotary_dim(self.head_dim, self.partial_rotary_factor)
        validate_rope_scaling(self.scaling_dict)
        rope_attention_factor(self.scaling_dict, self.max_position_embeddings)  # fails early

    @staticmethod
    def freeze(rope_scaling: Optional[dict]) -> Optional[tuple]:
        return None if rope_scaling is None else _frozen(rope_scaling)

    @property
    def scaling_dict(self) -> Optional[dict]:
        if self.scaling is None:
            return None
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.scaling}

    def inverse_frequencies(self, seq_len: int) -> np.ndarray:
        """float32 ``[rotary_dim // 2]`` for a call over positions ``0..seq_len-1``."""
        return rope_inverse_frequencies(self.head_dim, self.theta, self.scaling_dict, seq_len=seq_len,
                                        max_position_embeddings=self.max_position_embeddings,
                                        partial_rotary_factor=self.partial_rotary_factor)

    @property
    def attention_factor(self) -> float:
        return rope_attention_factor(self.scaling_dict, self.max_position_embeddings)

    def angles(self, positions: jax.Array, length: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
        """``(sin, cos)`` for int positions ``[B, T]``, both scaled by the attention factor. The
        frequencies are chosen from the static ``T`` (see the module docstring), or, when
        ``length`` is given, from that traced int scalar: a cached decoding call over positions
        ``start..start+T-1`` passes ``start + T``, as transformers chooses from
        ``max(position_ids) + 1``."""
        if length is None:
            inv_freq = self.inverse_frequencies(positions.shape[1])
        else:
            inv_freq = self.inverse_frequencies_at(length)
        return rope_angles(positions, inv_freq, self.attention_factor)

    def inverse_frequencies_at(self, length: jax.Array) -> jax.Array:
        """float32 ``[rotary_dim // 2]`` for a call whose sequence length is the traced int scalar
        ``length``: longrope switches to its long factors past the original length; dynamic
        rescales theta past ``max_position_embeddings`` (in float32, as transformers does)."""
        scaling = self.scaling_dict or {}
        base = jnp.asarray(self.inverse_frequencies(1))  # short factors; dynamic's unscaled ones
        if scaling.get("rope_type") == "longrope":
            original = scaling["original_max_position_embeddings"]
            return jnp.where(length > original, jnp.asarray(self.inverse_frequencies(original + 1)), base)
        if scaling.get("rope_type") == "dynamic":
            mpe, factor = self.max_position_embeddings, float(scaling["factor"])
            dim = rotary_dim(self.head_dim, self.partial_rotary_factor)
            grown = jnp.maximum(length, mpe).astype(jnp.float32)
            theta = self.theta * (factor * grown / mpe - (factor - 1)) ** (dim / (dim - 2))
            scaled = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
            return jnp.where(length > mpe, scaled, base)
        return base


def rope_angles(positions: jax.Array, inv_freq, attention_factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """``(sin, cos)``, each float32 ``[B, T, len(inv_freq)]``, for int positions ``[B, T]``,
    multiplied by ``attention_factor`` (yarn/longrope; HF scales cos and sin the same way)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if attention_factor != 1.0:
        sin, cos = sin * jnp.float32(attention_factor), cos * jnp.float32(attention_factor)
    return sin, cos


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotates ``x [B, T, N, H]`` in the half-split layout of Hugging Face's ``rotate_half``.

    Partial rotary (``2 * sin.shape[-1] < H``, Phi-3's ``partial_rotary_factor``): only the first
    ``2 * sin.shape[-1]`` dimensions of each head rotate; the rest pass through unchanged.
    """
    rotated = 2 * sin.shape[-1]
    x32 = x.astype(jnp.float32)
    x_rot, x_pass = x32[..., :rotated], x32[..., rotated:]
    x1, x2 = jnp.split(x_rot, 2, axis=-1)
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x_pass], axis=-1)
    return out.astype(x.dtype)
