"""``python -m jaxascend.export``: a run, a checkpoint or a parameter file -> a Hugging Face folder.

    python -m jaxascend.export --checkpoint runs/my-run --out exports/my-run
    python -m jaxascend.export --checkpoint runs/my-run/checkpoints/300 --out exports/my-run-300

``--checkpoint`` is one of:

* a run's output folder: its newest weights, i.e. ``params.safetensors`` (written at the end of a
  run) or, when the run was killed or went on after it, its newest complete checkpoint;
* an Orbax step directory (``<run>/checkpoints/<step>``) or a checkpoint directory (its newest
  complete step): an offloaded run's fp32 master weights are streamed from it one layer at a time;
* a ``params.safetensors`` file.

``--dtype source`` (the default) stores the dtype of the checkpoint the run started from. Errors
print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import yaml

from jaxascend import console
from jaxascend.checkpoint import CheckpointError, CheckpointWeights, complete_steps
from jaxascend.config import ConfigError, parse_bytes
from jaxascend.data import tokenizer_folder
from jaxascend.hf import DEFAULT_SHARD_BYTES, DTYPE_NAMES, NO_TOKENIZER_NOTE, PARAMS_FILE, ParamsFile, export_hf

META_DIR = "meta"  # present in every complete step directory


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxascend.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help=f"run output folder, checkpoint step directory, checkpoint directory or {PARAMS_FILE}")
    p.add_argument("--out", required=True, help="new Hugging Face folder to write (must not exist or be empty)")
    p.add_argument("--dtype", default="source", choices=["source", *DTYPE_NAMES],
                   help="stored dtype (default: that of the checkpoint the run started from)")
    p.add_argument("--shard-size", default=str(DEFAULT_SHARD_BYTES),
                   help="largest safetensors shard, e.g. 2GB or 500MiB (default 5GB)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder to copy (default: the one the run used)")
    return p


class _Weights:
    """What an export needs from any source: a reader, the model config and the provenance."""

    def __init__(self, read, model_config, tokenizer, model_source, source_dtype, description, closer):
        self.read, self.model_config, self.tokenizer = read, model_config, tokenizer
        self.model_source, self.source_dtype, self.description = model_source, source_dtype, description
        self.close = closer


def _from_params_file(f: ParamsFile) -> _Weights:
    return _Weights(f.read, f.model_config, f.tokenizer, f.model_source, f.source_dtype, f.path, f.close)


def _from_step(step_dir: Path) -> _Weights:
    w = CheckpointWeights(step_dir)
    origin = w.origin or {}
    run = w.run_config
    if w.origin is None:  # a checkpoint made before the provenance was saved: from its run config
        data, model = run.get("data", {}), run.get("model", {})
        origin = {"tokenizer": tokenizer_folder(data.get("tokenizer", "byte"), model.get("path")),
                  "model_source": model.get("path"), "source_dtype": model.get("param_dtype", "float32")}
    return _Weights(w.read, w.model_config, origin["tokenizer"], origin["model_source"], origin["source_dtype"],
                    f"checkpoint {step_dir}", w.close)


def _checkpoint_dir_of(run_dir: Path) -> Path:
    """``checkpoint.dir`` of the run in ``run_dir`` (its config.yaml), else ``<run_dir>/checkpoints``."""
    config = run_dir / "config.yaml"
    if config.is_file():
        try:
            saved = yaml.safe_load(config.read_text()) or {}
            directory = (saved.get("checkpoint") or {}).get("dir")
        except (yaml.YAMLError, AttributeError):
            directory = None
        if directory:
            return Path(directory)
    return run_dir / "checkpoints"


def open_weights(checkpoint: str) -> _Weights:
    """The weights ``--checkpoint`` names (see the module doc); ValueError naming what is missing."""
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    with console.one_line_output():
        return _export(args)


def _export(args: argparse.Namespace) -> int:
    try:
        shard_bytes = parse_bytes(args.shard_size, "--shard-size")
        weights = open_weights(args.checkpoint)
        try:
            tokenizer = args.tokenizer or weights.tokenizer
            dtype = weights.source_dtype if args.dtype == "source" else args.dtype
            out = export_hf(weights.read, weights.model_config, args.out, tokenizer_src=tokenizer, dtype=dtype,
                            shard_bytes=shard_bytes, model_src=weights.model_source)
        finally:
            weights.close()
    except (ValueError, ConfigError, OSError, CheckpointError) as err:
        if console.debugging():
            raise
        console.error(console.first_line(err))
        return 2
    if tokenizer is None:
        console.note(NO_TOKENIZER_NOTE)
    print(f"wrote {out} ({dtype}, from {weights.description})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
