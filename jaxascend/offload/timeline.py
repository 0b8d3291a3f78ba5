"""The timeline of one offloaded step: which thread did what, when (JSON, and a PNG for people).

:class:`StepTimeline` collects, in ``time.perf_counter`` seconds:

* the trainer thread: waiting for the previous update's top-level leaves, then the jitted
  forward/backward (XLA's threads run it; the trainer waits for its statistics);
* the layer scan's fetches of each layer from the parameter source: when it asked, when it got
  the weights (a long bar is the forward waiting for the optimizer, or for the disk);
* the optimizer thread: per chunk, the wait for the pipeline to hand out the chunk (SSD reads
  and write-back behind it) and the fused kernel; and the moment each layer became ready.

Overlapped, the timeline recorded at step t holds the update of step t-1 beside the
forward/backward of step t; sequential, the forward/backward of step t then its update.
:func:`write_timeline_png` draws it (matplotlib, when installed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROWS = ("trainer thread", "layer fetches", "optimizer thread")
COLORS = {"forward/backward": "#4c72b0", "waits for top leaves": "#dd8452", "fetch": "#55a868",
          "io wait": "#c44e52", "kernel": "#8172b3"}


@dataclass
class StepTimeline:
    """One step's events; ``bars[row]`` holds ``(begin, end, what)``."""

    step: int
    overlap: bool
    bars: dict = field(default_factory=lambda: {row: [] for row in ROWS})
    layer_ready: dict = field(default_factory=dict)  # layer -> time
    notes: dict = field(default_factory=dict)

    def add(self, row: str, begin: float, end: float, what: str) -> None:
        self.bars[row].append((float(begin), float(end), what))

    def add_update(self, trace: Optional[list], layer_ready: dict) -> None:
        for what, begin, end, _leaf, _layer in trace or ():
            self.add("optimizer thread", begin, end, what)
        self.layer_ready.update({int(k): float(v) for k, v in layer_ready.items()})

    def add_fetches(self, events) -> None:
        for layer, asked, served in events:
            self.add("layer fetches", asked, served, f"fetch {layer}")

    def origin(self) -> float:
        times = [b for bars in self.bars.values() for b, _, _ in bars] + list(self.layer_ready.values())
        return min(times) if times else 0.0

    def to_dict(self) -> dict:
        """Times relative to the first event, in seconds."""
        t0 = self.origin()
        return {"step": self.step, "overlap": self.overlap, "notes": self.notes,
                "bars": {row: [[round(b - t0, 6), round(e - t0, 6), w] for b, e, w in bars]
                         for row, bars in self.bars.items()},
                "layer_ready": {str(k): round(v - t0, 6) for k, v in sorted(self.layer_ready.items())}}


def write_timeline_json(timeline: StepTimeline, path: Path) -> None:
    Path(path).write_text(json.dumps(timeline.to_dict(), indent=1))


def write_timeline_png(timeline: dict, path: Path, title: Optional[str] = None) -> bool:
    """Draws a :meth:`StepTimeline.to_dict` as a Gantt chart; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(11, 3.2))
    seen = set()
    for y, row in enumerate(ROWS):
        for begin, end, what in timeline["bars"].get(row, []):
            key = "fetch" if what.startswith("fetch") else what
            label = None if key in seen else key
            seen.add(key)
            ax.broken_barh([(begin, max(end - begin, 1e-4))], (y - 0.35, 0.7), color=COLORS.get(key, "grey"),
                           label=label, edgecolor="none")
    for layer, t in timeline.get("layer_ready", {}).items():
        ax.plot([t, t], [len(ROWS) - 1.45, len(ROWS) - 0.55], color="black", lw=0.8)
        ax.text(t, len(ROWS) - 0.45, f"L{layer}", fontsize=7, ha="center", va="bottom")
    ax.set_yticks(range(len(ROWS)), ROWS)
    ax.set_ylim(-0.6, len(ROWS) + 0.1)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    mode = "overlapped" if timeline.get("overlap") else "sequential"
    ax.set_title(title or f"one {mode} step (step {timeline.get('step')}): black ticks = layer L updated")
    ax.legend(loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
