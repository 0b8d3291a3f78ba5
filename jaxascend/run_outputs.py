"""A run's outputs at its last step, and a run that has them still to write.

At ``train.steps`` a run writes, after its final checkpoint: ``params.safetensors`` (when
``export.save_params``), the Hugging Face folder (``export.enabled``), ``samples.json``
(``eval.sample_prompts``) and, last, ``summary.json``. A run killed between that checkpoint and
``summary.json`` has a complete final checkpoint and missing outputs; the same command then
writes them from the checkpoint, byte for byte what the run would have written (the fp32 master
weights are the checkpoint's), instead of saying there is nothing to do.

    due = outputs_due(cfg, out_dir, step, stopped=False, saved_at=...)   # which are missing
    if due: write_outputs(cfg, out_dir, weights, origin, step, due)

A run that stopped at ``train.stop_at_step`` is not finished: its one output is ``summary.json``
(the checkpoint holds the state; the same command without ``train.stop_at_step`` goes on).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from jaxascend import console
from jaxascend.config import Config, ModelConfig
from jaxascend.hf import NO_TOKENIZER_NOTE, PARAMS_FILE, ParamsFile, export_hf, save_params
from jaxascend.kill_points import kill_point

SUMMARY_FILE = "summary.json"
SAMPLES_FILE = "samples.json"
EXPORT_CONFIG = "config.json"  # present in a complete export (written before the folder is renamed)


@dataclasses.dataclass
class TrainResult:
    """What a finished run hands back (also written to ``<out_dir>/summary.json``)."""

    steps: int
    losses: list[float]  # one per optimizer step
    num_params: int
    peak_rss_bytes: int
    peak_page_cache_bytes: int  # page cache held by the offload files (buffered I/O hides memory there)
    # Tokens per second after the invocation's first step (which compiles the step functions),
    # evaluations left out; None when the invocation ran one step. tokens_per_s_steps: the steps
    # measured; tokens_per_s_with_compile: over every step, the wall clock from the loop's start.
    tokens_per_s: Optional[float]
    engine: str  # "in-memory" or "offload"
    skipped_steps: int  # overflowed steps (fp16), state untouched
    arena_capacity_bytes: int
    arena_high_water_bytes: int
    ssd_bytes_read: int
    ssd_bytes_written: int
    out_dir: str
    eval_loss: Optional[float] = None  # the held-out loss at the end (None: no eval.paths)
    data: dict = dataclasses.field(default_factory=dict)  # examples seen / truncated / dropped
    updates_this_run: int = 0  # updates applied by this invocation (a resumed run counts from its checkpoint)
    # Everything this invocation wrote to the offload files (init or restore, every step, the
    # gradients included): the SSD endurance cost of the run. 0 for the in-memory engine.
    ssd_bytes_written_run: int = 0
    steps_this_run: int = 0  # steps this invocation ran (skipped ones included)
    ssd_bytes_first_step: tuple = (0, 0)  # (read, written) of its first step, in ssd_bytes_read/_written
    state_dtype: str = "float32"  # how the optimizer's moments were stored (optimizer.state_dtype)
    offload_files: str = "none"  # removed at the end (the last checkpoint holds the state), or kept
    tokens_per_s_steps: Optional[list[int]] = None  # [first, last] step of tokens_per_s
    tokens_per_s_with_compile: float = 0.0
    stop_at_step: Optional[int] = None  # the run stopped there (train.stop_at_step), before train.steps
    # The outputs this invocation wrote from the checkpoint of the run's last step, which a kill
    # had left unwritten (empty: none, or the run wrote them itself).
    written_from_checkpoint: list[str] = dataclasses.field(default_factory=list)
    # What made the run (jaxascend.provenance.RunStack.to_dict()): versions, commit, CPU, its
    # vector ISA, the AdamW kernel dispatched, the devices.
    stack: dict = dataclasses.field(default_factory=dict)
    # What train.epochs came to (jaxascend.data.EpochCount.to_dict(): epochs, unit, per_epoch,
    # covered, batches, grad_accum, steps); None: the run's length was train.steps.
    epochs: Optional[dict] = None
    initial_write: Optional[dict] = None  # the offload files' initial state: bytes, seconds, GB/s (None: not written)
    devices: str = ""  # the run's first line: "backend: gpu, 1 device: NVIDIA H200 (139.8 GiB)"
    # The largest peak of device memory over the local devices (None: not reported, the CPU
    # backend without JAXASCEND_DEVICE_MEM_BYTES); jaxascend.devices.
    peak_device_mem_bytes: Optional[int] = None


@dataclass(frozen=True)
class Provenance:
    """Where a run's weights came from: what an export (now or from a checkpoint later) needs
    beyond the weights. Saved with every checkpoint and in ``params.safetensors``."""

    model_config: ModelConfig  # resolved, vocab_size filled in
    tokenizer: str | None  # the tokenizer folder (None: the byte tokenizer)
    model_source: str | None  # the Hugging Face folder the run fine-tunes (None: from scratch)
    source_dtype: str  # that checkpoint's dtype, or model.param_dtype from scratch

    def export_dtype(self, dtype: str) -> str:
        """``export.dtype`` with ``"source"`` resolved."""
        return self.source_dtype if dtype == "source" else dtype

    def to_dict(self) -> dict:
        return {"model_config": dataclasses.asdict(self.model_config), "tokenizer": self.tokenizer,
                "model_source": self.model_source, "source_dtype": self.source_dtype}


@dataclass(frozen=True)
class OutputsDue:
    """Which of a run's outputs at its last step are still to be written."""

    params: bool = False  # params.safetensors
    export: bool = False  # the Hugging Face folder
    samples: bool = False  # samples.json
    summary: bool = False  # summary.json

    def __bool__(self) -> bool:
        return self.params or self.export or self.samples or self.summary

    def names(self, cfg: Config, out_dir: Path) -> list[str]:
        return [name for name, due in ((PARAMS_FILE, self.params), (str(export_dir(cfg, out_dir)), self.export),
                                       (SAMPLES_FILE, self.samples), (SUMMARY_FILE, self.summary)) if due]


