"""``python -m jaxascend.export``: a finished run -> a Hugging Face folder.

    python -m jaxascend.export --checkpoint runs/my-run --out runs/my-run/hf --dtype bfloat16

``--checkpoint`` is a run's output folder (holding ``params.safetensors``, written at the end
of a run) or that file itself. Orbax step directories will be accepted once training
checkpoints exist. Errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Optional, Sequence

from jaxascend.config import ConfigError, parse_bytes
from jaxascend.hf import DEFAULT_SHARD_BYTES, DTYPE_NAMES, PARAMS_FILE, ParamsFile, export_hf


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxascend.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help=f"run output folder (with {PARAMS_FILE}) or the {PARAMS_FILE} file")
    p.add_argument("--out", required=True, help="new Hugging Face folder to write (must not exist or be empty)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPE_NAMES), help="stored dtype")
    p.add_argument("--shard-size", default=str(DEFAULT_SHARD_BYTES),
                   help="largest safetensors shard, e.g. 2GB or 500MiB (default 5GB)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder to copy (default: the one the run used)")
    return p


def resolve_params_file(checkpoint: str) -> str:
    """The ``params.safetensors`` a ``--checkpoint`` argument refers to; ValueError if none."""
    path = os.path.expanduser(checkpoint)
    if os.path.isdir(path):
        candidate = os.path.join(path, PARAMS_FILE)
        if os.path.isfile(candidate):
            return candidate
        raise ValueError(f"--checkpoint: {checkpoint!r} has no {PARAMS_FILE} (is it a finished run's "
                         "output folder?)")
    if os.path.isfile(path):
        return path
    raise ValueError(f"--checkpoint: {checkpoint!r} does not exist")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        shard_bytes = parse_bytes(args.shard_size, "--shard-size")
        with ParamsFile(resolve_params_file(args.checkpoint)) as params:
            tokenizer = args.tokenizer or params.tokenizer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the missing-tokenizer case is reported below
                out = export_hf(params.read, params.model_config, args.out, tokenizer_src=tokenizer,
                                dtype=args.dtype, shard_bytes=shard_bytes)
    except (ValueError, ConfigError, OSError) as err:
        print(f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 2
    if tokenizer is None:
        print("note: the run used the byte tokenizer, which has no Hugging Face files; "
              "the export holds weights and config.json only", file=sys.stderr)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
