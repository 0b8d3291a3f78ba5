"""Rounding of the compressed AdamW moments: to nearest or stochastically, for m and for v.

A numpy simulation (the update of ``jaxascend.optim.state_codes.adamw_reference``, the
stochastic bits of ``state_codes.rounding_bits``) of ``--steps`` AdamW steps with beta2 = 0.999
on gradients that shrink over the run, as training's do (``sigma_t = 1 / (1 + t / 300)``, a
persistent sign component, per-element magnitudes log-normal), with float32 state and with
bfloat16 / int8 state under each rounding of m and v. Reports, every ``--every`` steps, the
median over elements of ``sqrt(v_q / v_32)`` (1 when v follows the gradients) and the drift of
the parameters, ``|p_q - p_32| / |p_32|``. Prints JSON.

    python scripts/bench_state_rounding.py --out docs/bench_state_rounding.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxascend.optim import state_codes as sc  # noqa: E402

BLOCK = 2048
VARIANTS = [(d, m, v) for d in ("bfloat16", "int8")
            for m, v in (("nearest", "nearest"), ("nearest", "stochastic"), ("stochastic", "stochastic"))]


def narrow(dtype: str, m: np.ndarray, v: np.ndarray, m_bits, v_bits):
    """(m, v) stored and read back: bfloat16 or int8 codes, each rounded with its bits (None:
    nearest)."""
    if dtype == "bfloat16":
        def one(x, bits):
            return sc.bf16_widen(sc.bf16_round(x) if bits is None else sc.bf16_round_stochastic(x, bits))
        return one(m, m_bits), one(v, v_bits)
    mags = m.view(np.uint32) & np.uint32(0x7FFFFFFF)
    scale, inverse = sc.block_scale(sc._block_max(mags, BLOCK))
    codes = sc.encode(mags.view(np.float32) * np.repeat(inverse, BLOCK)[:m.size], sc.M_MANTISSA_BITS, m_bits)
    codes |= (m.view(np.uint32) >> np.uint32(24)) & np.uint32(0x80)
    m_back = sc.dequantize_m(codes.astype(np.uint8), scale, BLOCK)
    vq, vs = sc.quantize_w(np.sqrt(v), BLOCK, v_bits)
    return m_back, sc.dequantize_v(vq, vs, BLOCK)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=8192)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    n, b1, b2, lr, eps = args.elements, 0.9, 0.999, 1e-3, 1e-8
    rng = np.random.default_rng(args.seed)
    size = np.exp(rng.normal(size=n)).astype(np.float32)
    start = rng.normal(size=n).astype(np.float32)
    names = ["float32"] + [f"{d} m {m} v {v}" for d, m, v in VARIANTS]
    state = {k: [start.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)] for k in names}
    rows = []
    for t in range(args.steps):
        sigma = np.float32(1.0 / (1 + t / 300))
        g = ((rng.normal(size=n).astype(np.float32) + np.float32(0.3)) * size * sigma).astype(np.float32)
        bc1, bc2 = np.float32(1 - b1 ** (t + 1)), np.float32(1 - b2 ** (t + 1))
        bits = sc.rounding_bits(sc.chunk_seed(args.seed, t, 0, 0), 0, n)
        m_bits_sr = sc.rounding_bits(sc.chunk_seed(args.seed + 1, t, 0, 0), 0, n)
        for k in names:
            master, m, v = state[k]
            m = np.float32(1 - b1) * g + np.float32(b1) * m
            v = np.float32(1 - b2) * (g * g) + np.float32(b2) * v
            master = master - np.float32(lr) * ((m / bc1) / (np.sqrt(v / bc2) + np.float32(eps)))
            if k != "float32":
                d, mr, vr = VARIANTS[names.index(k) - 1]
                m, v = narrow(d, m, v, m_bits_sr if mr == "stochastic" else None, bits if vr == "stochastic" else None)
            state[k] = [master, m, v]
        if (t + 1) % args.every == 0:
            ref = state["float32"]
            row = {"step": t + 1}
            for k in names[1:]:
                master, _, v = state[k]
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratio = np.sqrt(v / ref[2])
                row[k] = {"sqrt_v_ratio_median": round(float(np.median(ratio)), 4),
                          "param_drift": round(float(np.linalg.norm(master - ref[0]) / np.linalg.norm(ref[0])), 5)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    result = {"elements": n, "steps": args.steps, "b1": b1, "b2": b2, "lr": lr, "block": BLOCK,
              "gradients": "(N(0,1) + 0.3) * lognormal(0,1) per element / (1 + t/300)", "rows": rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
