"""16-bit master weights: the formats of the fused kernel's master and their numpy reference.

The master is what AdamW updates; the compute weights (``params_out``) are rounded from it. It is
stored as:

* ``float32`` (:data:`FLOAT32_MASTER`, the default): 4 B/param, plus the compute weights apart;
* ``bfloat16``: 2 B/param, and the compute weights *are* the master (``params_out`` must be
  bfloat16 and receives its bits; it may be the master's own buffer). Rounded to nearest, a
  bfloat16 weight stops moving when ``lr * u`` is under half its ulp, 2**-9 to 2**-8 of the
  weight: at a fine-tuning learning rate (1e-6, weights near 1) no step lands. So the rounding
  (:data:`MASTER_ROUNDINGS`) is one of

  - ``"compensated"``: a 16-bit companion ``comp`` (2 B/param more) holds the low half of the
    float32 master, so master and comp together *are* the float32 master and every step is the
    float32 master's, bit for bit, but for one float32 ulp at a tie (:func:`join_master`,
    :func:`split_master`);
  - ``"stochastic"``: rounded up with the probability of the dropped fraction, so each weight's
    expected value follows the float32 update; no companion, but the noise of one random
    rounding per step.

A float32 master has no rounding: :class:`MasterFormat` normalises its ``rounding`` to
``"nearest"``.

With ``u`` the update of :mod:`jaxascend.optim.fused_adam` (``m_hat / (sqrt(v_hat) + eps) +
weight_decay * x``) and every operation rounded to float32 separately::

    stochastic:   x = widen(master)
                  y = x - lr * u                     # the float32 master's arithmetic
                  master = bf16_round_stochastic(y, master_rounding_bits(seed, index, n))
    compensated:  x = join_master(master, comp)      # float32 bits (master << 16) + int16(comp)
                  y = x - lr * u
                  master, comp = split_master(y)     # (u + 0x8000) >> 16, u & 0xffff

The bfloat16 half is ``y`` to nearest, ties to even: the float32 master's compute weights, bit for
bit. ``comp`` read as int16 is ``u - (master << 16)`` with ``u = bits(y)``, but for a tie that
rounds down (``bits(y) & 0x1ffff == 0x8000``: an even high half, the low half exactly half an ulp),
where the offset would be +0x8000, one past int16: there ``u = bits(y) - 1``, the master held one
float32 ulp toward zero (about one weight in 2**17 a step). A tie that rounds up is exact
(-0x8000). So the compute weights are always float32's, and the master float32's but for those
ulps, which move it 2**-24 of itself where ties away from zero would move its compute weights by
2**-8 of themselves (as this master did before; measured in docs/bench_master_quality.md).

Why not Kahan summation with a bfloat16 companion (optimi's and anyprecision AdamW's ``comp =
bf16(step - (new - x))``), at the same 4 B/param? Its companion is rounded to 8 bits too, so it
stalls in turn once ``lr * |u|`` is under half *its* ulp, i.e. below about 2**-18 of the weight:
at lr 1e-6 on weights near 1 the companion stops at 2**-11, short of the 2**-9 that would move
the master, which then never moves (measured over 6000 steps: float32 drifts 5.7e-3, Kahan's
master + comp 4.9e-4, its master 0). The split has no such regime.

The master's random bits are a hash of their own, :func:`master_rounding_bits`: the top 16 bits of
:func:`~jaxascend.optim.state_codes.rounding_hash` under the salted seed ``seed ^ 0x6A09E667``,
so the moments' bits (v: ``h >> 16``, int8 m: ``h & 0xffff``) are the float32 master's and
either master composes with every moment format and rounding. :func:`adamw_reference_master` is
the whole update in numpy, which the kernel (ffi/optim_adam.h) matches bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxascend.optim import state_codes as sc

MASTER_DTYPES = sc.MASTER_DTYPES  # ("float32", "bfloat16"): optimizer.master_dtype
# Of a bfloat16 master in the kernel; float32's is "nearest". (optimizer.master_rounding's "nearest",
# an ablation, runs as "compensated" with its companion dropped after every update.)
MASTER_ROUNDINGS = ("compensated", "stochastic")
MASTER_SEED_SALT = 0x6A09E667  # the master's hash seed is seed ^ MASTER_SEED_SALT


@dataclass(frozen=True)
class MasterFormat:
    """How the master weights are stored: ``dtype`` one of :data:`MASTER_DTYPES`; ``rounding``
    one of :data:`MASTER_ROUNDINGS` for bfloat16, normalised to ``"nearest"`` for float32 (which
    is not rounded). Unlike the moments' rounding it is part of the stored format: a compensated
    master has a companion array.

    >>> MasterFormat("bfloat16", "stochastic").itemsize
    2
    """

    dtype: str = "float32"
    rounding: str = "compensated"

    def __post_init__(self):
        if self.dtype not in MASTER_DTYPES:
            raise ValueError(f"master dtype {self.dtype!r} is not one of {', '.join(MASTER_DTYPES)}")
        if self.dtype == "float32":
            if self.rounding not in MASTER_ROUNDINGS + ("nearest",):
                raise ValueError(f"master rounding {self.rounding!r} is not one of "
                                 f"{', '.join(MASTER_ROUNDINGS + ('nearest',))}")
            object.__setattr__(self, "rounding", "nearest")
        elif self.rounding not in MASTER_ROUNDINGS:
            raise ValueError(f"master rounding {self.rounding!r} is not one of {', '.join(MASTER_ROUNDINGS)} "
                             "(a bfloat16 master rounded to nearest stops moving at small learning rates)")

    @classmethod
    def of_state(cls, fmt: sc.StateFormat) -> "MasterFormat":
        """The kernel's format of ``fmt``'s master (``optimizer.master_rounding: nearest``, the
        ablation, runs as compensated with a zero companion, dropped after every update)."""
        nearest = fmt.master_rounding == "nearest"
        return cls(fmt.master, "compensated" if nearest else fmt.master_rounding)

    @property
    def compensated(self) -> bool:
        """Whether the master has a companion (``comp``: the float32 master's low half)."""
        return self.rounding == "compensated"

    @property
    def stochastic(self) -> bool:
        """Whether the master is rounded stochastically (so the kernel needs a seed and an index)."""
        return self.rounding == "stochastic"

    @property
    def itemsize(self) -> int:
        """Bytes of one master weight."""
        return 4 if self.dtype == "float32" else 2

    @property
    def companion_itemsize(self) -> int:
        """Bytes of one element of the companion (0: none)."""
        return 2 if self.compensated else 0

    def numpy_dtype(self) -> np.dtype:
        """The master's stored dtype (bfloat16 as ``ml_dtypes.bfloat16``; the kernel also takes its uint16 bits)."""
        if self.dtype == "float32":
            return np.dtype(np.float32)
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)

    def describe(self) -> dict:
        """What a checkpoint records of the format."""
        if self.dtype == "float32":
            return {"master_dtype": "float32"}
        out = {"master_dtype": "bfloat16", "master_rounding": self.rounding}
        if self.compensated:
            out["comp"] = "low 16 bits of the float32 master: float32 bits = (master << 16) + int16(comp)"
        return out


