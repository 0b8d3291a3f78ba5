"""Command-line entry point: ``python -m jaxascend.train --config configs/tiny.yaml [--set a.b=c ...]``.

Bad input (config, data, tokenizer, model files, checkpoints) and failures of the disk end with
one line on stderr naming the problem and exit status 2, with nothing else around it (see
:mod:`jaxascend.console`); set JAXASCEND_DEBUG=1 to see the full traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxascend import console

PROG = "python -m jaxascend.train"


def parse_args(argv: list[str] | None = None, prog: str = PROG) -> argparse.Namespace:
    from jaxascend.config import sections_help  # no JAX: --help stays fast

    parser = console.ArgumentParser(prog=prog, epilog=sections_help(),
                                     description="Trains or fine-tunes a model as a YAML run config says.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config, e.g. configs/tiny.yaml (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field (repeatable), e.g. --set train.steps=20 or a nested one, "
                             "--set train.distributed.num_processes=2")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """The CLI (``prog``: the name its usage line shows): the run's exit status (see the module doc)."""
    args = parse_args(argv, prog)
    # Imported here so that --help answers without loading JAX.
    from jaxascend import console
    from jaxascend.checkpoint import CheckpointError
    from jaxascend.config import load_config
    from jaxascend.distributed import JobLostError
    from jaxascend.stopping import RunStopped
    from jaxascend.trainer import run

    lost = []

    def train() -> int:
        try:
            run(load_config(args.config, args.overrides))
        except JobLostError:
            lost.append(True)
            raise
        except RunStopped as stop:  # a stop signal: the step's checkpoint is saved; one line says so
            if stop.speaks:
                print(stop, file=console.terminal(), flush=True)
            return stop.exit_status
        return 0

    with console.one_line_output():  # ConfigError is a ValueError
        status = console.report_errors(train, (ValueError, OSError, CheckpointError, JobLostError))
    if lost:  # JAX's shutdown would wait for the lost process and then abort with a stack dump
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
