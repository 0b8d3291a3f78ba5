"""The weights a run left behind, whatever form they take: what the export and generate CLIs open.

    with open_weights("runs/my-run") as w:       # or a step dir, a checkpoint dir, a params file
        w.read(("layers", "mlp", "up_proj", "kernel"), 3)   # one layer of one tensor
        w.model_config, w.tokenizer, w.run_config

``open_weights`` accepts:

* a run's output folder: its newest weights, i.e. ``params.safetensors`` (written at the end of a
  run) or, when the run was killed or went on after it, its newest complete checkpoint;
* an Orbax step directory (``<run>/checkpoints/<step>``) or a checkpoint directory (its newest
  complete step): an offloaded run's fp32 master weights are streamed from it one layer at a time;
* a ``params.safetensors`` file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import yaml

from jaxascend.checkpoint.resume import complete_steps
from jaxascend.checkpoint.weights import CheckpointWeights
from jaxascend.config import ModelConfig
from jaxascend.data import tokenizer_folder
from jaxascend.hf import PARAMS_FILE, ParamsFile

META_DIR = "meta"  # present in every complete step directory
RUN_CONFIG_FILE = "config.yaml"  # the resolved config a run writes into train.out_dir


@dataclass
class RunWeights:
    """One source of a run's weights: a reader ``read(path, layer)``, the model config, and the
    provenance an export or a sampler needs. Close it (or use it as a context manager)."""

    read: Callable[[tuple[str, ...], Optional[int]], np.ndarray]
    model_config: ModelConfig  # resolved: vocab_size filled in
    tokenizer: Optional[str]  # the tokenizer folder the run used; None: the byte tokenizer
    model_source: Optional[str]  # the Hugging Face folder the run started from
    source_dtype: str  # that checkpoint's dtype (export.dtype "source")
    description: str  # what was opened, for messages
    run_config: Optional[dict] = None  # the run's resolved config, when it can be found
    close: Callable[[], None] = field(default=lambda: None)

    def __enter__(self) -> "RunWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_run_config(run_dir: Path) -> Optional[dict]:
    """``<run_dir>/config.yaml`` as a dict, None when it is absent or unreadable."""
    config = run_dir / RUN_CONFIG_FILE
    if not config.is_file():
        return None
    try:
        saved = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def _from_params_file(f: ParamsFile) -> RunWeights:
    return RunWeights(f.read, f.model_config, f.tokenizer, f.model_source, f.source_dtype, f.path,
                      _read_run_config(Path(f.path).parent), f.close)


def _from_step(step_dir: Path) -> RunWeights:
    w = CheckpointWeights(step_dir)
    origin = w.origin or {}
    run = w.run_config
    if w.origin is None:  # a checkpoint made before the provenance was saved: from its run config
        data, model = run.get("data", {}), run.get("model", {})
        origin = {"tokenizer": tokenizer_folder(data.get("tokenizer", "byte"), model.get("path")),
                  "model_source": model.get("path"), "source_dtype": model.get("param_dtype", "float32")}
    return RunWeights(w.read, w.model_config, origin["tokenizer"], origin["model_source"], origin["source_dtype"],
                      f"checkpoint {step_dir}", run, w.close)


def _checkpoint_dir_of(run_dir: Path) -> Path:
    """``checkpoint.dir`` of the run in ``run_dir`` (its config.yaml), else ``<run_dir>/checkpoints``."""
    saved = _read_run_config(run_dir) or {}
    checkpoint = saved.get("checkpoint")
    directory = checkpoint.get("dir") if isinstance(checkpoint, dict) else None
    return Path(directory) if directory else run_dir / "checkpoints"


def open_weights(checkpoint: str) -> RunWeights:
    """The weights ``checkpoint`` names (see the module doc); ValueError naming what is missing."""
    path = Path(os.path.expanduser(checkpoint))
    if path.is_file():
        return _from_params_file(ParamsFile(path))
    if not path.is_dir():
        raise ValueError(f"--checkpoint: {checkpoint!r} does not exist")
    if (path / META_DIR).is_dir():
        return _from_step(path)
    steps = complete_steps(path)
    if steps:  # a checkpoint directory
        return _from_step(path / str(steps[-1]))
    params = path / PARAMS_FILE
    checkpoints = _checkpoint_dir_of(path)
    steps = complete_steps(checkpoints)
    if not params.is_file() and not steps:
        raise ValueError(f"--checkpoint: {checkpoint!r} has no {PARAMS_FILE} and no complete checkpoint in "
                         f"{checkpoints} (is it a run's output folder?)")
    if not steps:
        return _from_params_file(ParamsFile(params))
    newest = checkpoints / str(steps[-1])
    if params.is_file():  # the final weights, unless the run went on (or was resumed) after them
        f = ParamsFile(params)
        newer = steps[-1] > f.step if f.step is not None else newest.stat().st_mtime > params.stat().st_mtime
        if not newer:
            return _from_params_file(f)
        f.close()
    return _from_step(newest)
