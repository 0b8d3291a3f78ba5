"""A run's figures for TensorBoard and Weights & Biases (``train.report_to``), behind one owner.

    with Reporter(cfg.train.report_to, out_dir, run_config=cfg.to_dict(), enabled=group.is_main) as reporter:
        reporter.write(record)          # one metrics.jsonl record (MetricsLog.write forwards each)
        reporter.samples(results, step) # the end-of-run answers to eval.sample_prompts, as text

Every field of a record goes out: numbers and true/false as scalars under the field's own name
(``loss``, ``eval_loss``, ``tokens_per_s``, ...; a nested mapping such as ``data_state`` as
``data_state/document``), text fields (``engine``, ``overlap_refused``, ...) as text whenever
they change. TensorBoard's event files go to ``<out_dir>/tensorboard`` through tensorboardX (a
resumed run purges the steps past its checkpoint, as ``metrics.jsonl`` moves them aside); W&B runs
(``wandb``, an optional package) go to ``<out_dir>/wandb`` with the run's config, under the
project ``WANDB_PROJECT`` (default ``jaxascend``), online or offline as ``WANDB_MODE`` says. Only
process 0 of a job reports (``enabled``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

from jaxascend.config import check_report_backends


def flatten(record: dict[str, Any], prefix: str = "") -> tuple[dict[str, float], dict[str, str]]:
    """``(scalars, texts)`` of a record: numbers and bools by name, strings apart, nested mappings
    as ``outer/inner``; lists and None are left out."""
    scalars: dict[str, float] = {}
    texts: dict[str, str] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            inner_scalars, inner_texts = flatten(value, f"{name}/")
            scalars.update(inner_scalars)
            texts.update(inner_texts)
        elif isinstance(value, (bool, int, float)):
            scalars[name] = float(value)
        elif isinstance(value, str):
            texts[name] = value
    return scalars, texts


def samples_markdown(results: list[dict]) -> str:
    """The answers to the sample prompts as a markdown table (TensorBoard's text plugin renders it)."""
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
    rows = [f"| {cell(r['prompt'])} | {cell(r['completion'])} |" for r in results]
    return "\n".join(["| prompt | completion |", "|---|---|", *rows])


class _Writer(Protocol):
    def scalars(self, step: int, values: dict[str, float]) -> None: ...
    def texts(self, step: int, values: dict[str, str]) -> None: ...
    def samples(self, step: int, results: list[dict]) -> None: ...
    def close(self) -> None: ...


class _TensorBoard:
    """Event files in ``<out_dir>/tensorboard`` (tensorboardX's writer)."""

    def __init__(self, out_dir: Path, resumed_from: int):
        from tensorboardX import SummaryWriter

        # A resumed run purges the events past its checkpoint (written before the interruption);
        # the pid in the file name keeps two invocations within one second apart.
        self._writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resumed_from + 1 if resumed_from else None,
                                     flush_secs=30, filename_suffix=f".{os.getpid()}.{resumed_from}")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def texts(self, step: int, values: dict[str, str]) -> None:
        for tag, value in values.items():
            self._writer.add_text(tag, value, step)

    def samples(self, step: int, results: list[dict]) -> None:
        self._writer.add_text("samples", samples_markdown(results), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _WandB:
    """A W&B run in ``<out_dir>/wandb`` (its project: ``WANDB_PROJECT``, default ``jaxascend``)."""

    def __init__(self, out_dir: Path, run_config: dict):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jaxascend"), name=out_dir.name,
                               dir=str(out_dir), config=run_config)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def texts(self, step: int, values: dict[str, str]) -> None:
        self._run.summary.update(values)  # the latest value of each text field

    def samples(self, step: int, results: list[dict]) -> None:
        table = self._wandb.Table(columns=["prompt", "completion"],
                                  data=[[r["prompt"], r["completion"]] for r in results])
        self._run.log({"samples": table}, step=step)

    def close(self) -> None:
        self._run.finish()


class Reporter:
    """The run's TensorBoard / W&B writers (see the module doc); a context manager that closes
    them. ``enabled`` False (a job's processes but 0) or an empty ``report_to``: writes nothing."""

    def __init__(self, report_to: Sequence[str], out_dir: Path, *, run_config: Optional[dict] = None,
                 resumed_from: int = 0, enabled: bool = True):
        self._writers: list[_Writer] = []
        self._texts: dict[str, str] = {}  # the text fields as last written (written again when changed)
        if not enabled:
            return
        check_report_backends(list(report_to))  # the config's loading refused them already
        try:
            for name in report_to:
                self._writers.append(_TensorBoard(out_dir, resumed_from) if name == "tensorboard"
                                     else _WandB(out_dir, run_config or {}))
        except BaseException:
            self.close()
            raise

    def write(self, record: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` record (its ``step`` is the writers' step)."""
        if not self._writers:
            return
        step = int(record["step"])
        scalars, texts = flatten({k: v for k, v in record.items() if k != "step"})
        changed = {k: v for k, v in texts.items() if self._texts.get(k) != v}
        self._texts.update(changed)
        for writer in self._writers:
            writer.scalars(step, scalars)
            if changed:
                writer.texts(step, changed)

    def samples(self, results: list[dict], step: int) -> None:
        """The answers to ``eval.sample_prompts`` (``prompt``, ``completion`` each) as text."""
        for writer in self._writers:
            writer.samples(step, results)

    def close(self) -> None:
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.close()

    def __enter__(self) -> "Reporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