FLOAT32_MASTER = MasterFormat()


def master_rounding_bits(seed: int, index: int, n: int) -> np.ndarray:
    """A bfloat16 master's 16 random bits (uint32, below 2**16) of elements ``index .. index + n
    - 1`` in a layer whose chunk seed is ``seed``: ``rounding_hash(seed ^ 0x6A09E667, ...) >> 16``."""
    return sc.rounding_hash((int(seed) ^ MASTER_SEED_SALT) & 0xFFFFFFFF, index, n) >> np.uint32(16)


def split_master(x) -> tuple[np.ndarray, np.ndarray]:
    """A compensated master (uint16 bits, uint16 companion) holding float32 ``x``: ``x`` to nearest
    bfloat16, ties to even (a NaN stays a quiet NaN), and its low 16 bits; exact but where a tie
    rounds down (``bits & 0x1ffff == 0x8000``), held one ulp toward zero (see the top)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    u = u - ((u & np.uint32(0x1FFFF)) == np.uint32(0x8000)).astype(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    with np.errstate(over="ignore"):
        high = (u + np.uint32(0x8000)) >> np.uint32(16)
    master = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), high).astype(np.uint16)
    return master, (u & np.uint32(0xFFFF)).astype(np.uint16)


join_master = sc.join_master  # the float32 value of a compensated master (its bits and companion)


def adamw_reference_master(master, m, v, grad, scalars, fmt: sc.StateFormat, master_format: MasterFormat,
                           comp=None, m_scale=None, v_scale=None, seed: int = 0, index: int = 0):
    """One AdamW update of flat arrays with the master in ``master_format``, in numpy, as the fused
    kernel computes it.

    ``master``: float32, or bfloat16 bits (uint16, or ``ml_dtypes.bfloat16``); ``comp``: the
    compensated master's companion (uint16, the float32 master's low halves), else None; the rest as
    :func:`~jaxascend.optim.state_codes.adamw_reference` takes them (``seed``/``index`` also draw
    a stochastic master's bits). Returns ``(master, m, v, m_scale, v_scale, comp)``: master as
    float32 or uint16 bits, comp None unless compensated. The compute weights of a bfloat16 master
    are its bits."""
    if master_format.dtype == "float32":
        return sc.adamw_reference(master, m, v, grad, scalars, fmt, m_scale, v_scale, seed, index) + (None,)
    bits = np.asarray(master).view(np.uint16).reshape(-1)
    if master_format.compensated:
        if comp is None:
            raise ValueError("adamw: a compensated bfloat16 master needs comp")
        x = join_master(bits, np.asarray(comp).reshape(-1))
    else:
        x = sc.bf16_widen(bits)
    y, m_out, v_out, ms, vs = sc.adamw_reference(x, m, v, grad, scalars, fmt, m_scale, v_scale, seed, index)
    if master_format.compensated:
        new, comp_out = split_master(y)
        return new, m_out, v_out, ms, vs, comp_out
    return sc.bf16_round_stochastic(y, master_rounding_bits(seed, index, x.size)), m_out, v_out, ms, vs, None
