"""Command-line planner: ``python -m jaxascend.plan --config X [--set a.b=c ...]``.

Prints, before anything is allocated, what the run of that config will need: host memory by part
(runtime, arena, resident params, activations, temporaries) against the budget or what the machine
can give, device memory, the disk each filesystem must hold (offload files, the checkpoints kept,
the end-of-run weights) against its free space, SSD bytes per step and the step-time floor at a
given (``--disk-gbps``) or measured (``--measure-disk``) disk speed; ``offload.params: auto`` is
resolved as the trainer resolves it, ``train.epochs`` counted into steps from the data (a
``note: steps:`` line), and a part that does not fit names its levers with figures.
A model folder holding only ``config.json`` is enough: without tokenizer files the vocabulary is
config.json's, without the data the runtime part is estimated (each said on a ``note:`` line); the
first record of every data file is read either way (``data.format: auto`` resolved, a wrong field
refused with the trainer's own line).
``python -m jaxascend.train`` runs the same plan first, with every input read, and refuses a run
that does not fit. Exit status: 0 when the run fits, 1 when it does not (``does not fit:``
lines), 2 on bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import sys

from jaxascend import console

PROG = "python -m jaxascend.plan"


def parse_args(argv: list[str] | None = None, prog: str = PROG) -> argparse.Namespace:
    from jaxascend.config import sections_help  # no JAX: --help stays fast

    parser = console.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                     epilog=sections_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config, e.g. configs/qwen2.5-3b.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field (repeatable), e.g. --set offload.params=ssd")
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--disk-gbps", type=float, default=None, help="disk speed for the step-time floor (GB/s)")
    speed.add_argument("--measure-disk", action="store_true",
                       help="measure the O_DIRECT speed of the offload filesystem (writes and reads 256 MiB)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """The CLI (``prog``: the name its usage line shows): 0 when the run fits, 1 when it does not, 2
    on bad input."""
    args = parse_args(argv, prog)
    if args.disk_gbps is not None and not args.disk_gbps > 0:
        print("error: --disk-gbps: must be > 0", file=sys.stderr)
        return 2
    import json

    import jax

    from jaxascend import console
    from jaxascend.config import load_config
    from jaxascend.offload import JobShape
    from jaxascend.preparation import prepare_run, read_available_inputs
    from jaxascend.ssd import measure_disk_gbps

    with console.one_line_output():
        try:
            cfg = load_config(args.config, args.overrides, inputs=False)
            gbps = measure_disk_gbps(cfg.offload) if args.measure_disk else args.disk_gbps
            distributed = cfg.train.distributed
            job = JobShape(processes=(distributed.num_processes if distributed else None) or 1,
                           local_devices=jax.local_device_count())
            # The trainer's first phase, on the inputs that are there: the plan made where the
            # run will hold its tokenizer and data index (the runtime part; estimated without them).
            prepared = prepare_run(cfg, job, disk_gbps=gbps, inputs=read_available_inputs(cfg))
        except (ValueError, OSError) as err:  # ConfigError is a ValueError
            if console.debugging():
                raise
            console.error(console.first_line(err))
            return 2
    resources, step_plan = prepared.resources, prepared.step_plan
    if args.json:
        print(json.dumps({**resources.to_dict(), "step": step_plan.describe(), "assumed": list(prepared.assumed),
                          "steps": prepared.cfg.train.steps,  # None: train.epochs, the data not read
                          "epochs": prepared.epochs.to_dict() if prepared.epochs else None}, indent=1))
    else:
        print(resources.format())
        for line in prepared.assumed:
            print(f"note: {line}")
        for line in prepared.notes + step_plan.notes:
            if line not in resources.choices:
                print(f"note: {line}")
    return 1 if resources.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
