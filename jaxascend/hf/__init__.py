"""Hugging Face checkpoints in and out, one tensor at a time.

* :func:`model_config_from_hf` / :func:`hf_config_dict` -- ``config.json`` <-> :class:`ModelConfig`
  (Llama, Qwen2, Qwen3, Mistral, Phi-3, GPT-2, Gemma 3 text, also read from the multimodal Gemma 3);
* :func:`load_hf_model` / :func:`load_hf_params` / :func:`iter_hf_params` -- lean loading: each
  tensor is read with ``pread`` into preallocated stacked buffers (zero-copy to jax on CPU);
* :func:`export_hf` -- a streaming, sharded safetensors export with index, config and tokenizer;
  :func:`reader_from_params` makes a :data:`ParamReader` ``read(path, layer)`` of an in-memory tree;
* :func:`save_params` / :class:`ParamsFile` -- the run's own ``params.safetensors``;
* :func:`param_plan` -- how every jaxascend parameter leaf maps onto Hugging Face tensor names;
* :func:`make_hf_checkpoint` / :data:`PRESETS` -- randomly initialised models in Hugging Face
  layout, and :func:`build_model_lean`, the trainer's from-scratch initialisation (the same
  tensor-by-tensor path with a random reader);
* the errors: :class:`HFCheckpointError` and its subclasses, each naming the file and tensor.

Imports :mod:`jaxascend.config`, :mod:`jaxascend.models` and :mod:`jaxascend.data` (tokenizers).
"""

from jaxascend.hf.config_map import (CONFIG_FILE, detect_arch, hf_config_dict, model_config_from_hf,
                                     model_config_from_hf_dict, read_hf_config)
from jaxascend.hf.errors import (CorruptFileError, DTypeMismatchError, HFCheckpointError, MissingTensorError,
                                 ShapeMismatchError, UnexpectedTensorError, UnsupportedModelError)
from jaxascend.hf.export import (DEFAULT_SHARD_BYTES, NO_TOKENIZER_NOTE, ParamReader, export_hf, param_leaves,
                                 reader_from_params)
from jaxascend.hf.lean_init import build_model_lean, lean_init_reader
from jaxascend.hf.load import HFParamReader, aligned_empty, iter_hf_params, load_hf_model, load_hf_params
from jaxascend.hf.names import ParamMapping, abstract_params, param_plan, tree_path_to_dotted
from jaxascend.hf.params_file import PARAMS_FILE, ParamsFile, save_params
from jaxascend.hf.presets import PRESETS, PUBLISHED_PARAMS, make_hf_checkpoint, preset_config
from jaxascend.hf.safetensors_io import (DTYPE_NAMES, INDEX_FILE, SINGLE_FILE, CheckpointFiles, SafetensorsFile,
                                         TensorSpec, write_safetensors, write_sharded)

__all__ = [
    "CONFIG_FILE", "DEFAULT_SHARD_BYTES", "DTYPE_NAMES", "INDEX_FILE", "NO_TOKENIZER_NOTE", "PARAMS_FILE", "PRESETS",
    "PUBLISHED_PARAMS", "SINGLE_FILE", "CheckpointFiles", "CorruptFileError", "DTypeMismatchError",
    "HFCheckpointError", "HFParamReader", "MissingTensorError", "ParamMapping", "ParamReader", "ParamsFile", "SafetensorsFile",
    "ShapeMismatchError", "TensorSpec", "UnexpectedTensorError", "UnsupportedModelError", "abstract_params", "aligned_empty",
    "build_model_lean", "detect_arch", "export_hf", "hf_config_dict", "iter_hf_params", "lean_init_reader",
    "load_hf_model",
    "load_hf_params", "make_hf_checkpoint", "model_config_from_hf", "model_config_from_hf_dict", "param_plan",
    "param_leaves", "preset_config", "read_hf_config", "reader_from_params", "save_params", "tree_path_to_dotted", "write_safetensors", "write_sharded",
]
