"""Which 8-bit map for the AdamW moments: a numpy simulation of the update with each candidate.

Runs AdamW for ``--steps`` steps on a fixed gradient sequence (per-element magnitudes spread
over five decades, as the gradients of one tensor are; a sign that persists or flips) with fp32
state and with each candidate format of m and v, and reports the relative error of the
parameter change against fp32 state (``|dp_q - dp_32| / |dp_32|``, over all elements) and the
worst single-element update in units of lr, with gradient magnitudes spread over 3 and over 5
decades within every block. Candidates: the linear absmax maps (m: 127 signed levels, v: 255
levels), other exponent/mantissa splits, v coded directly instead of as sqrt(v), and the codes
jaxascend uses (m: sign + E4M3; v: E4M4 of sqrt(v)), at blocks of 256 and 2048; bfloat16 for
reference; and the 4-bit moments of Li et al. (NeurIPS 2023: m block-wise with a dynamic
exponent, v with rank-1 normalisation and a linear map without zero). Prints JSON.

    python scripts/bench_state_codes.py --out docs/bench_state_codes.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxascend.optim import state_codes as sc  # noqa: E402


def linear_m(m, block):
    x = m.reshape(-1, block)
    scale = np.abs(x).max(axis=1, keepdims=True)
    q = np.round(np.where(scale > 0, x / np.where(scale > 0, scale, 1), 0) * 127)
    return (q / 127 * scale).astype(np.float32).reshape(-1)


def linear_v(v, block):
    x = v.reshape(-1, block)
    scale = x.max(axis=1, keepdims=True)
    q = np.round(np.where(scale > 0, x / np.where(scale > 0, scale, 1), 0) * 255)
    return (q / 255 * scale).astype(np.float32).reshape(-1)


def minifloat(x, block, e_bits, m_bits, root=False):
    """A generic block-scaled minifloat (float64 arithmetic, round half to even): the other
    exponent/mantissa splits, and ``v`` coded directly rather than as sqrt(v)."""
    y = np.sqrt(x) if root else x
    b = y.reshape(-1, block).astype(np.float64)
    top = np.abs(b).max(axis=1, keepdims=True)
    scale = np.where(top > 0, 2.0 ** (np.floor(np.log2(np.where(top > 0, top, 1))) + 1), 0)
    r = np.where(scale > 0, np.abs(b) / np.where(scale > 0, scale, 1), 0)
    e = np.maximum(np.floor(np.log2(np.where(r > 0, r, 1))), -(2**e_bits - 1))
    step = 2.0 ** (e - m_bits)
    q = np.minimum(np.round(r / step) * step, 1 - 2.0 ** (-1 - m_bits))
    out = (q * scale * np.sign(b)).reshape(-1).astype(np.float32)
    return out * out if root else out


def exp_m(m, block):
    return sc.dequantize_m(*sc.quantize_m(m, block), block)


def exp_v(v, block):
    return sc.dequantize_v(*sc.quantize_v(v, block), block)


def bf16(x, block):
    return sc.bf16_widen(sc.bf16_round(x))


def _nearest(r, levels):
    """Each of ``r`` (>= 0) as the nearest of the sorted ``levels``."""
    i = np.clip(np.searchsorted(levels, r), 1, len(levels) - 1)
    lo, hi = levels[i - 1], levels[i]
    return np.where(r - lo <= hi - r, lo, hi)


def dynamic_exponent_levels(bits: int) -> np.ndarray:
    """The magnitudes of a ``bits``-bit dynamic-exponent code (Dettmers 2016): after ``i``
    leading zeros and a one, the remaining bits are a linear fraction in (0.1, 1] of 10**-i; all
    zeros is 0."""
    out = [0.0]
    for i in range(bits):
        frac = bits - 1 - i
        edges = np.linspace(0.1, 1.0, 2**frac + 1)
        out += list((edges[:-1] + edges[1:]) / 2 * 10.0**-i) if frac else [0.55 * 10.0**-i]
    return np.unique(np.asarray(out)) / max(out)


def int4_m(m, block=128):
    """4-bit m after Li et al. (NeurIPS 2023): block-wise (128) absmax, sign + a 3-bit
    dynamic-exponent magnitude."""
    x = m.reshape(-1, block)
    scale = np.abs(x).max(axis=1, keepdims=True)
    r = np.where(scale > 0, np.abs(x) / np.where(scale > 0, scale, 1), 0)
    return (np.sign(x) * _nearest(r, dynamic_exponent_levels(3)) * scale).astype(np.float32).reshape(-1)


def int4_v(v, block=256):
    """4-bit v after Li et al.: rank-1 normalisation of v as a matrix (rows of ``block``: each
    element over the smaller of its row's and its column's maximum) and a linear map without
    zero (levels (k + 1) / 16), so no v decodes to zero."""
    x = v.reshape(-1, block)
    norm = np.minimum(x.max(axis=1, keepdims=True), x.max(axis=0, keepdims=True))
    r = np.where(norm > 0, x / np.where(norm > 0, norm, 1), 0)
    return (_nearest(r, np.arange(1, 17) / 16.0) * norm).astype(np.float32).reshape(-1)


def simulate(qm, qv, block, grads, lr=1e-3, b1=0.9, b2=0.95, eps=1e-8):
    n = grads.shape[1]
    p = np.zeros(n, np.float32)
    m = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    worst = 0.0
    for t, g in enumerate(grads, 1):
        m = (1 - b1) * g + b1 * m
        v = (1 - b2) * g * g + b2 * v
        u = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        worst = max(worst, float(np.abs(u).max()))
        p = p - lr * u
        if qm is not None:
            m, v = qm(m, block), qv(v, block)
    return p, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    n = args.elements
    candidates = {
        "bfloat16": (bf16, bf16, [0]),
        "linear (m 127, v 255 levels)": (linear_m, linear_v, [256, 2048]),
        "m e4m3, v e5m3 (v coded directly)": (lambda m, b: minifloat(m, b, 4, 3), lambda v, b: minifloat(v, b, 5, 3),
                                              [256, 2048]),
        "m e5m2, sqrt v e4m4": (lambda m, b: minifloat(m, b, 5, 2), exp_v, [256, 2048]),
        "m e3m4, sqrt v e4m4": (lambda m, b: minifloat(m, b, 3, 4), exp_v, [256, 2048]),
        "jaxascend int8: m e4m3, sqrt v e4m4": (exp_m, exp_v, [256, 2048]),
        # 4-bit (optimizer.state_dtype: int4 of issue 39): m block 128 by the block argument
        "int4 (Li et al.): m DE block 128, v rank-1 linear without zero": (int4_m, int4_v, [128]),
        "int4 m (Li et al.), jaxascend int8 v": (int4_m, exp_v, [128]),
    }
    out = {"elements": n, "steps": args.steps, "spreads": {}}
    for decades in (3, 5):
        magnitude = 10.0 ** rng.uniform(-1 - decades, -1, n)  # this many decades within every block
        drift = rng.normal(0, 1, n)
        grads = np.stack([(magnitude * (0.5 * drift + rng.normal(0, 1, n))).astype(np.float32)
                          for _ in range(args.steps)])
        ref, ref_worst = simulate(None, None, 0, grads)
        result = {"fp32_worst_update_over_lr": ref_worst, "candidates": {}}
        for name, (qm, qv, blocks) in candidates.items():
            for block in blocks:
                p, worst = simulate(qm, qv, block or 1, grads)
                err = float(np.linalg.norm(p - ref) / np.linalg.norm(ref))
                result["candidates"][f"{name}, block {block}" if block else name] = {
                    "relative_error": round(err, 4), "worst_update_over_lr": round(worst, 2)}
        out["spreads"][f"{decades} decades"] = result
    text = json.dumps(out, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
