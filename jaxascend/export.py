"""``python -m jaxascend.export``: a run, a checkpoint or a parameter file -> a Hugging Face folder.

    python -m jaxascend.export --checkpoint runs/my-run --out exports/my-run
    python -m jaxascend.export --checkpoint runs/my-run/checkpoints/300 --out exports/my-run-300

``--checkpoint`` is one of:

* a run's output folder: its newest weights, i.e. ``params.safetensors`` (written at the end of a
  run) or, when the run was killed or went on after it, its newest complete checkpoint;
* an Orbax step directory (``<run>/checkpoints/<step>``) or a checkpoint directory (its newest
  complete step): an offloaded run's fp32 master weights are streamed from it one layer at a time;
* a ``params.safetensors`` file

(:func:`jaxascend.checkpoint.open_weights` opens each). ``--dtype source`` (the default) stores the
dtype of the checkpoint the run started from. Errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from jaxascend import console
from jaxascend.config import ConfigError, parse_bytes
from jaxascend.formats import DEFAULT_SHARD_BYTES, DTYPE_NAMES, PARAMS_FILE  # no JAX: --help stays fast

PROG = "python -m jaxascend.export"


def _parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = console.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
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


def main(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> int:
    """The CLI (``prog``: the name its usage line shows): 0 when the folder was written, 2 after
    one ``error:`` line otherwise."""
    args = _parser(prog).parse_args(argv)
    with console.one_line_output():
        return _export(args)


def _export(args: argparse.Namespace) -> int:
    # Imported here, after the arguments are parsed, so that --help answers without loading JAX.
    from jaxascend.checkpoint import CheckpointError, open_weights
    from jaxascend.hf import NO_TOKENIZER_NOTE, export_hf

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
