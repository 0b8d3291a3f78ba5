"""The weights of one checkpoint step, read one tensor (one layer) at a time, for an export.

    with CheckpointWeights("runs/x/checkpoints/300") as w:
        w.model_config, w.origin                    # what the run trained, and from where
        export_hf(w.read, w.model_config, "runs/x/hf-300", dtype="float32")

An offloaded run's checkpoint holds the fp32 master weights as plain zarr arrays
(``offloaded/master.<leaf>``, or one slice of each per process of a data-parallel job, see
:mod:`jaxascend.checkpoint.offloaded_item`): :meth:`read` pulls one layer of one of them (joining
the slices), reading only the zarr chunks that hold it, each checked against the crc32c
in the item's manifest before use. An in-memory run's weights are its ``params`` item (the model
fits in memory by definition); it is restored once and checked against the crc32c of every leaf.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Union

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxascend.checkpoint.checksums import leaf_name, raise_if_a_file_is_corrupt, verify_checksums
from jaxascend.checkpoint.errors import CorruptCheckpointError
from jaxascend.checkpoint.manager import root_cause
from jaxascend.checkpoint.repartition import saved_tensors
from jaxascend.checkpoint.step_meta import OFFLOADED, PARAMS, read_meta
from jaxascend.config import ModelConfig


class CheckpointWeights:
    """A reader ``read(path, layer)`` over one checkpoint step's weights (see the module doc).

    ``origin`` is the provenance the trainer saved with the step (``model_config``,
    ``tokenizer``, ``model_source``, ``source_dtype``), or None for checkpoints made before it
    was recorded; :attr:`model_config` falls back to the run config's ``model`` section then.
    """

    def __init__(self, step_dir: Union[str, Path]):
        self.directory = Path(step_dir)
        record = read_meta(self.directory)
        self.step = int(record["step"])
        self.run_config: dict = record["config"]
        self.origin: Optional[dict] = record["meta"].get("origin")
        self._record = record
        self._offloaded = OFFLOADED in record["items"]
        self._params: Optional[dict] = None
        if self._offloaded:  # saved by one process or split over a job's (re-joined here)
            self._arrays = {_dotted(name): t for name, t in saved_tensors(self.directory / OFFLOADED).items()
                            if name.startswith("master/")}
        self.model_config = self._model_config()

    def _model_config(self) -> ModelConfig:
        if self.origin is not None:
            return ModelConfig(**self.origin["model_config"])
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        saved = {k: v for k, v in self.run_config.get("model", {}).items() if k in fields}
        if saved.get("path"):
            from jaxascend.hf import model_config_from_hf  # the architecture is in the source folder

            return model_config_from_hf(saved["path"], base=ModelConfig(**saved))
        return ModelConfig(**saved)

    def read(self, path: tuple[str, ...], layer: Optional[int] = None) -> np.ndarray:
        """Parameter ``path`` (e.g. ``("layers", "mlp", "up_proj", "kernel")``) or one ``layer``
        of it: fp32 master weights of an offloaded run, the saved params of an in-memory one."""
        name = ".".join(path)
        if not self._offloaded:
            value = self._in_memory_params().get(name)
            if value is None:
                raise CorruptCheckpointError(f"checkpoint {self.directory / PARAMS} has no parameter {name!r}")
            return value if layer is None else value[layer]
        tensor = self._arrays.get(name)
        if tensor is None:
            raise CorruptCheckpointError(f"checkpoint {self.directory / OFFLOADED} has no master weights for "
                                         f"{name!r} (it holds {len(self._arrays)} tensors)")
        shape = tensor.shape
        if layer is not None and not 0 <= layer < shape[0]:
            raise IndexError(f"checkpoint {self.directory}: {name!r} has {shape[0]} layers, not {layer + 1}")
        out = np.empty(shape if layer is None else shape[1:], tensor.dtype)
        try:
            tensor.copy(out.reshape(-1).view(np.uint8), layer, 0)  # from each saved slice of each layer (block)
        finally:
            tensor.release()  # one tensor's chunks in memory at a time
        return out

    def _in_memory_params(self) -> dict[str, np.ndarray]:
        if self._params is None:
            item = self.directory / PARAMS
            try:  # checked as Checkpointer.restore checks: the damaged file named when it is known
                tree = ocp.StandardCheckpointer().restore(item)
                verify_checksums(tree, self._record.get("checksums", {}).get(PARAMS), item)
            except Exception as err:
                raise_if_a_file_is_corrupt(self.directory)
                if isinstance(err, CorruptCheckpointError):
                    raise
                raise CorruptCheckpointError(f"checkpoint item {item} cannot be read: {root_cause(err)}") from None
            self._params = {_dotted(leaf_name(path)): np.asarray(v)
                            for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
        return self._params

    def close(self) -> None:
        self._params = None

    def __enter__(self) -> "CheckpointWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _dotted(name: str) -> str:
    """An array or leaf name (``master/layers/mlp/w/value``, ``layers.mlp.w.value``) as our
    dotted parameter path (``layers.mlp.w``): no tensor prefix, no nnx ``value`` suffix."""
    parts = name.replace("/", ".").split(".")
    if parts[0] == "master":
        parts = parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "value" else parts)

