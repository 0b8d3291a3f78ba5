"""Command-line plots of runs' metrics: ``python -m jaxascend.plot RUN [RUN ...] [--out DIR]``.

Each RUN is a run directory (holding ``metrics.jsonl``) or a ``metrics.jsonl`` file. One PNG per
metric goes to ``--out`` (default: the run's directory for one run, ``./plots`` for several):
``loss.png`` (training loss, and the held-out ``eval_loss`` dashed with markers),
``tokens_per_s.png``, ``memory.png`` (RSS and peak RSS in GiB), and ``learning_rate.png`` /
``grad_norm.png``; a metric no run records gets no file. Several runs overlay in one figure per
metric, labelled by their directory names. Bad input ends with one ``error: ...`` line and exit
status 2. :func:`plot_runs` is the same as a library call.

Only the standard library is imported at module level; matplotlib is loaded when a figure is drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


METRICS_FILE = "metrics.jsonl"
GIB = 2**30


class PlotError(Exception):
    """Input that cannot be plotted (a missing run, a malformed metrics file) or no matplotlib."""


@dataclass(frozen=True)
class Curve:
    key: str  # the record's field
    label: str  # its name in the legend ("" for the chart's only curve)
    style: str = "-"  # matplotlib format string


@dataclass(frozen=True)
class Chart:
    name: str  # the PNG's stem
    title: str
    ylabel: str
    curves: tuple[Curve, ...]
    scale: float = 1.0  # the values are multiplied by it (bytes -> GiB)


CHARTS = (
    Chart("loss", "loss", "loss", (Curve("loss", "train"), Curve("eval_loss", "held-out", "--o"))),
    Chart("tokens_per_s", "throughput", "tokens/s", (Curve("tokens_per_s", ""),)),
    Chart("memory", "host memory", "GiB",
          (Curve("rss_bytes", "RSS"), Curve("peak_rss_bytes", "peak RSS", "--")), scale=1 / GIB),
    Chart("learning_rate", "learning rate", "learning rate", (Curve("learning_rate", ""),)),
    Chart("grad_norm", "gradient norm", "global gradient norm", (Curve("grad_norm", ""),)),
)
PLOTTED_KEYS = tuple(c.key for chart in CHARTS for c in chart.curves)


@dataclass(frozen=True)
class Run:
    path: Path  # its metrics file
    label: str  # its name in the legends
    records: dict[int, dict[str, Any]]  # step -> record, in step order

    def series(self, key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key``, skipping records without it and non-finite values (a
        skipped fp16 step logs a NaN gradient norm)."""
        points = [(step, r[key] * scale) for step, r in self.records.items()
                  if r.get(key) is not None and math.isfinite(r[key])]
        return [s for s, _ in points], [v for _, v in points]


def metrics_file(run: str | Path) -> Path:
    """The metrics file of ``run``: the path itself when it is a file, else ``run/metrics.jsonl``."""
    path = Path(run)
    if not path.exists():
        raise PlotError(f"{path} does not exist")
    if path.is_dir():
        path = path / METRICS_FILE
        if not path.is_file():
            raise PlotError(f"no {METRICS_FILE} in {run}")
    return path


def read_metrics(path: str | Path) -> dict[int, dict[str, Any]]:
    """The records of a metrics file by step, in step order.

    A step that appears on several lines is one record whose later lines' values win; a field
    only an earlier line has stays, so an eval record (``step``, ``eval_loss``, ...) logged at a
    training step does not hide that step's loss. Blank lines are skipped.
    """
    path = Path(path)
    records: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            raise PlotError(f"line {n} of {path} is not valid JSON") from None
        if not isinstance(record, dict):
            raise PlotError(f"line {n} of {path} is not a JSON object")
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            got = "none" if "step" not in record else repr(step)
            raise PlotError(f"{path}:{n}: a record without an integer step (got {got})")
        for key in PLOTTED_KEYS:
            value = record.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise PlotError(f"{path}:{n}: {key} is not a number (got {value!r})")
        records.setdefault(step, {}).update(record)
    if not records:
        raise PlotError(f"{path} is empty (no records)")
    return dict(sorted(records.items()))


