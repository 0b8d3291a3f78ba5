"""Time of one fused AdamW update with a float32 master against a bfloat16 one (compensated and
stochastic), per kernel variant, on the same n elements. Prints JSON.

    python scripts/bench_master_dtype.py                          # n = 2**22, median of 5
    python scripts/bench_master_dtype.py --n 16M --threads 2 --state bfloat16

Every call is one whole update in place (numpy entry, ``threads`` workers): fp32 master with
bfloat16 params apart (4 + 2 bytes a weight), or a bfloat16 master that is its own params
(2 bytes, + a 2-byte companion when compensated); m and v in ``--state``, bfloat16 gradients.
The variants and formats take turns within each repetition, so a machine shared with other
work slows them alike; the figure is the median of ``--reps`` repetitions after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxascend.optim import (AdamHyperParams, MasterFormat, StateFormat, fused_adamw_update_numpy,  # noqa: E402
                             master_codes, state_codes)
from jaxascend.native import extension as _native  # noqa: E402

FORMATS = {"float32": MasterFormat(), "bf16-compensated": MasterFormat("bfloat16", "compensated"),
           "bf16-stochastic": MasterFormat("bfloat16", "stochastic")}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def buffers(n: int, fmt: MasterFormat, state: StateFormat, rng) -> dict:
    """The arrays of one update of n elements with the master in ``fmt``."""
    x = (rng.normal(size=n) * 0.02).astype(np.float32)
    m = (rng.normal(size=n) * 1e-4).astype(np.float32)
    v = (m * m * 2).astype(np.float32)
    out = {"grad": (rng.normal(size=n) * 1e-4).astype(ml_dtypes.bfloat16), "m_scale": None, "v_scale": None}
    if state.dtype == "bfloat16":
        m, v = m.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)
    elif state.dtype == "int8":
        (m, out["m_scale"]), (v, out["v_scale"]) = (state_codes.quantize_m(m, state.block),
                                                    state_codes.quantize_v(v, state.block))
    out.update(m=m, v=v, comp=None)
    if fmt.dtype == "float32":
        out.update(master=x, params=np.empty(n, ml_dtypes.bfloat16))
    else:
        master, comp = master_codes.split_master(x)
        out.update(master=master, params=master.view(ml_dtypes.bfloat16), comp=comp if fmt.compensated else None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default=str(2**22), help="elements, e.g. 4194304 or 4M (default 2**22)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--state", default="float32", choices=("float32", "bfloat16", "int8"))
    args = parser.parse_args()
    n = parse_size(args.n)
    state = StateFormat.of(args.state, rounding="stochastic" if args.state != "float32" else "nearest")
    hp = np.asarray(AdamHyperParams(lr=1e-5, weight_decay=0.01, count=10).scalars())
    rng = np.random.default_rng(0)
    arrays = {name: buffers(n, fmt, state, rng) for name, fmt in FORMATS.items()}
    isas = list(_native.adamw_supported_isas())
    runs = {(isa, name): [] for isa in isas for name in FORMATS}

    def call(isa, name):
        a = arrays[name]
        fused_adamw_update_numpy(a["master"], a["m"], a["v"], a["grad"], a["params"], hp, threads=args.threads,
                                 isa=isa, state=state, m_scale=a["m_scale"], v_scale=a["v_scale"], seed=1,
                                 master_format=FORMATS[name], comp=a["comp"])

    for key in runs:
        call(*key)  # warm-up: pages touched, pool started
    for _ in range(args.reps):
        for key in runs:
            start = time.perf_counter()
            call(*key)
            runs[key].append(time.perf_counter() - start)
    result = {"cpu": cpu_model(), "n": n, "threads": args.threads, "state": args.state, "reps": args.reps,
              "median_ms": {isa: {name: round(1e3 * statistics.median(runs[isa, name]), 3) for name in FORMATS}
                            for isa in isas}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
