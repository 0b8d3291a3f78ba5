"""Fused host AdamW: one pass over fp32 master weights and moments and an fp16/bf16/fp32
gradient, writing the new compute-dtype parameters (ffi/optim_adam.cc).

Two entry points run the same native kernel and agree bit for bit:

* :func:`fused_adamw_update` -- jax arrays, an XLA FFI call usable under ``jit``; master, m and
  v are aliased to their outputs, so donating them updates them in place.
* :func:`fused_adamw_update_numpy` -- numpy arrays updated in place (views into the SSD
  arena when streaming), GIL released, ``threads`` workers of a persistent pool. It also takes
  a bfloat16 master (``master_format``, :mod:`jaxascend.optim.master_codes`); the FFI target
  keeps a float32 one.

The arithmetic is ``optax.adamw``'s (``scale_by_adam`` with ``eps_root=0``,
``add_decayed_weights``, ``scale_by_learning_rate``, ``apply_updates``), each operation rounded
separately::

    g = grad.astype(f32) * grad_scale
    m = (1 - b1) * g + b1 * m
    v = (1 - b2) * (g * g) + b2 * v
    update = (m * (1 / bc1)) / (sqrt(v * (1 / bc2)) + eps) + weight_decay * master
    master = master - lr * update;  params = master.astype(param_dtype)

(optax writes ``m / bc1``; XLA's algebraic simplifier turns a division by a broadcast scalar
into a multiplication by its float32 reciprocal, and the kernel does what XLA runs.)

with ``bc1 = 1 - b1**(count + 1)`` and ``bc2 = 1 - b2**(count + 1)`` computed as optax does.
Hyperparameters reach the kernel as a float32[10] runtime operand (:meth:`AdamHyperParams.scalars`),
so a new learning rate never recompiles a jitted step, provided it is passed as an array
(a Python float inside ``jit`` is a compile-time constant). Weight decay is per call, so per
leaf: a leaf that does not decay (``optimizer.weight_decay_mask``) gets the operand with
``weight_decay`` 0 (:meth:`~jaxascend.optim.AdamWSettings.scalars` makes one row per leaf), which
is exactly optax's masked ``add_decayed_weights`` (``update + 0 * master == update``).

Example::

    hp = AdamHyperParams(lr=schedule(count), weight_decay=0.01, count=count)
    master, m, v, params = fused_adamw_update(master, m, v, grad, hp, param_dtype=jnp.bfloat16)
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from jaxascend.native import extension as _native
from jaxascend.native import ffi_call
from jaxascend.optim.master_codes import FLOAT32_MASTER, MasterFormat
from jaxascend.optim.state_codes import StateFormat

FLOAT32_STATE = StateFormat()

SUPPORTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
SCALAR_COUNT = 10  # layout of the scalars operand: see AdamHyperParams.scalars and ffi/optim_adam.h
WEIGHT_DECAY_SLOT = 4  # where weight_decay sits in it (0 for a leaf that does not decay)

ArrayLike = Union[jax.Array, np.ndarray, float, int]


class AdamHyperParams(NamedTuple):
    """Runtime hyperparameters of one AdamW update (each a Python number or a scalar array)."""

    lr: ArrayLike  # learning rate of this update, e.g. schedule(count)
    b1: ArrayLike = 0.9
    b2: ArrayLike = 0.999
    eps: ArrayLike = 1e-8
    weight_decay: ArrayLike = 1e-4  # optax.adamw's default; decoupled, multiplied by lr
    grad_scale: ArrayLike = 1.0  # loss-scale unscale times clipping factor, applied to grad
    count: ArrayLike = 0  # updates applied before this one (optax's state count): int32

    def bias_corrections(self) -> tuple[jax.Array, jax.Array]:
        """``(1 - b1**t, 1 - b2**t)`` in float32 with ``t = count + 1`` (saturating), computed
        with the same jnp operations as ``optax.scale_by_adam``."""
        count_inc = optax.safe_increment(jnp.asarray(self.count, jnp.int32))
        return _bias_correction(self.b1, count_inc), _bias_correction(self.b2, count_inc)

    def scalars(self) -> jax.Array:
        """The kernel's float32[10] operand: ``[lr, b1, b2, eps, weight_decay, grad_scale,
        bc1, bc2, 1-b1, 1-b2]``.

        ``1 - b1`` is formed before rounding to float32 (in double for Python floats), as
        optax's ``(1 - decay) * g`` does, rather than from the rounded ``b1``.
        """
        bc1, bc2 = self.bias_corrections()
        values = (self.lr, self.b1, self.b2, self.eps, self.weight_decay, self.grad_scale,
                  bc1, bc2, 1 - _decay(self.b1), 1 - _decay(self.b2))
        return jnp.stack([jnp.asarray(x, jnp.float32) for x in values])


@functools.partial(jax.jit, inline=True)
def _bias_correction(decay, count):
    """``1 - decay**count`` as ``optax.tree.bias_correction`` computes it: under ``jit`` with
    ``decay`` traced, so XLA emits the power and the subtraction the same way (run op by op,
    the result can differ in the last bit)."""
    return 1 - decay**count


def _decay(x: ArrayLike):
    """Python numbers stay Python (double arithmetic, like optax's constants); others -> f32."""
    return x if isinstance(x, (int, float)) else jnp.asarray(x, jnp.float32)


def _scalars_of(hparams) -> jax.Array | np.ndarray:
    if isinstance(hparams, AdamHyperParams):
        return hparams.scalars()
    shape = getattr(hparams, "shape", None)
    if shape != (SCALAR_COUNT,) or getattr(hparams, "dtype", None) != np.float32:
        raise ValueError(
            f"adamw: hparams must be an AdamHyperParams or its float32[{SCALAR_COUNT}] "
            f"scalars(), got {type(hparams).__name__} with shape {shape}")
    return hparams


def _check_same_size(named: dict, n: int) -> None:
    for name, array in named.items():
        if array.size != n:
            raise ValueError(f"adamw: {name} has {array.size} elements but master has {n}")


def _check_dtype(name: str, dtype, allowed) -> None:
    if np.dtype(dtype) not in [np.dtype(d) for d in allowed]:
        names = ", ".join(np.dtype(d).name for d in allowed)
        raise ValueError(f"adamw: {name} dtype {np.dtype(dtype).name} is not supported ({names})")


def fused_adamw_update(master: jax.Array, m: jax.Array, v: jax.Array, grad: jax.Array,
                       hparams: AdamHyperParams | jax.Array, *, param_dtype,
                       threads: int = 1) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One AdamW update through the XLA FFI kernel; returns ``(master, m, v, params)``.

    ``master``, ``m``, ``v``: float32, any shape; ``grad``: same number of elements, float16,
    bfloat16 or float32. ``params`` has master's shape and ``param_dtype`` (rounded to
    nearest even). Outputs 0-2 alias inputs 0-2: donate them (``jit(...,
    donate_argnums=...)``) to update in place. ``threads`` > 1 splits the array over the
    kernel's own compute pool (it is a compile-time attribute; the hyperparameters are not).
    """
    _check_dtype("param", param_dtype, SUPPORTED_DTYPES)
    _check_dtype("grad", grad.dtype, SUPPORTED_DTYPES)
    for name, array in (("master", master), ("m", m), ("v", v)):
        _check_dtype(name, array.dtype, (jnp.float32,))
    _check_same_size({"m": m, "v": v, "grad": grad}, master.size)
    scalars = jnp.asarray(_scalars_of(hparams), jnp.float32)
    state_type = jax.ShapeDtypeStruct(master.shape, jnp.float32)
    out_types = (state_type, state_type, state_type,
                 jax.ShapeDtypeStruct(master.shape, param_dtype))
    call = ffi_call("jaxascend_adamw", out_types, vmap_method="sequential",
                    input_output_aliases={0: 0, 1: 1, 2: 2})
    return call(master, m.reshape(master.shape), v.reshape(master.shape), grad, scalars,
                threads=np.int64(threads))


def _dtype_name(array: np.ndarray, name: str) -> str:
    dtype = array.dtype
    if dtype == np.float32:
        return "float32"
    if dtype == np.float16:
        return "float16"
    if dtype == ml_dtypes.bfloat16:
        return "bfloat16"
    raise ValueError(f"adamw: {name} dtype {dtype} is not supported (float16, bfloat16, float32)")


_BF16_BITS = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16))


def _check_in_place(named: dict, updated: tuple) -> None:
    """Every array of ``named`` is a numpy array; those named in ``updated`` are writeable."""
    for name, array in named.items():
        if not isinstance(array, np.ndarray):
            raise TypeError(f"adamw: {name} must be a numpy array, got {type(array).__name__}")
    for name in updated:
        if not named[name].flags.writeable:
            raise ValueError(f"adamw: {name} is read-only; it is updated in place")


def _check_master(master: np.ndarray, params_out: np.ndarray, comp, master_format: MasterFormat) -> None:
    """The master's dtype, its params' and its companion's for ``master_format`` (dtypes and
    presence; sizes and writeability are checked with the other arrays)."""
    if not isinstance(master_format, MasterFormat):
        raise TypeError(f"adamw: master_format must be a MasterFormat, got {type(master_format).__name__}")
    if master_format.dtype == "float32":
        if master.dtype != np.float32:
            raise ValueError(f"adamw: master must be float32, got {master.dtype} "
                             "(a bfloat16 master needs master_format=MasterFormat('bfloat16', ...))")
    else:
        if master.dtype not in _BF16_BITS:
            raise ValueError(f"adamw: a bfloat16 master must be bfloat16 or its uint16 bits, got {master.dtype}")
        if params_out.dtype != ml_dtypes.bfloat16:
            raise ValueError(f"adamw: a bfloat16 master needs bfloat16 params_out, got {params_out.dtype}")
    if master_format.compensated and comp is None:
        raise ValueError("adamw: a compensated bfloat16 master needs comp (uint16, one per weight)")
    if not master_format.compensated and comp is not None:
        raise ValueError(f"adamw: comp is only for a compensated bfloat16 master, not a {master_format.dtype} "
                         f"{master_format.rounding} one")
    if comp is not None and comp.dtype not in _BF16_BITS:
        raise ValueError(f"adamw: comp must be uint16 (or bfloat16, taken as its bits), got {comp.dtype}")


def fused_adamw_update_numpy(master: np.ndarray, m: np.ndarray, v: np.ndarray, grad: np.ndarray,
                             params_out: np.ndarray, hparams: AdamHyperParams | np.ndarray, *,
                             threads: int = 1, isa: str = "auto", state: StateFormat = FLOAT32_STATE,
                             m_scale: Optional[np.ndarray] = None, v_scale: Optional[np.ndarray] = None,
                             seed: int = 0, index: int = 0, master_format: MasterFormat = FLOAT32_MASTER,
                             comp: Optional[np.ndarray] = None) -> None:
    """One AdamW update in place on C-contiguous numpy arrays; bitwise equal to
    :func:`fused_adamw_update`.

    ``master``: float32, updated in place; ``m``, ``v``: the moments in ``state``'s format
    (:mod:`jaxascend.optim.state_codes`), updated in place: float32 by default, bfloat16 (as
    ``ml_dtypes.bfloat16`` or its uint16 bits), or int8 codes (uint8) with their float32
    ``m_scale``/``v_scale``, one per ``state.block`` elements; ``grad``: float16, bfloat16
    (``ml_dtypes``) or float32; ``params_out``: receives the new master in its own dtype
    (float16, bfloat16 or float32). All hold the same number of elements and must not share
    memory. ``hparams``: an :class:`AdamHyperParams`, or its ``np.asarray(hp.scalars())``
    computed once per step when the step calls this for many chunks. ``threads``: 1 runs on
    the calling thread; more use the persistent compute pool. ``isa``: 'auto'
    (``JAXASCEND_ADAM_ISA`` or the best the CPU has), 'scalar', 'avx2' or 'avx512' (int8 state
    runs its AVX2 variant for 'avx512'). ``state.rounding`` "stochastic" rounds ``v`` (and int8 ``m``) with the
    bits of element ``i`` hashed from ``seed`` (:func:`~jaxascend.optim.state_codes.chunk_seed`)
    and ``index + i`` (its index in its layer); see :mod:`jaxascend.optim.state_codes`. The GIL
    is released while the kernel runs.

    ``master_format`` :class:`~jaxascend.optim.master_codes.MasterFormat` ("bfloat16"): ``master``
    is bfloat16 (or its uint16 bits), ``params_out`` bfloat16 (it gets the new master's bits and
    may be ``master`` itself); "compensated" also updates ``comp`` (uint16, one per weight: the
    float32 master's low halves; a bfloat16 array is taken as its bits) in place, "stochastic"
    draws its bits from ``seed`` and ``index`` too. See :mod:`jaxascend.optim.master_codes`.
    """
    named = {"master": master, "m": m, "v": v, "grad": grad, "params_out": params_out}
    updated = ("master", "m", "v", "params_out")
    if state.dtype == "int8":
        named.update(m_scale=m_scale, v_scale=v_scale)
        updated += ("m_scale", "v_scale")
    if comp is not None:
        named.update(comp=comp)
        updated += ("comp",)
    _check_in_place(named, updated)
    _check_master(master, params_out, comp, master_format)
    moment = {"float32": (np.dtype(np.float32),), "bfloat16": _BF16_BITS, "int8": (np.dtype(np.uint8),)}[state.dtype]
    for name in ("m", "v"):
        if named[name].dtype not in moment:
            raise ValueError(f"adamw: {name} must be {moment[0]} for {state.dtype} state, got {named[name].dtype}")
    _check_same_size({k: a for k, a in named.items() if k in ("m", "v", "grad", "params_out", "comp")}, master.size)
    grad_dtype = _dtype_name(grad, "grad")
    param_dtype = _dtype_name(params_out, "params_out")
    scalars = np.ascontiguousarray(np.asarray(_scalars_of(hparams)), dtype=np.float32)
    # 16-bit floats travel as uint16 views (nanobind has no bfloat16 numpy dtype).
    as_raw = lambda a: a.view(np.uint16) if a is not None and a.dtype.itemsize == 2 else a  # noqa: E731
    _native.adamw_update(as_raw(master), as_raw(m), as_raw(v), as_raw(grad), as_raw(params_out), scalars,
                         grad_dtype=grad_dtype, param_dtype=param_dtype, threads=threads, isa=isa,
                         state_dtype=state.dtype, m_scale=m_scale if state.dtype == "int8" else None,
                         v_scale=v_scale if state.dtype == "int8" else None, block=state.block,
                         rounding=state.rounding, rounding_seed=int(seed) & 0xFFFFFFFF,
                         rounding_index=int(index), master_dtype=master_format.dtype,
                         master_rounding=master_format.rounding, comp=as_raw(comp))


def adamw_reference(master: jax.Array, m: jax.Array, v: jax.Array, grad: jax.Array,
                    hparams: AdamHyperParams | jax.Array, *,
                    param_dtype) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pure-``jnp`` AdamW with the kernel's formula and operands; returns
    ``(master, m, v, params)``. XLA may fuse multiply-adds, so it can differ from the kernel
    in the last bit."""
    s = jnp.asarray(_scalars_of(hparams), jnp.float32)
    lr, b1, b2, eps, wd, grad_scale, bc1, bc2, omb1, omb2 = (s[i] for i in range(SCALAR_COUNT))
    g = grad.astype(jnp.float32) * grad_scale
    m = omb1 * g + b1 * m
    v = omb2 * (g * g) + b2 * v
    update = (m * (1 / bc1)) / (jnp.sqrt(v * (1 / bc2)) + eps) + wd * master
    master = master - lr * update
    return master, m, v, master.astype(param_dtype)


def supported_isas() -> list[str]:
    """Kernel variants this CPU can run (``'scalar'`` always; ``'avx2'``, ``'avx512'``)."""
    return list(_native.adamw_supported_isas())


def default_isa() -> str:
    """The variant ``isa='auto'`` and the FFI path run (``JAXASCEND_ADAM_ISA`` if set)."""
    return _native.adamw_default_isa()
