"""The training attention through ``jax.nn.dot_product_attention``: cuDNN's fused flash attention
on a GPU, wherever its mask features cover the call.

    out = fused_attention(q, k, v, sliding_window=512, scale=0.1, is_sliding=flag)  # None: not taken

What the fused call covers, and how our arguments map onto it (layout ``BTNH`` both sides):

- causal attention: ``is_causal=True``;
- grouped-query heads: ``k, v [B,S,K,H]`` with ``N % K == 0`` go in as they are;
- ``scale``: passed as is (ours defaults to ``H ** -0.5``, as does jax's);
- a sliding window of ``w`` keys (query ``t`` sees ``s`` iff ``t - w < s <= t``):
  ``local_window_size=(w - 1, 0)``, which cuDNN turns into its window length ``w``. The window
  is static; Gemma 3's per-layer ``is_sliding`` is traced inside the layer scan, so that case is
  a ``lax.cond`` between the windowed and the plain causal call;
- packed rows (``segment_ids``) are *not* covered: jax's call takes only per-row lengths
  (``query_seq_lengths`` / ``key_value_seq_lengths``, padding at the end of a row) or a dense
  ``[T, S]`` mask, which is what the fused kernel exists to avoid;
- cuDNN takes float16 and bfloat16 only, and a head width that is a multiple of 8 up to 128
  (256 from Hopper on); jax checks the latter when the call is traced. (The XLA kernel of the
  switch below takes float32 and bfloat16: jax's float16 dot does not compile on a CPU.)

Where it is not covered, or jax refuses the call when tracing it (no cuDNN, an unsupported
shape), the caller falls back to the pure-JAX attention and one ``note:`` line names the reason,
once per reason and process (the layer scan traces a layer once, but a run traces several steps).

Which kernel, from the backend and ``JAXASCEND_ATTENTION_BACKEND`` (read when a step is traced):
``auto`` (default) cuDNN on a GPU and nothing elsewhere; ``gpu`` the GPU branch on any backend,
its kernel being XLA's ``implementation="xla"`` off a GPU, so that a CPU runs the selection and
the argument mapping that a GPU runs; ``jax`` never (the pure-JAX paths, also on a GPU).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

BACKEND_ENV = "JAXASCEND_ATTENTION_BACKEND"
BACKENDS = ("auto", "gpu", "jax")
_REFUSALS = (NotImplementedError, RuntimeError)  # jax's "not supported here" / "cuDNN is not detected"


@dataclass(frozen=True)
class FusedKernel:
    """The ``implementation`` of ``jax.nn.dot_product_attention`` a call would use."""

    implementation: str  # "cudnn" on a GPU; "xla" for the GPU branch run elsewhere
    dtypes: tuple[str, ...]  # the input dtypes it takes


CUDNN = FusedKernel("cudnn", ("float16", "bfloat16"))
# jax's XLA implementation asks for an F16_F16_F32 dot on float16, which the CPU does not compile.
XLA = FusedKernel("xla", ("float32", "bfloat16"))


def fused_kernel() -> Optional[FusedKernel]:
    """The fused kernel of this backend and ``JAXASCEND_ATTENTION_BACKEND``, None: pure JAX."""
    choice = os.environ.get(BACKEND_ENV, "auto")
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={choice!r}: expected one of {', '.join(BACKENDS)}")
    if choice == "jax":
        return None
    if on_gpu():
        return CUDNN
    return XLA if choice == "gpu" else None


def on_gpu() -> bool:
    """True when JAX computes on a GPU (where cuDNN may be)."""
    return jax.default_backend() == "gpu"


def uncovered(kernel: FusedKernel, q: jax.Array, segment_ids: Optional[jax.Array]) -> Optional[str]:
    """Why ``kernel`` cannot compute this call (None: it can); the rest jax checks when tracing."""
    if segment_ids is not None:
        return (f"{kernel.implementation} attention has no mask for packed rows (segment_ids) short of a "
                "[T, S] one")
    if q.dtype.name not in kernel.dtypes:
        return f"{kernel.implementation} attention takes {' or '.join(kernel.dtypes)}, not {q.dtype.name}"
    return None


_noted: set[str] = set()
_noted_lock = threading.Lock()


def note_fallback(reason: str) -> None:
    """One ``note:`` line (a log record the CLIs print as one) per reason and process."""
    with _noted_lock:
        if reason in _noted:
            return
        _noted.add(reason)
    log.warning("attention: %s; using the pure-JAX attention of model.attention (set %s=jax to choose it "
                "without this note)", reason, BACKEND_ENV)


def _call(kernel: FusedKernel, q, k, v, scale: float, window: Optional[int]) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        local_window_size=None if window is None else (window - 1, 0),
                                        implementation=kernel.implementation)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, sliding_window: Optional[int] = None,
                    scale: Optional[float] = None, is_sliding: Optional[jax.Array] = None,
                    segment_ids: Optional[jax.Array] = None) -> Optional[jax.Array]:
    """``layers.causal_attention``'s result (same arguments, ``[B,T,N,H]`` in q's dtype) through
    ``jax.nn.dot_product_attention``, or None where this backend has no fused kernel or the
    kernel does not cover the call (see the module doc; a note names the reason once)."""
    kernel = fused_kernel()
    if kernel is None:
        return None
    reason = uncovered(kernel, q, segment_ids)
    if reason is not None:
        note_fallback(reason)
        return None
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    try:
        if sliding_window is None or is_sliding is None:
            return _call(kernel, q, k, v, scale, sliding_window)
        # The window's use is a traced per-layer flag: both calls are static, one runs.
        return jax.lax.cond(is_sliding, lambda: _call(kernel, q, k, v, scale, sliding_window),
                            lambda: _call(kernel, q, k, v, scale, None))
    except _REFUSALS as err:  # raised while tracing, before anything runs
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        note_fallback(f"jax.nn.dot_product_attention(implementation={kernel.implementation!r}) refused the "
                      f"call: {message}")
        return None
