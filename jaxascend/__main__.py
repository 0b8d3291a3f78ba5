"""``python -m jaxascend COMMAND [ARG ...]``: the ``jaxascend`` command (:mod:`jaxascend.cli`)."""

import sys

from jaxascend.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m jaxascend"))
