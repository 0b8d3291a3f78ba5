"""``python -m jaxascend.config [SECTION ...]``: every field of every config section, with its type,
default and meaning (from the dataclasses' own comments); loads no JAX.

    python -m jaxascend.config                 # all sections
    python -m jaxascend.config optimizer train # only these (a nested one: train.distributed)
"""

from __future__ import annotations

import sys

from jaxascend import console
from jaxascend.config.field_docs import config_sections, describe
from jaxascend.config.values import did_you_mean


PROG = "python -m jaxascend.config"


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """The CLI (``prog``: the name its usage line shows): 0, or 2 after one ``error:`` line for an
    unknown section."""
    parser = console.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("sections", nargs="*", metavar="SECTION", help="sections to list (default: all)")
    args = parser.parse_args(argv)
    sections = config_sections()
    names = [s.name for s in sections]
    for name in args.sections:
        if name not in names:
            console.error(f"{name}: unknown section{did_you_mean(name, names)} (allowed: {', '.join(names)})")
            return 2
    wanted = [s for s in sections if not args.sections or s.name in args.sections]
    sys.stdout.write(describe(wanted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
