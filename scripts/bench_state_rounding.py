"""Rounding of the compressed AdamW moments: to nearest or stochastically, for m and for v.

A numpy simulation (the update of ``jaxascend.optim.state_codes.adamw_reference``, the
stochastic bits of ``state_codes.rounding_hash``) of AdamW with float32 state and with bfloat16 /
int8 state under each rounding of m and v, in two regimes:

* ``noise``: beta2 = 0.999, gradients mostly noise and shrinking over the run, as training's do
  (``(N(0,1) + 0.3) * size / (1 + t / 300)``, per-element sizes log-normal);
* ``signal``: beta2 = 0.95 (the default), gradients mostly signal: a per-element direction that
  turns slowly (``cos(t / 100)``) plus 20% noise.

Reports, every ``--every`` steps, the median over elements of ``sqrt(v_q / v_32)`` (1 when v
follows the gradients) and the drift of the parameters, ``|p_q - p_32| / |p_32|``. Prints JSON.

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
    mq, ms = sc.quantize_m(m, BLOCK, m_bits)
    vq, vs = sc.quantize_w(np.sqrt(v), BLOCK, v_bits)
    return sc.dequantize_m(mq, ms, BLOCK), sc.dequantize_v(vq, vs, BLOCK)


def simulate(regime: str, n: int, steps: int, every: int, seed: int) -> list:
    b1, b2, lr, eps = 0.9, (0.999 if regime == "noise" else 0.95), 1e-3, 1e-8
    rng = np.random.default_rng(seed)
    size = np.exp(rng.normal(size=n)).astype(np.float32)
    direction = rng.normal(size=n).astype(np.float32)
    start = rng.normal(size=n).astype(np.float32)
    names = ["float32"] + [f"{d} m {m} v {v}" for d, m, v in VARIANTS]
    state = {k: [start.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)] for k in names}
    rows = []
    for t in range(steps):
        noise = rng.normal(size=n).astype(np.float32)
        if regime == "noise":
            g = ((noise + np.float32(0.3)) * size * np.float32(1.0 / (1 + t / 300))).astype(np.float32)
        else:
            g = ((direction * np.float32(np.cos(t / 100)) + np.float32(0.2) * noise) * size).astype(np.float32)
        bc1, bc2 = np.float32(1 - b1 ** (t + 1)), np.float32(1 - b2 ** (t + 1))
        h = sc.rounding_hash(sc.chunk_seed(seed, t, 0, 0), 0, n)
        m_bits, v_bits = h & np.uint32(0xFFFF), h >> np.uint32(16)
        for k in names:
            master, m, v = state[k]
            m = np.float32(1 - b1) * g + np.float32(b1) * m
            v = np.float32(1 - b2) * (g * g) + np.float32(b2) * v
            master = master - np.float32(lr) * ((m / bc1) / (np.sqrt(v / bc2) + np.float32(eps)))
            if k != "float32":
                d, mr, vr = VARIANTS[names.index(k) - 1]
                m, v = narrow(d, m, v, m_bits if mr == "stochastic" else None, v_bits if vr == "stochastic" else None)
            state[k] = [master, m, v]
        if (t + 1) % every == 0:
            ref = state["float32"]
            row = {"step": t + 1}
            for k in names[1:]:
                master, _, v = state[k]
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratio = np.sqrt(v / ref[2])
                row[k] = {"sqrt_v_ratio_median": round(float(np.median(ratio)), 4),
                          "param_drift": round(float(np.linalg.norm(master - ref[0]) / np.linalg.norm(ref[0])), 5)}
            rows.append(row)
            print(regime, json.dumps(row), file=sys.stderr)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=8192)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    result = {"elements": args.elements, "steps": args.steps, "b1": 0.9, "lr": 1e-3, "block": BLOCK,
              "ours": {"bfloat16": "m nearest v stochastic", "int8": "m stochastic v stochastic"},
              "regimes": {r: {"b2": 0.999 if r == "noise" else 0.95,
                              "rows": simulate(r, args.elements, args.steps, args.every, args.seed)}
                          for r in ("noise", "signal")}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
