"""Export to a Hugging Face folder that ``AutoModelForCausalLM.from_pretrained`` loads unchanged.

    export_hf(params, model_cfg, "runs/x/hf", tokenizer_src="/models/Qwen2.5-0.5B",
              dtype="bfloat16", shard_bytes=2 * 10**9)

``params`` is an ``nnx.Module``, an ``nnx.State``, a nested dict of arrays, or any
:data:`ParamReader`: a callable ``read(path, layer) -> array`` returning one of our parameters
(``path`` a tuple like ``("layers", "mlp", "up_proj", "kernel")``) or, for a stacked layer
parameter, its slice for ``layer``. Tensors are requested, converted (cast to ``dtype``,
transposed to HF's layout) and written one at a time, so a reader that streams fp32 master
weights from SSD exports a model of any size with one layer's tensor in memory.

The folder gets ``config.json``, ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors``
shards of at most ``shard_bytes`` with ``model.safetensors.index.json``), and the tokenizer files
found in ``tokenizer_src``. It is written as a hidden sibling and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Union

import jax
import numpy as np
from flax import nnx

from jaxascend.kill_points import kill_point
from jaxascend.config import ModelConfig
from jaxascend.formats import DEFAULT_SHARD_BYTES  # transformers' historical max_shard_size="5GB"
from jaxascend.hf.config_map import CONFIG_FILE, hf_config_dict
from jaxascend.hf.errors import (DTypeMismatchError, HFCheckpointError, MissingTensorError, ShapeMismatchError,
                                 format_shape)
from jaxascend.hf.names import HF_PREFIX, ParamMapping, param_plan, tree_path_to_dotted
from jaxascend.hf.safetensors_io import DTYPE_NAMES, DTYPES, FLOAT_DTYPES, TensorSpec, write_sharded

ParamReader = Callable[[tuple[str, ...], Optional[int]], Any]
ParamSource = Union[nnx.Module, nnx.State, dict, ParamReader]

_FLOAT_NUMPY = tuple(DTYPES[name] for name in FLOAT_DTYPES)

GENERATION_CONFIG = "generation_config.json"
# Files copied from tokenizer_src when present (tokenizers, vocabularies, chat templates,
# generation defaults).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "tiktoken.model",
    "chat_template.jinja", "chat_template.json", GENERATION_CONFIG,
)
# What the CLIs tell the user (a one-line note) when an export has no tokenizer to copy.
NO_TOKENIZER_NOTE = ("the run used the byte tokenizer, which has no Hugging Face files; "
                     "the export holds no tokenizer")


def param_leaves(params: ParamSource) -> Optional[dict[tuple[str, ...], Any]]:
    """``{path: array}`` of in-memory parameters (module, state or nested dict of arrays), None
    for a reader."""
    if callable(params) and not isinstance(params, (nnx.Module, nnx.State, dict)):
        return None
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    return {tuple(tree_path_to_dotted(path).split(".")): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def reader_from_params(params: ParamSource) -> ParamReader:
    """A :data:`ParamReader` over in-memory parameters (module, state or nested dict of arrays)."""
    flat = param_leaves(params)
    if flat is None:
        return params

    def read(path: tuple[str, ...], layer: Optional[int]):
        if path not in flat:
            raise MissingTensorError(f"parameters: no {'.'.join(path)!r} to export "
                                     f"(have {len(flat)} parameters, e.g. {'.'.join(next(iter(flat)))!r})")
        value = flat[path]
        return value if layer is None else value[layer]

    return read


def vocab_size_of(model_cfg: ModelConfig, vocab_size: Optional[int], read: ParamReader) -> int:
    """``vocab_size``, else the config's, else the rows of the embedding ``read`` returns."""
    if vocab_size:
        return vocab_size
    if model_cfg.vocab_size:
        return model_cfg.vocab_size
    table = ("wte" if model_cfg.arch == "gpt2" else "embed_tokens", "embedding")
    return int(np.shape(read(table, None))[0])


def _ordered(plan: list[ParamMapping], num_layers: int) -> list[tuple[ParamMapping, Optional[int]]]:
    """HF tensors in the order transformers writes them: embeddings, layer by layer, the rest."""
    front = [(m, None) for m in plan if not m.stacked and m.path[0] in ("embed_tokens", "wte", "wpe")]
    layers = [(m, i) for i in range(num_layers) for m in plan if m.stacked]
    back = [(m, None) for m in plan if not m.stacked and (m, None) not in front]
    return front + layers + back


