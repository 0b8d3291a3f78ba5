"""Checkpoints: an Orbax ``CheckpointManager`` directory per run, the SSD state streamed into it.

* :class:`Checkpointer` -- saves and restores params, optax state, the SSD-resident fp32
  master/m/v, the data position and the loss-scale state; refuses incompatible or corrupt steps;
* :class:`SsdArrays` / :class:`ArraySpec` / :class:`Span` / :class:`Piece` -- SSD regions streamed
  chunk by chunk through arena slots into plain zarr arrays (readable by stock Orbax and
  tensorstore), with a crc32c per chunk; an engine describes its own regions with them
  (:data:`SCALE_ARRAYS`: the names of int8 state's block scales, which cannot be re-split);
* :class:`CheckpointWeights` -- one step's weights, one layer at a time, for an export;
* :func:`open_weights` / :class:`RunWeights` -- a run's folder, a step, a checkpoint directory or
  a ``params.safetensors`` file as one reader with its model config and tokenizer (the CLIs' input);
* the errors: :class:`CheckpointError` and its subclasses.

Imports :mod:`jaxascend.config`, :mod:`jaxascend.ssd`, :mod:`jaxascend.data` (tokenizer folders),
:mod:`jaxascend.hf` (parameter files) and :mod:`jaxascend.optim` (the formats of compressed
moments); knows nothing of the engines or their layouts.
"""

from jaxascend.checkpoint.errors import CheckpointError, IncompatibleCheckpointError
from jaxascend.checkpoint.array_specs import (ArraySpec, CHECKPOINT_SHAPE_CLASS, Piece, SCALE_ARRAYS, Span, SsdArrays,
                                              checkpoint_arena_requests)
from jaxascend.checkpoint.manager import Checkpointer, saves_at
from jaxascend.checkpoint.resume import check_resume_partition, complete_steps, default_directory, resume_target
from jaxascend.checkpoint.step_meta import read_meta
from jaxascend.checkpoint.run_weights import RunWeights, open_weights
from jaxascend.checkpoint.weights import CheckpointWeights
from jaxascend.checkpoint.array_restore import restore_arrays
from jaxascend.checkpoint.array_save import save_item

__all__ = [
    "ArraySpec", "CHECKPOINT_SHAPE_CLASS", "CheckpointError", "CheckpointWeights", "Checkpointer",
    "IncompatibleCheckpointError", "Piece", "RunWeights", "SCALE_ARRAYS", "Span", "SsdArrays",
    "check_resume_partition", "checkpoint_arena_requests", "complete_steps", "default_directory", "open_weights", "read_meta", "restore_arrays",
    "resume_target", "save_item", "saves_at",
]
