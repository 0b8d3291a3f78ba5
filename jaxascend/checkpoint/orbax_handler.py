"""The Orbax ``CheckpointHandler`` of the ``offloaded`` item and its save/restore arguments.

``Checkpointer`` passes :class:`SsdArraysSave` / :class:`SsdArraysRestore` in an
``ocp.args.Composite``; the handler streams the arrays (:mod:`~jaxascend.checkpoint.array_save`,
:mod:`~jaxascend.checkpoint.array_restore`) while Orbax finalises the step around it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orbax.checkpoint as ocp

from jaxascend.checkpoint.array_restore import restore_arrays
from jaxascend.checkpoint.array_save import save_item
from jaxascend.checkpoint.array_specs import SsdArrays
from jaxascend.checkpoint.offloaded_item import part_directory, read_manifest, saved_processes


class SsdArraysHandler(ocp.CheckpointHandler):
    """Orbax ``CheckpointHandler`` for the ``offloaded`` item (synchronous: it streams through
    the arena while the caller waits; the training loop must not touch the store meanwhile)."""

    def save(self, directory, args: "SsdArraysSave") -> None:
        # Every process of a job saves its own slices; Orbax finalises the step once all have.
        save_item(Path(str(directory)), args.arrays, args.compression)

    def restore(self, directory, args: "SsdArraysRestore") -> dict:
        return restore_arrays(Path(str(directory)), args.arrays)

    def metadata(self, directory) -> dict:
        directory = Path(str(directory))
        return read_manifest(part_directory(directory, 0, saved_processes(directory)))


@ocp.args.register_with_handler(SsdArraysHandler, for_save=True)
@dataclasses.dataclass
class SsdArraysSave(ocp.args.CheckpointArgs):
    arrays: SsdArrays
    compression: str = "none"


@ocp.args.register_with_handler(SsdArraysHandler, for_restore=True)
@dataclasses.dataclass
class SsdArraysRestore(ocp.args.CheckpointArgs):
    arrays: SsdArrays
