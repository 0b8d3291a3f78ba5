"""Compressed AdamW moments: the formats of ``optimizer.state_dtype`` and their numpy reference.

The fp32 master weights always stay fp32; ``m`` and ``v`` are stored as:

* ``float32``: as they are (12 B/param of state with the master);
* ``bfloat16``: each narrowed to bfloat16 (8 B/param), as the format's ``rounding`` says (below);
* ``int8``: one byte per element plus one float32 scale per block of ``block`` elements
  (256-2048; 6 B/param + 8/block), as in Dettmers et al.'s block-wise 8-bit optimizers, with a
  *dynamic exponent* map rather than a linear one (numbers in docs/architecture.md, "Compressed
  optimizer state"):

  - ``m`` (signed): a sign bit and a 7-bit **E4M3** code of ``|m| / scale`` (4 exponent bits, 3
    mantissa bits, subnormals): 15 binades below the block's largest value at 3 bits each;
  - ``v`` (non-negative): an 8-bit **E4M4** code of ``sqrt(v) / scale``. The update divides by
    ``sqrt(v)``, so the code spends its precision there (half an ulp: 1.6 % of sqrt(v)) and its
    range covers 2**-38 of the block's largest ``v``: a ``v`` that underflows to zero while its
    ``m`` does not (the division by ``eps`` that wrecks a linear map) needs a gradient history
    2**19 times smaller than the block's largest;
  - the scale of a block is the power of two just above its largest magnitude, so scaling is
    exact and a code is a few integer operations on the float's bits (round to nearest even).

  Codes: ``code(r)`` for ``0 <= r < 1`` with ``M`` mantissa bits: ``r < 2**-15`` (subnormal)
  is ``round(r * 2**(15 + M))``; else ``((bits(r) + 2**(22 - M) - 1 + lsb) >> (23 - M)) -
  (111 << M)``, saturated at the largest code; ``decode(c)`` is ``c * 2**-(15 + M)`` for
  ``c < 2**M``, else ``float_from_bits((c + (111 << M)) << (23 - M))``.

Rounding (``StateFormat.rounding``, ``optimizer.state_rounding``): ``"nearest"`` rounds m and v
to nearest, ties to even; ``"stochastic"`` (the default) rounds v, and int8's m, up with the
probability of the dropped fraction (bfloat16 m stays nearest). Why: rounded to nearest, a
moment stops moving when a step changes it by less than half an ulp, and then no longer follows
the gradients. A step changes v by ``(1 - b2) |g**2 / v - 1|``: about 0.1% at b2 = 0.999, under
half a bfloat16 ulp (0.2-0.4%); at b2 = 0.95 a decaying sqrt(v) moves 2.5% a step, under half an
E4M4 ulp (1.6-3.1%). A step changes m by ``(1 - b1) |g / m - 1|``: under E4M3's half ulp (3-6%)
whenever the gradient is within 30-60% of m, i.e. on every coordinate whose gradient is more
signal than noise; bfloat16's band is 2-4%, so stochastic bfloat16 m only adds noise.
``scripts/bench_state_rounding.py`` measures each combination (docs/architecture.md,
"Compressed optimizer state").

The random bits are a counter-based hash, not a generator: :func:`rounding_hash` of (a 32-bit
``seed`` per chunk, the element's index in its layer), ``lowbias32(index * 0x9E3779B1 +
seed)``, whose top 16 bits round v and low 16 bits int8 m; :func:`chunk_seed` makes the seed
from the run's seed, the update count, the leaf and the layer. So every update, kernel variant,
thread split and resumed run draws the same bits, and the kernel matches the reference bit for
bit. Stochastic rounding adds the 16 ``bits`` below the kept ones and truncates: bfloat16 ``(u +
bits) >> 16``; a normal code ``(u + (bits << (7 - M))) >> (23 - M)``; a subnormal code
``(trunc(r * 2**(31 + M)) + bits) >> 16``.

Per block the fused kernel decodes the old moments, runs the float32 AdamW arithmetic of
:mod:`jaxascend.optim.fused_adam` on them (``v = w * w`` with ``w`` the decoded square root),
finds the new block maxima and encodes; :func:`adamw_reference` here is the same algorithm in
numpy, operation for operation, which the kernel must match bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

STATE_DTYPES = ("float32", "bfloat16", "int8")
MIN_BLOCK, MAX_BLOCK = 256, 2048
DEFAULT_BLOCK = 2048
M_MANTISSA_BITS = 3  # m: sign + E4M3
V_MANTISSA_BITS = 4  # sqrt(v): E4M4
_BIAS = 111  # code exponent 15 <-> float32 exponent field 126 (the binade [0.5, 1))
_SUBNORMAL_LIMIT = np.float32(2.0**-15)
ROUNDINGS = ("stochastic", "nearest")
MASTER_DTYPES = ("float32", "bfloat16")  # optimizer.master_dtype
# optimizer.master_rounding (a bfloat16 master's); "nearest" is an ablation: no companion, and an
# update under half a bfloat16 ulp is lost (the master's kernel runs it as compensated, its
# companion zeroed before every update and dropped after)
MASTER_ROUNDINGS = ("compensated", "stochastic", "nearest")
_GOLDEN = 0x9E3779B1


@dataclass(frozen=True)
class StateFormat:
    """How m and v are stored: ``dtype`` one of :data:`STATE_DTYPES`; ``block``: elements per
    scale (int8 only; 0 otherwise); ``rounding``: how the moments are narrowed, one of :data:`ROUNDINGS`
    ("nearest" for float32, which is not narrowed). The rounding is not part of the stored format:
    a checkpoint's ``describe()`` leaves it out, and either rounding resumes either's state.

    ``master``: how the master weights are stored, one of :data:`MASTER_DTYPES` (float32; or
    bfloat16, the compute weights themselves), and ``master_rounding`` how a bfloat16 master
    takes each update (:data:`MASTER_ROUNDINGS`: ``compensated`` keeps the float32 master's low
    16 bits in a companion, so the two are the float32 master exactly; ``stochastic`` has none;
    see :mod:`jaxascend.optim.master_codes`). Both are part of the stored format."""

    dtype: str = "float32"
    block: int = 0
    rounding: str = "nearest"
    master: str = "float32"
    master_rounding: str = "compensated"
    # A record without its master: a bfloat16 master that lives elsewhere (a streamed leaf's
    # params region, the weights the forward streams); not part of the checkpoint's description.
    master_elsewhere: bool = False

    def __post_init__(self):
        if self.dtype not in STATE_DTYPES:
            raise ValueError(f"state dtype {self.dtype!r} is not one of {', '.join(STATE_DTYPES)}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"state rounding {self.rounding!r} is not one of {', '.join(ROUNDINGS)}")
        if self.dtype == "int8":
            check_block(self.block)
        elif self.block:
            object.__setattr__(self, "block", 0)
        if self.dtype == "float32":
            object.__setattr__(self, "rounding", "nearest")
        if self.master not in MASTER_DTYPES:
            raise ValueError(f"master dtype {self.master!r} is not one of {', '.join(MASTER_DTYPES)}")
        if self.master_rounding not in MASTER_ROUNDINGS:
            raise ValueError(f"master rounding {self.master_rounding!r} is not one of {', '.join(MASTER_ROUNDINGS)}")
        if self.master == "float32":
            object.__setattr__(self, "master_rounding", "compensated")  # not narrowed: one canonical value
            if self.master_elsewhere:
                raise ValueError("a float32 master lives in its record")

    @classmethod
    def of(cls, dtype: str = "float32", block: int = DEFAULT_BLOCK, rounding: str = "nearest",
           master: str = "float32", master_rounding: str = "compensated") -> "StateFormat":
        return cls(dtype, block if dtype == "int8" else 0, rounding, master, master_rounding)

    @property
    def master_itemsize(self) -> int:
        """Bytes of one master weight in a record (0: it lives elsewhere)."""
        return 0 if self.master_elsewhere else 4 if self.master == "float32" else 2

    @property
    def companion_itemsize(self) -> int:
        """Bytes of one element of a compensated bfloat16 master's companion (0: none)."""
        return 2 if self.master == "bfloat16" and self.master_rounding == "compensated" else 0


    @property
    def stochastic(self) -> bool:
        """Whether v (and int8 m) are rounded stochastically (so the kernel needs a seed and an index)."""
        return self.rounding == "stochastic"

    @property
    def moment_itemsize(self) -> int:
        """Bytes of one element of m (and of v)."""
        return {"float32": 4, "bfloat16": 2, "int8": 1}[self.dtype]

    @property
    def bytes_per_element(self) -> float:
        """State bytes per parameter in a record: master (+ its companion) + m + v (+ the two scales
        per block)."""
        return (self.master_itemsize + self.companion_itemsize + 2 * self.moment_itemsize
                + (8 / self.block if self.block else 0))

    def moment_dtype(self, which: str) -> np.dtype:
        """The stored dtype of ``"m"`` or ``"v"`` (or of ``"master"``, ``"master_comp"``)."""
        if which == "master_comp":  # the low 16 bits of a compensated master
            return np.dtype(np.uint16)
        if which == "master":
            import ml_dtypes
            return np.dtype(np.float32) if self.master == "float32" else np.dtype(ml_dtypes.bfloat16)
        if self.dtype == "float32":
            return np.dtype(np.float32)
        if self.dtype == "bfloat16":
            import ml_dtypes
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(np.uint8)

    def decode(self, which: str, stored: np.ndarray, scale: Optional[np.ndarray] = None) -> np.ndarray:
        """The float32 values of a stored ``"m"`` or ``"v"`` (bfloat16 bits or codes; ``scale``:
        the int8 block scales)."""
        if self.dtype == "float32":
            return np.asarray(stored, np.float32)
        if self.dtype == "bfloat16":
            return bf16_widen(np.asarray(stored).view(np.uint16))
        return (dequantize_m if which == "m" else dequantize_v)(stored, scale, self.block)

    def master_values(self, stored: np.ndarray, comp: Optional[np.ndarray] = None) -> np.ndarray:
        """The float32 values of a stored master: float32 as it is, a bfloat16 one widened exactly,
        a compensated one joined with its companion ``comp`` (exactly the float32 master)."""
        if self.master == "float32":
            return np.asarray(stored, np.float32)
        return bf16_widen(np.asarray(stored).view(np.uint16)) if comp is None else join_master(stored, comp)

    def blocks(self, n: int) -> int:
        """Scale blocks of a run of ``n`` elements (0 without scales)."""
        return -(-n // self.block) if self.block else 0

    def describe(self) -> dict:
        """What a checkpoint records of the format."""
        out = {"state_dtype": self.dtype}
        if self.dtype == "int8":
            out.update(block=self.block, m="sign + e4m3 of m / m_scale",
                       v="e4m4 of sqrt(v) / v_scale", scales="power of two above the block's largest magnitude")
        if self.master != "float32":  # a float32 master's record is as before the field existed
            out.update(master_dtype=self.master, master_rounding=self.master_rounding)
        return out


@dataclass(frozen=True)
class StateRecord:
    """Where master (and a compensated bfloat16 master's companion), m, v (and the int8 scales)
    of a chunk of ``count`` elements sit in its record: ``master[n] | comp[n] | pad | m[n] | v[n]
    (| pad | m_scale | v_scale)``, byte offsets from the record's start, ``nbytes`` in all. A
    float32 master's record is as it always was: ``master[n] | m[n] | v[n] ...``."""

    state: StateFormat
    count: int

    @property
    def companion_offset(self) -> int:
        return self.state.master_itemsize * self.count

    @property
    def m_offset(self) -> int:
        end = self.companion_offset + self.state.companion_itemsize * self.count
        return -(-end // 4) * 4  # float32 moments aligned

    @property
    def v_offset(self) -> int:
        return self.m_offset + self.state.moment_itemsize * self.count

    @property
    def scales_offset(self) -> int:
        return -(-(self.v_offset + self.state.moment_itemsize * self.count) // 4) * 4

    @property
    def blocks(self) -> int:
        return self.state.blocks(self.count)

    @property
    def nbytes(self) -> int:
        if not self.blocks:
            return self.v_offset + self.state.moment_itemsize * self.count
        return self.scales_offset + 8 * self.blocks

    def views(self, raw: np.ndarray) -> tuple:
        """``(master, m, v, m_scale, v_scale)`` views into a record's bytes ``raw`` (uint8; the
        scales None without int8 state); the master float32 or bfloat16 bits (uint16), m and v as
        the kernel takes them (float32, bfloat16 bits as uint16, or uint8 codes)."""
        n, isz = self.count, self.state.moment_itemsize
        moment = {4: np.float32, 2: np.uint16, 1: np.uint8}[isz]
        master = raw[:self.companion_offset].view(np.float32 if self.state.master == "float32" else np.uint16)
        m = raw[self.m_offset:self.m_offset + isz * n].view(moment)
        v = raw[self.v_offset:self.v_offset + isz * n].view(moment)
        if not self.blocks:
            return master, m, v, None, None
        scales = raw[self.scales_offset:self.scales_offset + 8 * self.blocks].view(np.float32)
        return master, m, v, scales[:self.blocks], scales[self.blocks:]

    def companion(self, raw: np.ndarray) -> Optional[np.ndarray]:
        """The compensation of a bfloat16 master (bits as uint16) in a record's bytes ``raw``; None without one."""
        if not self.state.companion_itemsize:
            return None
        return raw[self.companion_offset:self.companion_offset + 2 * self.count].view(np.uint16)


def check_block(block: int) -> int:
    if not (isinstance(block, (int, np.integer)) and MIN_BLOCK <= block <= MAX_BLOCK and block & (block - 1) == 0):
        raise ValueError(f"int8 state block is {block!r}; it must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]")
    return int(block)


# ----------------------------------------------------------------------------- codes (numpy)

def _f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def encode(r: np.ndarray, mantissa_bits: int, bits: Optional[np.ndarray] = None) -> np.ndarray:
    """Codes (uint32, ``0 .. 2**(4 + M) - 1``) of ``r >= 0`` (below 1; larger saturates): to
    nearest even, or stochastically with 16 random ``bits`` per element (:func:`rounding_bits`)."""
    r = np.asarray(r, np.float32)
    m = mantissa_bits
    u = _bits(r)
    shift = 23 - m
    if bits is None:
        lsb = (u >> np.uint32(shift)) & np.uint32(1)
        carry = np.uint32((1 << (shift - 1)) - 1) + lsb
    else:
        carry = np.asarray(bits, np.uint32) << np.uint32(shift - 16)
    with np.errstate(over="ignore"):
        normal = ((u + carry) >> np.uint32(shift)).astype(np.int64) - (_BIAS << m)
    normal = np.minimum(normal, (1 << (4 + m)) - 1)
    is_sub = u < _bits(_SUBNORMAL_LIMIT)
    if bits is None:
        magic = np.float32(2.0 ** (8 - m))  # its ulp is the subnormal spacing 2**-(15 + M)
        sub = (_bits(r + magic) - _bits(magic)).astype(np.int64)
    else:  # the code in 16.16 fixed point (exact below 2**-15), plus the bits, truncated
        fixed = (np.where(is_sub, r, 0) * np.float32(2.0 ** (31 + m))).astype(np.int64)
        sub = (fixed + np.asarray(bits, np.int64)) >> 16
    return np.where(is_sub, sub, normal).astype(np.uint32)


def decode(c: np.ndarray, mantissa_bits: int) -> np.ndarray:
    """The float32 value ``r`` of codes ``c``."""
    c = np.asarray(c, np.uint32)
    m = mantissa_bits
    sub = c.astype(np.float32) * np.float32(2.0 ** -(15 + m))
    normal = _f32((c + np.uint32(_BIAS << m)) << np.uint32(23 - m))
    return np.where(c < (1 << m), sub, normal).astype(np.float32)


def block_scale(maximum_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale, 1/scale) of blocks whose largest magnitude has float32 bits ``maximum_bits``: the
    power of two just above it (2**-126 at least, 2**126 at most); a block of zeros scales by 0."""
    field = (np.asarray(maximum_bits, np.uint32) >> np.uint32(23)).astype(np.int64)
    field = np.clip(field + 1, 1, 253)
    zero = np.asarray(maximum_bits) == 0
    scale = np.where(zero, np.float32(0), _f32((field << 23).astype(np.uint32)))
    inverse = np.where(zero, np.float32(0), _f32(((254 - field) << 23).astype(np.uint32)))
    return scale.astype(np.float32), inverse.astype(np.float32)


def quantize_m(m: np.ndarray, block: int, bits: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes, float32 scales) of a flat float32 ``m``; stochastically with ``bits``."""
    m = np.asarray(m, np.float32).reshape(-1)
    mags = _bits(m) & np.uint32(0x7FFFFFFF)
    scale, inverse = block_scale(_block_max(mags, block))
    r = _f32(mags) * np.repeat(inverse, block)[:m.size]
    codes = encode(r, M_MANTISSA_BITS, bits) | ((_bits(m) >> np.uint32(24)) & np.uint32(0x80))
    return codes.astype(np.uint8), scale


def dequantize_m(codes: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    codes = np.asarray(codes, np.uint8).astype(np.uint32).reshape(-1)
    r = decode(codes & np.uint32(0x7F), M_MANTISSA_BITS) * np.repeat(np.asarray(scale, np.float32), block)[:codes.size]
    return np.where(codes & np.uint32(0x80), -r, r).astype(np.float32)


def quantize_v(v: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes, float32 scales) of a flat non-negative float32 ``v`` (coded as sqrt(v))."""
    return quantize_w(np.sqrt(np.asarray(v, np.float32).reshape(-1)), block)


def quantize_w(w: np.ndarray, block: int, bits: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """As :func:`quantize_v` from ``w = sqrt(v)`` itself; stochastically with ``bits``."""
    w = np.asarray(w, np.float32).reshape(-1)
    mags = _bits(w) & np.uint32(0x7FFFFFFF)
    scale, inverse = block_scale(_block_max(mags, block))
    r = _f32(mags) * np.repeat(inverse, block)[:w.size]
    return encode(r, V_MANTISSA_BITS, bits).astype(np.uint8), scale


def dequantize_w(codes: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """The decoded ``sqrt(v)``."""
    codes = np.asarray(codes, np.uint8).astype(np.uint32).reshape(-1)
    return (decode(codes, V_MANTISSA_BITS) * np.repeat(np.asarray(scale, np.float32), block)[:codes.size]
            ).astype(np.float32)


def dequantize_v(codes: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    w = dequantize_w(codes, scale, block)
    return w * w


def _block_max(mags: np.ndarray, block: int) -> np.ndarray:
    n = mags.size
    padded = np.zeros(-(-n // block) * block, np.uint32)
    padded[:n] = mags
    return padded.reshape(-1, block).max(axis=1) if n else np.zeros(0, np.uint32)


# ----------------------------------------------------------------------------- the update (numpy)

def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), ties to even; NaN stays a quiet NaN."""
    u = _bits(x)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    with np.errstate(over="ignore"):
        rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


def bf16_round_stochastic(x: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded up with the probability of the dropped low half
    (16 random ``bits`` per element); NaN stays a quiet NaN."""
    u = _bits(x)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    with np.errstate(over="ignore"):
        rounded = (u + np.asarray(bits, np.uint32)) >> np.uint32(16)
    return np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


def _lowbias32(x):
    """Chris Wellons' lowbias32 integer hash (uint32 numpy arrays or Python ints)."""
    mask = 0xFFFFFFFF
    if isinstance(x, int):
        x &= mask
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & mask
        x ^= x >> 15
        x = (x * 0x735A2D97) & mask
        return x ^ (x >> 15)
    x = np.asarray(x, np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x21F0AAAD)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x735A2D97)
        return x ^ (x >> np.uint32(15))


def chunk_seed(run_seed: int, count: int, leaf: int, layer: int) -> int:
    """The 32-bit seed of one layer's stochastic rounding in one update: distinct per run seed,
    update ``count`` (updates applied before this one), leaf index and layer."""
    h = _lowbias32(int(run_seed) & 0xFFFFFFFF)
    for word in (int(run_seed) >> 32, count, leaf, layer):
        h = _lowbias32(h ^ _lowbias32((int(word) + _GOLDEN) & 0xFFFFFFFF))
    return h


def rounding_hash(seed: int, index: int, n: int) -> np.ndarray:
    """The 32-bit hashes (uint32) of elements ``index .. index + n - 1`` of a layer whose chunk
    seed is ``seed``: ``lowbias32(i * 0x9E3779B1 + seed)`` (``i`` modulo 2**32). v's rounding
    takes the top 16 bits, int8 m's the low 16."""
    i = (np.arange(n, dtype=np.uint64) + np.uint64(index)).astype(np.uint32)
    with np.errstate(over="ignore"):
        x = i * np.uint32(_GOLDEN) + np.uint32(seed & 0xFFFFFFFF)
    return _lowbias32(x)


def rounding_bits(seed: int, index: int, n: int) -> np.ndarray:
    """v's 16 random bits (uint32, below 2**16): the top half of :func:`rounding_hash`."""
    return rounding_hash(seed, index, n) >> np.uint32(16)


def join_master(master, comp) -> np.ndarray:
    """The float32 value of a compensated master: bits ``(master << 16) + int16(comp)``."""
    high = np.asarray(master).view(np.uint16).astype(np.int64) << 16
    low = np.asarray(comp).view(np.uint16).view(np.int16).astype(np.int64)
    return ((high + low) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def bf16_widen(bits: np.ndarray) -> np.ndarray:
    return _f32(np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16))


def adamw_reference(master, m, v, grad, scalars, fmt: StateFormat, m_scale=None, v_scale=None,
                    seed: int = 0, index: int = 0):
    """One AdamW update of flat arrays in ``fmt``, in numpy, as the fused kernel computes it.

    ``m``/``v``: float32, bfloat16 bits (uint16) or int8 codes (uint8) with ``m_scale``/
    ``v_scale``; ``grad``: float32 values (already widened from the compute dtype); ``seed``,
    ``index``: the chunk seed and the layer index of element 0, for stochastic rounding. Returns
    ``(master, m, v, m_scale, v_scale)`` in the same representation (scales None unless int8)."""
    s = np.asarray(scalars, np.float32)
    lr, b1, b2, eps, wd, gscale, bc1, bc2, omb1, omb2 = (s[i] for i in range(10))
    one = np.float32(1)
    inv_bc1, inv_bc2 = one / bc1, one / bc2
    master = np.asarray(master, np.float32)
    if fmt.dtype == "float32":
        m_old, v_old = np.asarray(m, np.float32), np.asarray(v, np.float32)
    elif fmt.dtype == "bfloat16":
        m_old, v_old = bf16_widen(m), bf16_widen(v)
    else:
        m_old = dequantize_m(m, m_scale, fmt.block)
        w = dequantize_w(v, v_scale, fmt.block)
        v_old = w * w
    g = np.asarray(grad, np.float32) * gscale
    m_new = omb1 * g + b1 * m_old
    v_new = omb2 * (g * g) + b2 * v_old
    denom = np.sqrt(v_new * inv_bc2) + eps
    update = (m_new * inv_bc1) / denom + wd * master
    master_new = master - lr * update
    if fmt.dtype == "float32":
        return master_new, m_new, v_new, None, None
    h = rounding_hash(seed, index, m_new.size) if fmt.stochastic else None
    m_bits, v_bits = (None, None) if h is None else (h & np.uint32(0xFFFF), h >> np.uint32(16))
    if fmt.dtype == "bfloat16":  # m to nearest: its ulp is far below a step's change
        v_out = bf16_round(v_new) if v_bits is None else bf16_round_stochastic(v_new, v_bits)
        return master_new, bf16_round(m_new), v_out, None, None
    mq, ms = quantize_m(m_new, fmt.block, m_bits)
    vq, vs = quantize_w(np.sqrt(v_new), fmt.block, v_bits)
    return master_new, mq, vq, ms, vs
