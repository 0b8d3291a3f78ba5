"""A run's final parameters as one self-describing safetensors file (``params.safetensors``).

The trainer writes it at the end of a run; ``python -m jaxascend.export`` turns it into a
Hugging Face folder later. Tensors are named by our parameter paths
(``layers.mlp.up_proj.kernel``, stacked ``[L, ...]``) and stored in the dtype they had (fp32
master weights for the in-memory optimizer); the header's metadata carries the resolved
:class:`ModelConfig` and the tokenizer folder, so the file alone is enough to export.

    save_params("runs/x/params.safetensors", params, model_cfg, tokenizer="/models/Qwen2.5-0.5B")
    with ParamsFile("runs/x/params.safetensors") as f:
        export_hf(f.read, f.model_config, "runs/x/hf", tokenizer_src=f.tokenizer)

Reading is lean: :meth:`ParamsFile.read` returns one layer's slice with a single ``pread``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import jax
import numpy as np

from jaxascend.config import ConfigError, ModelConfig
from jaxascend.formats import PARAMS_FILE  # no JAX: the CLIs' --help names it
from jaxascend.hf.errors import CorruptFileError, HFCheckpointError, MissingTensorError
from jaxascend.hf.export import ParamSource, reader_from_params, vocab_size_of
from jaxascend.hf.names import param_plan
from jaxascend.hf.safetensors_io import DTYPES, SafetensorsFile, TensorSpec, dominant_dtype, write_safetensors

FORMAT = "jaxascend-params-v1"
_NAME_OF_DTYPE = {dtype: name for name, dtype in DTYPES.items()}


def save_params(path: str | os.PathLike, params: ParamSource, model_cfg: ModelConfig, *,
                vocab_size: Optional[int] = None, tokenizer: Optional[str] = None,
                model_source: Optional[str] = None, source_dtype: Optional[str] = None,
                step: Optional[int] = None) -> Path:
    """Writes every parameter of ``model_cfg``'s model to ``path``, one tensor at a time, with
    metadata enough to export it later: the config (``vocab_size`` filled in), the tokenizer
    folder (None: byte tokenizer), the Hugging Face folder the run started from
    (``model_source``: its generation config and special-token ids go into an export) and that
    checkpoint's dtype (``source_dtype``, what ``export.dtype: source`` means) and the
    optimizer ``step`` the weights are from."""
    read = reader_from_params(params)
    cfg = dataclasses.replace(model_cfg, vocab_size=vocab_size_of(model_cfg, vocab_size, read))
    plan = param_plan(cfg)
    specs = []
    for m in plan:
        dtype = np.dtype(jax.dtypes.canonicalize_dtype(getattr(read(m.path, None), "dtype", np.float32)))
        specs.append(TensorSpec(m.dotted, _NAME_OF_DTYPE[dtype], m.shape))
    by_name = {m.dotted: m for m in plan}

    def produce(spec: TensorSpec) -> np.ndarray:
        value = np.asarray(read(by_name[spec.name].path, None))
        if value.shape != spec.shape:
            raise ValueError(f"{path}: parameter {spec.name!r} has shape {list(value.shape)}, "
                             f"the model needs {list(spec.shape)}")
        return value

    metadata = {"format": FORMAT, "model_config": json.dumps(dataclasses.asdict(cfg)),
                "tokenizer": tokenizer or "", "model_source": model_source or "",
                "source_dtype": source_dtype or "", "step": "" if step is None else str(int(step))}
    write_safetensors(path, specs, produce, metadata)
    return Path(path)


class ParamsFile:
    """An open ``params.safetensors``: its :attr:`model_config`, :attr:`tokenizer` folder (None for
    the byte tokenizer) and :meth:`read`, a ParamReader for :func:`export_hf`."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise HFCheckpointError(f"{self.path}: parameter file not found")
        self._file = SafetensorsFile(self.path)
        meta = self._file.metadata
        if meta.get("format") != FORMAT:
            self._file.close()
            raise CorruptFileError(f"{self.path}: not a jaxascend parameter file "
                                   f"(metadata format {meta.get('format')!r}, expected {FORMAT!r})")
        try:
            self.model_config = ModelConfig(**json.loads(meta["model_config"]))
        except (KeyError, ValueError, TypeError, ConfigError) as err:
            self._file.close()
            raise CorruptFileError(f"{self.path}: model_config metadata is unreadable ({err})") from None
        self.tokenizer: Optional[str] = meta.get("tokenizer") or None
        self.model_source: Optional[str] = meta.get("model_source") or None
        # Files written before source_dtype was recorded: the dtype the parameters are stored in.
        self.source_dtype: str = meta.get("source_dtype") or dominant_dtype(self._file.entries.values())
        self.step: Optional[int] = int(meta["step"]) if meta.get("step", "").isdigit() else None

    def read(self, path: tuple[str, ...], layer: Optional[int]) -> np.ndarray:
        """Parameter ``path`` (or its slice ``layer`` when stacked), read from disk."""
        name = ".".join(path)
        entry = self._file.entries.get(name)
        if entry is None:
            raise MissingTensorError(f"{self.path}: no parameter {name!r}")
        if layer is None:
            return self._file.read(entry)
        rows = entry.shape[0]
        if not 0 <= layer < rows:
            raise IndexError(f"{self.path}: layer {layer} out of range for {name!r} with {rows} layers")
        step = entry.nbytes // rows
        part = dataclasses.replace(entry, shape=entry.shape[1:], begin=entry.begin + layer * step,
                                   end=entry.begin + (layer + 1) * step)
        return self._file.read(part)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "ParamsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