def export_dir(cfg: Config, out_dir: Path) -> Path:
    return Path(cfg.export.dir) if cfg.export.dir else out_dir / "hf"


def outputs_due(cfg: Config, out_dir: Path, step: int, *, stopped: bool, saved_at: Optional[float]) -> OutputsDue:
    """The outputs of the run at ``step`` (its last) that are missing: each is current when it
    exists and was written for ``step`` (``params.safetensors`` and ``summary.json`` record their
    step) or, for the export and the samples, after the step's checkpoint (``saved_at``, the
    checkpoint's time). A stopped run's only output is its summary."""
    summary = not _summary_is_of(out_dir / SUMMARY_FILE, step)
    if stopped:
        return OutputsDue(summary=summary)
    return OutputsDue(params=cfg.export.save_params and not _params_are_of(out_dir / PARAMS_FILE, step),
                      export=cfg.export.enabled and not _written_after(export_dir(cfg, out_dir) / EXPORT_CONFIG,
                                                                       saved_at),
                      samples=bool(cfg.eval.sample_prompts) and not _written_after(out_dir / SAMPLES_FILE, saved_at),
                      summary=summary)


def _summary_is_of(path: Path, step: int) -> bool:
    try:
        return json.loads(path.read_text()).get("steps") == step
    except (OSError, ValueError, AttributeError):
        return False


def _params_are_of(path: Path, step: int) -> bool:
    if not path.is_file():
        return False
    try:
        f = ParamsFile(path)
    except (OSError, ValueError):  # a torn or foreign file: written again
        return False
    try:
        return f.step == step
    finally:
        f.close()


def _written_after(path: Path, saved_at: Optional[float]) -> bool:
    return path.is_file() and (saved_at is None or path.stat().st_mtime >= saved_at)


def write_weights(cfg: Config, out_dir: Path, params, origin: Provenance, step: int,
                  due: OutputsDue = OutputsDue(params=True, export=True)) -> None:
    """The run's weights after ``step``: ``params.safetensors`` (exportable later) and, if asked,
    a HF folder (``due`` says which of the configured ones to write). A folder a killed export
    left half-written (``.<name>.partial-*``) is removed first."""
    kill_point("final_outputs")  # tests: a kill after the final checkpoint, before the outputs
    if cfg.export.save_params and due.params:
        save_params(out_dir / PARAMS_FILE, params, origin.model_config, tokenizer=origin.tokenizer,
                    model_source=origin.model_source, source_dtype=origin.source_dtype, step=step)
    if cfg.export.enabled and due.export:
        target = export_dir(cfg, out_dir)
        remove_partial_exports(target)
        export_hf(params, origin.model_config, target, tokenizer_src=origin.tokenizer,
                  dtype=origin.export_dtype(cfg.export.dtype), shard_bytes=cfg.export.shard_bytes,
                  model_src=origin.model_source)
        if origin.tokenizer is None:
            console.note(NO_TOKENIZER_NOTE)


def remove_partial_exports(target: Path) -> None:
    """Removes the staging folders (``.<name>.partial-*`` beside ``target``) that an export killed
    before its rename left behind; each is one ``note:`` line."""
    if not target.parent.is_dir():
        return
    for stale in sorted(target.parent.glob(f".{target.name}.partial-*")):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
            console.note(f"removed {stale}: an export a killed run left half-written")


def write_summary(out_dir: Path, result: Any) -> None:
    """``summary.json`` (a dataclass), written last and atomically: its presence with the step
    says the run's outputs are complete."""
    tmp = out_dir / (SUMMARY_FILE + ".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(result), indent=1))
    tmp.replace(out_dir / SUMMARY_FILE)


def write_samples(results: list[dict], out_dir: Path) -> None:
    """``samples.json``, and each prompt with its answer on the terminal."""
    (out_dir / SAMPLES_FILE).write_text(json.dumps(results, indent=1, ensure_ascii=False))
    for r in results:
        print(f"> {r['prompt']}\n{r['completion']}")


def last_record(out_dir: Path, step: int) -> dict:
    """The ``metrics.jsonl`` record of ``step`` ({} when there is none)."""
    path = out_dir / "metrics.jsonl"
    found: dict = {}
    if not path.is_file():
        return found
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("step") == step:
            found = record
    return found
