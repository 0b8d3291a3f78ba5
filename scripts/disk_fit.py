"""The largest model of each family whose full fine-tune fits a disk, as the planner plans it.

    python scripts/disk_fit.py                  # against 75 GiB free (this machine's), docs/disk_fit.json + .md
    python scripts/disk_fit.py --free 200GiB

Every preset of ``jaxascend.hf.presets`` (the published ``config.json`` of each size) is planned
from its config.json alone, the way ``python -m jaxascend.plan`` plans it, with the settings of
``configs/qwen2.5-7b.yaml`` (a bfloat16 compensated master that is the streamed weights, int8
moments, durable steps, no checkpoint copy, the export in the gradients' space; seq 1024, batch 1)
and, beside them, with the float32 master and moments plus one final checkpoint (the shipped
defaults' state). Per family: the largest preset whose disk high-water fits ``--free``, and the
parameters that would fit at that family's largest preset's bytes per parameter.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from config_comments import plan_of  # the planner as the shipped configs' plan blocks use it

REPO = Path(__file__).resolve().parents[1]
COMPACT = REPO / "configs" / "qwen2.5-7b.yaml"
FLOAT32 = ["optimizer.master_dtype=float32", "optimizer.state_dtype=float32", "checkpoint.final=true"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--free", default="75GiB", help="free disk to fit (default: this machine's 75 GiB)")
    p.add_argument("--out", default=str(REPO / "docs" / "disk_fit.json"))
    return p.parse_args()


def disk_need(arch: str, size: str, extra: list[str]) -> tuple[int, int]:
    """(parameters, disk high-water) of the preset planned with the 7B config's settings and ``extra``."""
    _, plan = plan_of(COMPACT, arch, size, tuple(extra))
    return plan.num_params, sum(fs.need for fs in plan.disk)


def main() -> int:
    from jaxascend.config import parse_bytes
    from jaxascend.hf import PRESETS

    args = parse_args()
    free = parse_bytes(args.free, "--free")
    rows = []
    for arch, sizes in PRESETS.items():
        planned = []
        for size in sizes:
            if size == "tiny":
                continue
            n, compact = disk_need(arch, size, [])
            _, plain = disk_need(arch, size, FLOAT32)
            planned.append({"size": size, "params": n, "compact_bytes": compact, "float32_bytes": plain})
        planned.sort(key=lambda r: r["params"])
        fits = [r for r in planned if r["compact_bytes"] <= free]
        fits32 = [r for r in planned if r["float32_bytes"] <= free]
        top = planned[-1]
        rows.append({"family": arch, "planned": planned,
                     "largest_fitting": fits[-1]["size"] if fits else None,
                     "largest_fitting_float32": fits32[-1]["size"] if fits32 else None,
                     "params_fitting_estimate": int(free / (top["compact_bytes"] / top["params"]))})
    report = {"free_bytes": free, "settings": str(COMPACT.relative_to(REPO)), "families": rows}
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=1))
    gib = 2**30
    lines = [f"Against {free / gib:.0f} GiB of free disk; compact: `{report['settings']}` as shipped (seq 1024); "
             "float32: its master and moments in float32 and a final checkpoint.", "",
             "| family | largest preset that fits, compact (its disk) | float32 | parameters that fit, compact |",
             "|---|---|---|---|"]
    for r in rows:
        fit = next((p for p in r["planned"] if p["size"] == r["largest_fitting"]), None)
        lines.append(f"| {r['family']} | {r['largest_fitting'] or 'none'}"
                     + (f" ({fit['compact_bytes'] / gib:.1f} GiB)" if fit else "")
                     + f" | {r['largest_fitting_float32'] or 'none'} | about {r['params_fitting_estimate'] / 1e9:.1f}B |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
