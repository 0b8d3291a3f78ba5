"""Command-line entry point: ``python -m jaxascend.train --config configs/tiny.yaml [--set a.b=c ...]``.

Bad input (config, data, tokenizer, model files, checkpoints) and failures of the disk end with
one line on stderr naming the problem and exit status 2, with nothing else around it (see
:mod:`jaxascend.console`); set JAXASCEND_DEBUG=1 to see the full traceback instead.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jaxascend.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML run config, e.g. configs/tiny.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field (repeatable), e.g. --set train.steps=20")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Imported here so that --help answers without loading JAX.
    from jaxascend import console
    from jaxascend.checkpoint import CheckpointError
    from jaxascend.config import load_config
    from jaxascend.trainer import run

    with console.one_line_output():
        try:
            cfg = load_config(args.config, args.overrides)
            run(cfg)
        except (ValueError, OSError, CheckpointError) as err:  # ConfigError is a ValueError
            if console.debugging():
                raise
            console.error(console.first_line(err))
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
