"""``python -m jaxascend.plot``: PNGs from synthetic metrics.jsonl files (training and eval
records, NaNs, a repeated step), the overlay of two runs, and one ``error:`` line per bad input."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from jaxascend import plot

matplotlib = pytest.importorskip("matplotlib", reason="jaxascend.plot draws with matplotlib")
import matplotlib.image  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GIB = 2**30


def train_record(step: int, loss: float, **extra) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 1.0 / step, "learning_rate": 1e-3 * step / 8,
            "tokens_per_s": 1000.0 + step, "rss_bytes": GIB + step * 2**20, "peak_rss_bytes": 2 * GIB,
            "elapsed_s": 0.1 * step, **extra}


def eval_record(step: int, loss: float) -> dict:
    return {"step": step, "eval_loss": loss, "eval_perplexity": math.exp(loss), "eval_tokens": 512}


def write_run(run_dir: Path, records: list[dict] | None = None, *, offset: float = 0.0) -> Path:
    """A run directory whose metrics.jsonl has 8 training steps (step 3 skipped for fp16
    overflow: grad_norm NaN), eval records at steps 4 and 8, and step 6 logged twice."""
    if records is None:
        records = [train_record(s, 4.0 - 0.3 * s + offset) for s in range(1, 9)]
        records[2]["grad_norm"] = float("nan")
        records.insert(5, train_record(6, 99.0))  # superseded by the next line, the same step
        records.insert(4, eval_record(4, 3.1 + offset))
        records.append(eval_record(8, 2.0 + offset))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.shape[2] in (3, 4)


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# Reading.

def test_read_metrics_later_duplicate_wins_and_eval_fields_merge(tmp_path):
    path = write_run(tmp_path / "run") / "metrics.jsonl"
    records = plot.read_metrics(path)
    assert list(records) == list(range(1, 9))  # one record per step, in step order
    assert records[6]["loss"] == pytest.approx(4.0 - 0.3 * 6)  # not the earlier 99.0
    # The eval record at a training step keeps that step's training loss.
    assert records[4]["eval_loss"] == 3.1 and records[4]["loss"] == pytest.approx(4.0 - 0.3 * 4)


def test_read_metrics_later_line_wins_even_out_of_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 2, "loss": 1.0}\n\n{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 0.5}\n')
    records = plot.read_metrics(path)
    assert list(records) == [1, 2] and records[2]["loss"] == 0.5


def test_series_skips_nan_and_missing_values(tmp_path):
    run = plot.load_runs([write_run(tmp_path / "run")])[0]
    steps, values = run.series("grad_norm")
    assert 3 not in steps and steps == [1, 2, 4, 5, 6, 7, 8] and all(math.isfinite(v) for v in values)
    assert run.series("eval_loss") == ([4, 8], [3.1, 2.0])
    assert run.series("peak_rss_bytes", 1 / GIB)[1] == [2.0] * 8


def test_labels_are_directory_names_with_parents_when_equal(tmp_path):
    files = [tmp_path / "a" / "tiny" / "metrics.jsonl", tmp_path / "b" / "tiny" / "metrics.jsonl",
             tmp_path / "small" / "metrics.jsonl"]
    assert plot.run_labels(files) == ["a/tiny", "b/tiny", "small"]


# Drawing.

def test_one_run_writes_every_metric_into_its_directory(tmp_path, monkeypatch, capsys):
    run = write_run(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    assert plot.main([str(run)]) == 0
    names = ["loss", "tokens_per_s", "memory", "learning_rate", "grad_norm"]
    assert capsys.readouterr().out.splitlines() == [f"wrote {run / n}.png" for n in names]
    for n in names:
        assert_png(run / f"{n}.png")
    assert not (tmp_path / "plots").exists()


def test_a_metrics_file_argument_and_out_dir(tmp_path):
    run = write_run(tmp_path / "tiny")
    written = plot.plot_runs([run / "metrics.jsonl"], tmp_path / "figures" / "new")
    assert [p.name for p in written] == ["loss.png", "tokens_per_s.png", "memory.png", "learning_rate.png",
                                        "grad_norm.png"]
    assert all(p.parent == tmp_path / "figures" / "new" for p in written)


def test_two_runs_overlay_into_plots(tmp_path, monkeypatch, capsys):
    write_run(tmp_path / "a" / "tiny")
    write_run(tmp_path / "b" / "tiny", offset=0.5)
    monkeypatch.chdir(tmp_path)
    assert plot.main(["a/tiny", "b/tiny"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "wrote plots/loss.png" and len(out) == 5
    for name in ("loss", "tokens_per_s", "memory"):
        assert_png(tmp_path / "plots" / f"{name}.png")


def test_two_runs_share_each_axis(tmp_path, monkeypatch):
    # The figure itself: one line per run and curve, labelled by the disambiguated run names.
    import matplotlib.pyplot as plt

    runs = plot.load_runs([write_run(tmp_path / "a" / "tiny"), write_run(tmp_path / "b" / "tiny", offset=0.5)])
    seen = {}
    monkeypatch.setattr(plt, "close", lambda fig: seen.setdefault("fig", fig))
    assert plot.draw_chart(plot.CHARTS[0], runs, tmp_path / "loss.png")
    (ax,) = seen["fig"].axes
    assert [line.get_label() for line in ax.get_lines()] == ["a/tiny train", "a/tiny held-out", "b/tiny train",
                                                             "b/tiny held-out"]
    assert list(ax.get_lines()[3].get_xdata()) == [4, 8]
    monkeypatch.undo()
    plt.close(seen["fig"])


def test_a_metric_no_run_has_gets_no_file(tmp_path, capsys):
    records = [{"step": s, "loss": 3.0 / s, "tokens_per_s": 100.0, "rss_bytes": GIB} for s in (1, 2, 3)]
    run = write_run(tmp_path / "run", records)
    assert plot.main([str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"wrote {run}/{n}.png" for n in ("loss", "tokens_per_s", "memory")]
    assert not (run / "learning_rate.png").exists() and not (run / "grad_norm.png").exists()


def test_cli_subprocess_writes_pngs(tmp_path):
    run = write_run(tmp_path / "tiny")
    proc = subprocess.run([sys.executable, "-m", "jaxascend.plot", str(run), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"wrote {tmp_path / 'out' / 'loss.png'}"
    assert_png(tmp_path / "out" / "memory.png")


# Bad input: one line naming the problem, exit 2.

def test_cli_subprocess_missing_run_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxascend.plot", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope'} does not exist"]
    assert proc.stdout == ""


@pytest.mark.parametrize("content,expected", [
    ("", "{file} is empty (no records)"),
    ("\n  \n", "{file} is empty (no records)"),
    ('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \n', "line 2 of {file} is not valid JSON"),
    ('{"step": 1}\n[1, 2]\n', "line 2 of {file} is not a JSON object"),
    ('{"step": 1, "loss": 2.0}\n{"loss": 1.0}\n', "{file}:2: a record without an integer step (got none)"),
    ('{"step": 1.5, "loss": 2.0}\n', "{file}:1: a record without an integer step (got 1.5)"),
    ('{"step": true, "loss": 2.0}\n', "{file}:1: a record without an integer step (got True)"),
    ('{"step": 1, "loss": "low"}\n', "{file}:1: loss is not a number (got 'low')"),
    ('{"step": 1, "elapsed_s": 2.0}\n', "nothing to plot: no record has a finite value of any of loss, eval_loss"),
])
def test_bad_metrics_file_is_one_error_line(tmp_path, capsys, content, expected):
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / "metrics.jsonl"
    path.write_text(content)
    assert plot.main([str(tmp_path / "run")]) == 2
    assert error_line(capsys).startswith("error: " + expected.format(file=path))
    assert not list((tmp_path / "run").glob("*.png"))


def test_bytes_that_are_not_utf8_are_not_valid_json(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe\n')
    assert plot.main([str(path)]) == 2
    assert error_line(capsys) == f"error: line 2 of {path} is not valid JSON"


def test_run_without_metrics_file_is_one_error_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert plot.main([str(tmp_path / "empty")]) == 2
    assert error_line(capsys) == f"error: no metrics.jsonl in {tmp_path / 'empty'}"


def test_second_run_missing_is_named(tmp_path, capsys):
    run = write_run(tmp_path / "tiny")
    assert plot.main([str(run), str(tmp_path / "other")]) == 2
    assert error_line(capsys) == f"error: {tmp_path / 'other'} does not exist"
    assert not (tmp_path / "plots").exists()


def test_out_that_is_a_file_is_one_error_line(tmp_path, capsys):
    run = write_run(tmp_path / "tiny")
    (tmp_path / "taken").write_text("")
    assert plot.main([str(run), "--out", str(tmp_path / "taken")]) == 2
    assert error_line(capsys) == f"error: --out {tmp_path / 'taken'} is not a directory"


def test_missing_matplotlib_is_one_error_line(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "tiny")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert plot.main([str(run)]) == 2
    assert error_line(capsys) == "error: jaxascend.plot needs matplotlib (pip install matplotlib)"
    assert not list(run.glob("*.png"))


# Import weight.

def test_plot_module_does_not_import_jax_or_matplotlib_at_import():
    # `import jaxascend` (the package __init__) loads JAX; the plot module itself must not add it,
    # and loads matplotlib only when it draws.
    tree = ast.parse(Path(plot.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"jax", "jaxlib", "flax", "optax", "numpy"}, imported
    top_level = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top_level |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert top_level <= set(sys.stdlib_module_names) | {"__future__"}, top_level
