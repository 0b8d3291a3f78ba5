"""``jaxascend COMMAND [ARG ...]``: the package's command-line tools behind one command.

    jaxascend train --config configs/tiny.yaml       # the same as python -m jaxascend.train --config ...
    jaxascend export --checkpoint runs/tiny --out exports/tiny
    python -m jaxascend plan --config configs/tiny.yaml

``jaxascend COMMAND`` runs ``python -m jaxascend.COMMAND``'s ``main`` with the remaining arguments
and exits with its status; only the chosen command's module is imported, so ``--help`` answers
without loading JAX. An unknown command is one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Sequence

from jaxascend import __version__, console
from jaxascend.config import did_you_mean


@dataclass(frozen=True)
class Command:
    module: str  # the module whose main(argv, prog) runs it
    summary: str  # its line in ``jaxascend --help``


COMMANDS = {
    "train": Command("jaxascend.train", "train or fine-tune a model as a YAML run config says"),
    "plan": Command("jaxascend.plan", "what a run will need (memory, disk, step time), before it starts"),
    "export": Command("jaxascend.export", "a run, a checkpoint or params.safetensors -> a Hugging Face folder"),
    "generate": Command("jaxascend.generate", "sample from a run, a checkpoint or a Hugging Face folder"),
    "plot": Command("jaxascend.plot", "draw runs' metrics.jsonl as PNGs"),
    "launch": Command("jaxascend.launch", "start N local processes of a jax.distributed job"),
    "config": Command("jaxascend.config.__main__", "every config field: type, default and meaning"),
}



def _parser(prog: str) -> console.ArgumentParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items())
    module = "python -m jaxascend.COMMAND"
    p = console.ArgumentParser(prog=prog, usage=f"{prog} [-h] [--version] COMMAND [ARG ...]",
                description="Full-parameter LLM fine-tuning in JAX/Flax with optimizer state on SSD.",
                epilog=f"commands:\n{listing}\n\n`{prog} COMMAND ARG ...` is the same as `{module} ARG ...`;\n"
                       f"`{prog} COMMAND --help` lists a command's options.",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"jaxascend {__version__}")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "jaxascend") -> int:
    """Runs ``argv`` (default: ``sys.argv[1:]``), ``COMMAND [ARG ...]``, and returns the command's
    exit status; 2 after the help (no command) or one ``error:`` line (an unknown one)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The options before the command are this command's own (-h, --version); the rest is the command's.
    at = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), len(argv))
    parser = _parser(prog)
    parser.parse_args(argv[:at])
    if at == len(argv):
        parser.print_help(sys.stderr)
        return 2
    name = argv[at]
    if name not in COMMANDS:
        console.error(f"{name}: unknown command{did_you_mean(name, COMMANDS)} (commands: {', '.join(COMMANDS)})")
        return 2
    command = importlib.import_module(COMMANDS[name].module)
    return command.main(argv[at + 1:], prog=f"{prog} {name}")


if __name__ == "__main__":
    sys.exit(main())
