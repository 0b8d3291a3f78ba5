"""Hugging Face checkpoints in and out, one tensor at a time.

* :func:`model_config_from_hf` / :func:`~jaxascend.hf.config_map.hf_config_dict` -- ``config.json`` <-> :class:`ModelConfig`
  (Llama, Qwen2, Qwen3, Mistral, Phi-3, GPT-2, Gemma 3 text, also read from the multimodal Gemma 3);
* :func:`load_hf_model` / :func:`load_hf_params` / :func:`~jaxascend.hf.load.iter_hf_params` -- lean loading: each
  tensor is read with ``pread`` into preallocated stacked buffers (zero-copy to jax on CPU);
  :func:`check_hf_weights` checks every safetensors header against the model first, no data read;
* :func:`export_hf` -- a streaming, sharded safetensors export with index, config and tokenizer;
  :func:`reader_from_params` makes a :data:`~jaxascend.hf.export.ParamReader` ``read(path, layer)`` of an in-memory tree;
* :func:`save_params` / :class:`ParamsFile` -- the run's own ``params.safetensors``;
* :func:`param_plan` -- how every jaxascend parameter leaf maps onto Hugging Face tensor names;
* :func:`make_hf_checkpoint` / :data:`PRESETS` -- randomly initialised models in Hugging Face
  layout, and :func:`build_model_lean`, the trainer's from-scratch initialisation (the same
  tensor-by-tensor path with a random reader);
* :func:`locate_model` / :class:`ModelSource` -- ``model.path`` as a folder or a hub id (``org/name``), the
  latter read from the Hugging Face cache (downloaded there when missing and the hub is online);
* the errors: :class:`~jaxascend.hf.errors.HFCheckpointError` and its subclasses, each naming the file and tensor.

Imports :mod:`jaxascend.config`, :mod:`jaxascend.models` and :mod:`jaxascend.data` (tokenizers).
"""

from jaxascend.hf.config_map import CONFIG_FILE, model_config_from_hf, model_config_from_hf_dict
from jaxascend.hf.export import DEFAULT_SHARD_BYTES, NO_TOKENIZER_NOTE, export_hf, param_leaves, reader_from_params
from jaxascend.hf.hub import ModelSource, locate_model
from jaxascend.hf.lean_init import build_model_lean, lean_init_reader
from jaxascend.hf.load import HFParamReader, aligned_empty, check_hf_weights, load_hf_model, load_hf_params
from jaxascend.hf.names import ParamMapping, abstract_params, param_plan, tree_path_to_dotted
from jaxascend.hf.params_file import PARAMS_FILE, ParamsFile, save_params
from jaxascend.hf.presets import PRESETS, make_hf_checkpoint, preset_config
from jaxascend.hf.safetensors_io import CheckpointFiles, DTYPE_NAMES

__all__ = [
    "CONFIG_FILE", "CheckpointFiles", "DEFAULT_SHARD_BYTES", "DTYPE_NAMES", "HFParamReader", "ModelSource",
    "NO_TOKENIZER_NOTE", "PARAMS_FILE", "PRESETS", "ParamMapping", "ParamsFile", "abstract_params", "aligned_empty",
    "build_model_lean", "check_hf_weights", "export_hf", "lean_init_reader", "load_hf_model", "load_hf_params",
    "locate_model", "make_hf_checkpoint", "model_config_from_hf", "model_config_from_hf_dict", "param_leaves",
    "param_plan", "preset_config", "reader_from_params", "save_params", "tree_path_to_dotted",
]
