"""The longest context each model size fits in a memory limit, by the run planner (which
``scripts/bench_plan.py`` and ``scripts/bench_context.py`` check against measured runs, within 15%).

    python scripts/plan_context.py                      # Qwen2.5 0.5B, 1.5B, 3B, 7B; 20 GiB
    python scripts/plan_context.py --limit-gib 23 --sizes 0.5B,3B

For each size (a preset ``config.json``, nothing else: no weights, tokenizer or data) and each
``offload.params`` (resident, ssd), it finds the longest ``data.seq_len`` (a multiple of
``--step`` tokens, batch 1, ``remat: full``, no accumulation) whose plan fits ``--limit-gib`` of
host memory, with ``model.attention`` and ``model.loss`` dense and with their defaults (``auto``:
blockwise attention and the blocked loss at long rows). Prints JSON, and with ``--markdown`` a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from jaxascend.config import load_config
from jaxascend.hf import preset_config
from jaxascend.planning import plan_run
from jaxascend.preparation import resolve_model_config

REPO = Path(__file__).resolve().parent.parent
MODES = {"dense": ["model.attention=dense", "model.loss=dense"], "auto": ["model.attention=auto", "model.loss=auto"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="0.5B,1.5B,3B,7B", help="Qwen2.5 presets (comma-separated)")
    p.add_argument("--limit-gib", type=float, default=20.0)
    p.add_argument("--step", type=int, default=1024, help="the lengths tried are multiples of this")
    p.add_argument("--max-len", type=int, default=1 << 20)
    p.add_argument("--markdown", action="store_true")
    return p.parse_args()


def host_peak(folder: str, seq: int, params: str, mode: str) -> int:
    sets = [f"model.path={folder}", f"data.seq_len={seq}", "data.batch_size=1", "model.remat=full",
            f"model.max_position_embeddings={seq}", "train.grad_accum=1", f"offload.params={params}",
            f"train.out_dir={folder}/run", *MODES[mode]]
    cfg = load_config(str(REPO / "configs" / "qwen2.5-0.5b.yaml"), sets, inputs=False)
    return plan_run(cfg, resolve_model_config(cfg), runtime_bytes=None).host_peak


def longest(folder: str, params: str, mode: str, limit: int, step: int, max_len: int) -> int:
    """The longest multiple of ``step`` whose plan fits ``limit`` (0: not even ``step``)."""
    lo, hi = 0, max_len // step  # in units of step: lo fits (or is 0), hi + 1 does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if host_peak(folder, mid * step, params, mode) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def main() -> int:
    args = parse_args()
    os.environ.setdefault("JAXASCEND_MEM_AVAILABLE_BYTES", "1TiB")  # plan against the limit, not this machine
    limit = int(args.limit_gib * 2**30)
    rows = []
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as folder:
            config = preset_config("qwen2", size)
            config["max_position_embeddings"] = args.max_len
            Path(folder, "config.json").write_text(json.dumps(config))
            for params in ("resident", "ssd"):
                row = {"size": size, "params": params}
                for mode in MODES:
                    row[mode] = longest(folder, params, mode, limit, args.step, args.max_len)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    print(json.dumps({"limit_gib": args.limit_gib, "batch": 1, "remat": "full", "rows": rows}, indent=1))
    if args.markdown:
        print(f"\n| size | weights | longest context in {args.limit_gib:g} GiB: dense | blockwise + blocked |")
        print("|---|---|---|---|")
        for row in rows:
            print(f"| {row['size']} | {row['params']} | {row['dense']} | {row['auto']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