def run_labels(files: Sequence[Path]) -> list[str]:
    """Each run's label: its directory's name (``dir/file`` for a metrics file of another name);
    runs of equal labels get as many parent directories as it takes to tell them apart."""
    keys = [f.resolve().parts[:-1] if f.name == METRICS_FILE else f.resolve().parts for f in files]
    labels = []
    for key, f in zip(keys, files):
        depth = 1 if f.name == METRICS_FILE else 2
        while depth < len(key) and any(other != key and other[-depth:] == key[-depth:] for other in keys):
            depth += 1
        labels.append(str(Path(*key[-depth:])))
    return labels


def load_runs(runs: Sequence[str | Path]) -> list[Run]:
    """Reads the metrics of each run (see :func:`metrics_file` and :func:`read_metrics`)."""
    files = [metrics_file(r) for r in runs]
    return [Run(f, label, read_metrics(f)) for f, label in zip(files, run_labels(files))]


def default_out_dir(runs: Sequence[str | Path]) -> Path:
    """The single run's directory, or ``./plots`` for several runs."""
    if len(runs) == 1:
        path = Path(runs[0])
        return path if path.is_dir() else path.parent
    return Path("plots")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("jaxascend.plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def draw_chart(chart: Chart, runs: Sequence[Run], path: Path) -> bool:
    """Draws ``chart`` for ``runs`` into ``path``; False (and no file) when no run has its metric.
    One colour per run when there are several, else one per curve."""
    lines = [(i if len(runs) > 1 else j, run, curve, run.series(curve.key, chart.scale))
             for i, run in enumerate(runs) for j, curve in enumerate(chart.curves)]
    lines = [line for line in lines if line[3][0]]
    if not lines:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for colour, run, curve, (steps, values) in lines:
        label = " ".join(x for x in (run.label if len(runs) > 1 else "", curve.label) if x) or run.label
        ax.plot(steps, values, curve.style, color=f"C{colour % 10}", label=label, markersize=4,
                **({"marker": "o"} if len(steps) == 1 else {}))  # a lone point has no line to show
    ax.set_title(chart.title if len(runs) > 1 else f"{chart.title}: {runs[0].label}")
    ax.set_xlabel("step")
    ax.set_ylabel(chart.ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_runs(runs: Sequence[str | Path], out_dir: str | Path | None = None) -> list[Path]:
    """Writes one PNG per metric recorded by any of ``runs`` (run directories or metrics files)
    into ``out_dir`` (default: :func:`default_out_dir`; created) and returns their paths.

    Raises :class:`PlotError` naming the problem for bad input or a missing matplotlib.

    >>> plot_runs(["runs/tiny"])  # doctest: +SKIP
    [PosixPath('runs/tiny/loss.png'), PosixPath('runs/tiny/tokens_per_s.png'), ...]
    """
    if not runs:
        raise PlotError("no run to plot")
    loaded = load_runs(runs)
    if not any(run.series(key)[0] for run in loaded for key in PLOTTED_KEYS):
        raise PlotError(f"nothing to plot: no record has a finite value of any of {', '.join(PLOTTED_KEYS)}")
    out = Path(out_dir) if out_dir is not None else default_out_dir(runs)
    if out.exists() and not out.is_dir():
        raise PlotError(f"--out {out} is not a directory")
    _pyplot()  # fails before anything is written when matplotlib is missing
    out.mkdir(parents=True, exist_ok=True)
    return [out / f"{chart.name}.png" for chart in CHARTS
            if draw_chart(chart, loaded, out / f"{chart.name}.png")]


PROG = "python -m jaxascend.plot"


def parse_args(argv: list[str] | None = None, prog: str = PROG) -> argparse.Namespace:
    from jaxascend import console  # light; imported here so that the module's own imports stay stdlib

    parser = console.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a run directory or its metrics.jsonl")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where the PNGs go (default: the run's directory; ./plots for several runs)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """The CLI (``prog``: the name its usage line shows): 0 when the PNGs were written, 2 after one
    ``error:`` line otherwise."""
    args = parse_args(argv, prog)
    from jaxascend import console

    def plot() -> int:
        for path in plot_runs(args.runs, args.out):
            print(f"wrote {path}")
        return 0

    with console.one_line_output():
        return console.report_errors(plot, (PlotError, OSError))


if __name__ == "__main__":
    sys.exit(main())
