"""Errors raised while reading or writing Hugging Face checkpoints.

All are ``ValueError`` subclasses with one-line messages that name the file and, where there is
one, the tensor and both shapes, so a user can see at once what to fix.
"""

from __future__ import annotations


class HFCheckpointError(ValueError):
    """Base class: something about a Hugging Face folder or file is not what we can use."""


class UnsupportedModelError(HFCheckpointError):
    """``config.json`` names an architecture or a feature our models do not implement."""


class CorruptFileError(HFCheckpointError):
    """A safetensors file (or its index) is truncated, malformed or inconsistent."""


class MissingTensorError(HFCheckpointError):
    """The checkpoint lacks a tensor the model needs."""


class UnexpectedTensorError(HFCheckpointError):
    """The checkpoint holds a tensor the model has no place for."""


class ShapeMismatchError(HFCheckpointError):
    """A tensor's shape differs from the one ``config.json`` implies."""


class DTypeMismatchError(HFCheckpointError):
    """A tensor's dtype cannot be a model weight (integers, booleans, 8-bit floats)."""


def format_shape(shape) -> str:
    """``[4096, 11008]`` (``[]`` for a scalar)."""
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def one_line(text: str) -> str:
    """The first line of ``text`` (error messages must stay on one line)."""
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""
