"""Draws docs/offloaded_step.svg: the data path of one offloaded training step.

    python scripts/draw_architecture.py                  # writes docs/offloaded_step.svg
    python scripts/draw_architecture.py --png /tmp/x.png # also a PNG, to look at

The picture follows ``OffloadEngine.step`` (jaxascend/offload/engine.py) top to bottom: the
jitted forward/backward pass ships each layer's gradient to the SSD through the store sink,
the host reads a few bytes of statistics, then the streamed AdamW pipeline reads, updates and
writes the optimizer state chunk by chunk through the arena and hands back new compute params.
Where the step runs (one device, this process's devices, a job's processes) is the placement's,
chosen once from the step's plan: the dashed box.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "offloaded_step.svg"

# Lanes (x ranges) and their colours: where the bytes are.
LANES = [
    ("device memory\n(GPU, or host RAM on a CPU-only machine)", 0.0, 4.2, "#e8f0fe"),
    ("host: Python + native code (jaxascend._native)", 4.4, 11.0, "#fef7e0"),
    ("SSD: O_DIRECT shard files,\ncrc32c per block", 11.2, 14.4, "#e6f4ea"),
]


def box(ax, x, y, w, h, text, color="white", bold=False):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.03,rounding_size=0.08",
                                fc=color, ec="#444", lw=1.0))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.2,
            weight="bold" if bold else "normal")


def arrow(ax, start, end, text="", color="#333", rad=0.0, at=None, ha="center"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=11, lw=1.2, color=color,
                                 connectionstyle=f"arc3,rad={rad}"))
    if text:
        x, y = at if at else ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.1)
        ax.text(x, y, text, ha=ha, va="bottom", fontsize=7.4, color=color)


def draw(path: Path, png: Path | None) -> None:
    fig, ax = plt.subplots(figsize=(14.4, 8.6))
    ax.set_xlim(0, 14.4)
    ax.set_ylim(0, 8.9)
    ax.axis("off")
    for name, x0, x1, color in LANES:
        ax.add_patch(FancyBboxPatch((x0, 0.1), x1 - x0, 8.1, boxstyle="square,pad=0", fc=color, ec="none"))
        ax.text((x0 + x1) / 2, 8.5, name, ha="center", va="center", fontsize=9, weight="bold")

    # 1. forward/backward: each layer's gradient leaves for the SSD as soon as it exists
    box(ax, 0.2, 6.7, 3.8, 1.2, "1. fwd_bwd: one jitted call\nlax.scan over the layers (remat policy)\n"
        "compute params bf16/fp16: 2 B/param", bold=True)
    box(ax, 0.2, 5.0, 3.8, 1.2, "backward of layer l: the custom_vjp of\noffload_on_backward calls the FFI "
        "target\njaxascend_grad_sink (compute dtype)")
    arrow(ax, (2.1, 6.7), (2.1, 6.2))
    box(ax, 4.7, 5.0, 2.9, 1.2, "store sink (ffi/offload_store_sink.cc)\ncopies the layer's gradient into\n"
        "an arena staging slot")
    arrow(ax, (4.0, 5.6), (4.7, 5.6), "gradient", at=(4.35, 5.7))
    box(ax, 11.5, 5.0, 2.7, 1.2, "gradient regions\none per (leaf, layer)\n2 B/param")
    arrow(ax, (7.6, 5.6), (11.5, 5.6), "queued O_DIRECT write (io threads)\nwhile layer l-1 computes",
          at=(9.55, 5.68))

    # 2. the only sync: a few bytes of statistics
    box(ax, 4.7, 3.6, 2.4, 1.0, "per (leaf, layer): sum of\nsquares, non-finite count\n(the probes' gradients)")
    arrow(ax, (3.2, 5.0), (4.7, 4.1), "step outputs", rad=0.15, at=(3.55, 4.25))
    box(ax, 7.5, 3.6, 1.5, 1.0, "2. SYNC\noverflow?\nnorm, clip factor", color="#fde2e1", bold=True)
    arrow(ax, (7.1, 4.1), (7.5, 4.1))
    box(ax, 9.4, 3.6, 1.45, 1.0, "skip: SSD untouched,\ncount stays, fp16\nscale backs off", color="#fde2e1")
    arrow(ax, (9.0, 4.1), (9.4, 4.1), "overflow", color="#b3261e", at=(9.2, 4.22))

    # 3. streamed AdamW through the arena
    box(ax, 4.7, 0.35, 6.15, 2.75, "")
    ax.text(7.77, 2.85, "3. OffloadedAdamState.step: a pipeline over fixed-size chunks", ha="center",
            fontsize=8.4, weight="bold")
    box(ax, 4.95, 1.6, 1.8, 0.95, "chunk k+1\nread-ahead", color="#e6f4ea")
    box(ax, 6.9, 1.6, 1.75, 0.95, "chunk k\nfused AdamW kernel\n(scalar/AVX2/AVX-512)", color="#fef7e0")
    box(ax, 8.8, 1.6, 1.8, 0.95, "chunk k-1\nwrite-behind", color="#e6f4ea")
    ax.text(7.77, 0.9, "arena slots: one preallocated, locked allocation, exact size per shape class,\n"
            "stream_depth deep; gradient x clip / loss scale in registers, master/m/v in place",
            ha="center", va="center", fontsize=7.4)
    arrow(ax, (8.25, 3.6), (8.25, 3.1), "no overflow: lr, clip/scale, count", at=(8.35, 3.22), ha="left")
    box(ax, 11.5, 1.4, 2.7, 1.4, "optimizer state regions\nfp32 master, m, v,\ninterleaved per chunk\n"
        "12 B/param")
    arrow(ax, (12.2, 5.0), (10.85, 2.75), "read-ahead:\ngradient", rad=-0.1, at=(11.3, 3.75), ha="left")
    arrow(ax, (11.5, 2.35), (10.85, 2.35), "master,\nm, v", at=(11.17, 2.42))
    arrow(ax, (10.85, 1.65), (11.5, 1.65), "write\nback", at=(11.17, 1.1))

    # where the step runs: the placement, asked by every part (offload/placement.py)
    ax.add_patch(FancyBboxPatch((1.75, 2.7), 2.25, 1.2, boxstyle="round,pad=0.03,rounding_size=0.08",
                                fc="white", ec="#444", lw=1.0, ls="--"))
    ax.text(2.875, 3.3, "placement (from the StepPlan):\none device | this process's devices\n| a job's "
            "P x D: replicated inputs,\nrows split, each gradient reduce-\nscattered (first device sends),"
            "\nnew slices all-gathered", ha="center", va="center", fontsize=7.0)

    # 4. new compute params go back to the device
    box(ax, 0.2, 1.3, 3.8, 1.2, "4. new compute params, leaf by leaf\n(master cast to bf16/fp16), "
        "donated\nto the next fwd_bwd")
    arrow(ax, (4.7, 1.9), (4.0, 1.9), "new\nparams", at=(4.35, 1.97))
    arrow(ax, (1.2, 2.5), (1.2, 5.0), "next step", at=(1.3, 3.6), ha="left")

    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    if png is not None:
        fig.savefig(png, dpi=110)
    print(f"wrote {path}" + (f" and {png}" if png else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    draw(args.out, args.png)


if __name__ == "__main__":
    main()