def export_hf(params: ParamSource, model_cfg: ModelConfig, out_dir: str | os.PathLike, *,
              tokenizer_src: Optional[str | os.PathLike] = None, dtype: str = "bfloat16",
              shard_bytes: int = DEFAULT_SHARD_BYTES, vocab_size: Optional[int] = None,
              token_ids: Optional[dict[str, Optional[int]]] = None,
              model_src: Optional[str | os.PathLike] = None) -> Path:
    """Writes the model as a Hugging Face folder ``out_dir`` (which must not exist or be empty).

    ``dtype`` (``bfloat16``/``float16``/``float32``) is the stored dtype; values are cast with
    round-to-nearest-even from whatever the reader returns (pass fp32 masters when they exist).
    ``tokenizer_src`` is a folder whose tokenizer files are copied (None: no tokenizer files; the
    byte tokenizer has none, and the caller tells the user). ``model_src`` is the Hugging Face
    folder the weights were fine-tuned from: its ``generation_config.json`` is copied when the
    tokenizer folder has none. ``token_ids`` (``bos_token_id``, ``eos_token_id``,
    ``pad_token_id``) default to those of ``model_src``'s ``config.json``, else
    ``tokenizer_src``'s config or tokenizer. Returns the folder.
    """
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"export dtype: {dtype!r} is not supported (allowed: {', '.join(DTYPE_NAMES)})")
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"export shard_bytes: must be an integer >= 1, got {shard_bytes!r}")
    out_dir = Path(os.path.expanduser(str(out_dir)))
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise HFCheckpointError(f"{out_dir}: export folder already exists and is not empty; "
                                "choose a new folder or remove it")
    read = reader_from_params(params)
    vocab = vocab_size_of(model_cfg, vocab_size, read)
    plan = param_plan(model_cfg, vocab)
    prefix = HF_PREFIX[model_cfg.arch]
    hf_dtype = DTYPE_NAMES[dtype]
    order = _ordered(plan, model_cfg.num_hidden_layers)
    # HF name -> the (parameter, layer) pairs it is made of: one, or the row blocks of a fused
    # tensor (Phi-3's qkv_proj and gate_up_proj), which are written into one buffer in turn.
    source: dict[str, list[tuple[ParamMapping, Optional[int]]]] = {}
    for m, layer in order:
        source.setdefault(m.hf_name(layer, prefix), []).append((m, layer))
    specs = [TensorSpec(name, hf_dtype, parts[0][0].hf_shape) for name, parts in source.items()]

    def produce(spec: TensorSpec) -> np.ndarray:
        kill_point("export_tensor")  # tests: a kill in the middle of an export
        out = np.empty(spec.shape, DTYPES[hf_dtype])
        for m, layer in source[spec.name]:
            value = read(m.path, layer)
            where = m.dotted + ("" if layer is None else f"[{layer}]")
            if tuple(np.shape(value)) != m.layer_shape:
                raise ShapeMismatchError(f"parameters: {where} has shape {format_shape(np.shape(value))}; "
                                         f"{spec.name!r} needs {format_shape(m.layer_shape)} (our layout)")
            value = np.asarray(value)
            if value.dtype not in _FLOAT_NUMPY:
                raise DTypeMismatchError(f"parameters: {where} has dtype {value.dtype}; expected floats")
            dst = out if m.hf_rows is None else out[m.hf_rows[0]:m.hf_rows[1]]
            np.copyto(dst, value.T if m.transpose else value, casting="unsafe")
        return out

    if token_ids is None:
        token_ids = _config_token_ids(model_src) or _token_ids(tokenizer_src)
    config = hf_config_dict(model_cfg, dtype=dtype, vocab_size=vocab, token_ids=token_ids)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    os.chmod(staging, 0o755)  # mkdtemp makes it private; the export is an ordinary folder
    try:
        write_sharded(staging, specs, produce, shard_bytes, metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        _copy_tokenizer(tokenizer_src, staging)
        generation = Path(os.path.expanduser(str(model_src))) / GENERATION_CONFIG if model_src else None
        if generation is not None and generation.is_file() and not (staging / GENERATION_CONFIG).exists():
            shutil.copyfile(generation, staging / GENERATION_CONFIG)
        if out_dir.exists():
            out_dir.rmdir()  # checked empty above
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _copy_tokenizer(tokenizer_src: Optional[str | os.PathLike], dest: Path) -> None:
    if tokenizer_src is None:
        return
    src = Path(os.path.expanduser(str(tokenizer_src)))
    if not src.is_dir():
        raise HFCheckpointError(f"{src}: tokenizer folder does not exist")
    found = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not found:
        raise HFCheckpointError(f"{src}: no tokenizer files (expected one of: {', '.join(TOKENIZER_FILES[:6])})")
    for name in found:
        shutil.copyfile(src / name, dest / name)


_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _config_token_ids(folder: Optional[str | os.PathLike]) -> dict[str, Optional[int]]:
    """bos/eos/pad ids from ``folder``'s config.json ({} if it has none)."""
    if folder is None:
        return {}
    config_path = Path(os.path.expanduser(str(folder))) / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict) and any(k in config for k in _TOKEN_ID_KEYS):
        return {k: config.get(k) for k in _TOKEN_ID_KEYS}
    return {}


def _token_ids(tokenizer_src: Optional[str | os.PathLike]) -> dict[str, Optional[int]]:
    """bos/eos/pad ids from the source model's config.json, else from its tokenizer files."""
    if tokenizer_src is None:
        return {}
    src = Path(os.path.expanduser(str(tokenizer_src)))
    found = _config_token_ids(src)
    if found:
        return found
    if not src.is_dir():
        return {}
    from jaxascend.data import HFTokenizer  # imports transformers: only when needed

    try:
        tok = HFTokenizer(src)
    except ValueError:
        return {}
    return {"bos_token_id": tok.bos_id if tok.bos_id is not None else tok.eos_id,
            "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
