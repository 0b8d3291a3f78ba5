"""The plots of ``scripts/bench_step.py``: seconds per step by contender, and against the
micro-batches per step (``--grad-accum``)."""

from __future__ import annotations

from pathlib import Path


def plot_accumulation(report: dict, path: Path, order: tuple) -> None:
    """s/step and tokens/s against A, one line per contender (in ``order``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    acc = report["accumulation"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode in order:
        xs = [a for a in acc["grad_accum"] if mode in acc["per_a"][a]["step_seconds"]]
        if not xs:
            continue
        axes[0].plot(xs, [acc["per_a"][a]["step_seconds"][mode] for a in xs], "o-", label=mode)
        axes[1].plot(xs, [acc["per_a"][a]["tokens_per_second"].get(mode) for a in xs], "o-", label=mode)
    for ax, label in zip(axes, ("seconds per step (median)", "tokens per second (median)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches per step (A)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['shape']} Llama, {report['batch']} x {report['seq_len']} tokens per micro-batch, bf16 — "
                 f"{report['cpu']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(report: dict, path: Path, order: tuple) -> None:
    """s/step of every contender that ran (in ``order``), its range over rounds and its own SSD floor."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps = report["summary"]["step_seconds"]
    names = [m for m in order if m in steps]
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(names)), 3.8))
    meds = [steps[m]["median"] for m in names]
    errs = [[steps[m]["median"] - steps[m]["min"] for m in names], [steps[m]["max"] - steps[m]["median"] for m in names]]
    colors = ["#4c72b0", "#dd8452", "#55a868", "#8172b3", "#c44e52", "#937860", "#da8bc3", "#8c8c8c", "#ccb974"]
    ax.bar(names, meds, yerr=errs, capsize=4, color=[colors[i % len(colors)] for i in range(len(names))])
    ax.tick_params(axis="x", labelsize=7, labelrotation=20)
    own = report["summary"].get("contender_ssd_floor_seconds", {})
    marks = [(i, own[m]["median"]) for i, m in enumerate(names) if own.get(m)]
    if marks:  # each contender's own bytes at the round's raw speeds
        ax.hlines([f for _, f in marks], [i - 0.4 for i, _ in marks], [i + 0.4 for i, _ in marks], colors="black",
                  lw=2, label="its SSD floor (its bytes at the raw disk speeds)")
        ax.legend(fontsize=7)
    elif report["summary"]["ssd_floor_seconds"].get("median"):
        floor = report["summary"]["ssd_floor_seconds"]["median"]
        ax.axhline(floor, color="black", ls="--", lw=1, label=f"SSD floor {floor:.1f} s")
        ax.legend()
    ax.set_ylabel("seconds per step (median, range over rounds)")
    ax.set_title(f"{report['shape']} Llama, seq {report['seq_len']}, batch {report['batch']}, bf16 — {report['cpu']}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
