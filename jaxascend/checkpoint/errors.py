"""The errors a checkpoint save or restore raises; each message names the directory, file or field."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or used; the message says which and why."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The requested step (or the checkpoint directory) does not exist; the message lists the steps there."""


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """The checkpoint was made for another model, dtype or layout; the message names the field
    (or array) and both values."""


class CorruptCheckpointError(CheckpointError):
    """A file of the checkpoint is truncated, garbled or missing; the message names its path."""
