"""Real model shapes as Hugging Face ``config.json`` dicts, and randomly initialised HF folders.

    make_hf_checkpoint("llama", "1B", "/tmp/llama-1b", dtype="bfloat16")

writes a folder laid out exactly like ``meta-llama/Llama-3.2-1B`` (config.json, safetensors,
a small BPE tokenizer) with random weights, one tensor at a time, so tests, benchmarks and users
without network access have real folders to work on. The presets copy the architecture fields of
the published configs; :data:`PUBLISHED_PARAMS` holds their published parameter counts.
"""

from __future__ import annotations

import copy
import os
import tempfile
import zlib
from pathlib import Path
from typing import Optional

import numpy as np

from jaxascend.config import ModelConfig
from jaxascend.hf.config_map import model_config_from_hf_dict
from jaxascend.hf.export import DEFAULT_SHARD_BYTES, export_hf
from jaxascend.hf.gemma3_config import pattern_layer_types
from jaxascend.hf.names import param_plan
from jaxascend.models import norm_scale_init

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _qwen2(hidden, inter, layers, heads, kv, max_pos, tie, vocab=151936) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "sliding_window": max_pos, "use_sliding_window": False,
            "max_window_layers": layers, "tie_word_embeddings": tie, "vocab_size": vocab,
            "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151643}


def _llama3(hidden, inter, layers, heads, kv, tie, factor, head_dim=None) -> dict:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": factor},
              "tie_word_embeddings": tie, "vocab_size": 128256, "hidden_act": "silu",
              "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001}
    if head_dim is not None:
        config["head_dim"] = head_dim
    return config


def _gemma3(hidden, inter, layers, heads, kv, window, max_pos, vocab, rope_scaling) -> dict:
    """A Gemma 3 text config spelled as the published files are (transformers 4.50: top-level
    RoPE keys, sliding_window_pattern); the tiny preset uses transformers 5's spelling."""
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": 256, "query_pre_attn_scalar": 256,
            "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6, "sliding_window": window,
            "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "rope_scaling": rope_scaling, "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
            "vocab_size": vocab, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def _qwen3(hidden, inter, layers, heads, kv, tie, window_layers, vocab=151936) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": 128, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": window_layers,
            "tie_word_embeddings": tie, "vocab_size": vocab, "hidden_act": "silu",
            "bos_token_id": 151643, "eos_token_id": 151645}


# microsoft/Phi-3-mini-128k-instruct's LongRoPE factors (current revision), one per frequency.
_PHI3_LONG_FACTOR = [
    1.0700000524520874, 1.1200000047683716, 1.149999976158142, 1.4199999570846558, 1.5699999332427979,
    1.7999999523162842, 2.129999876022339, 2.129999876022339, 3.009999990463257, 5.910000324249268,
    6.950000286102295, 9.070000648498535, 9.930000305175781, 10.710000038146973, 11.130000114440918,
    14.609999656677246, 15.409998893737793, 19.809999465942383, 37.279998779296875, 38.279998779296875,
    38.599998474121094, 40.12000274658203, 46.20000457763672, 50.940006256103516, 53.66000747680664,
    54.9373893737793, 56.89738845825195, 57.28738784790039, 59.98738479614258, 60.86738586425781,
    60.887386322021484, 61.71739196777344, 62.91739273071289, 62.957393646240234, 63.41739273071289,
    63.8173942565918, 63.83739471435547, 63.897396087646484, 63.93739700317383, 64.06739807128906,
    64.11434936523438, 64.12435150146484, 64.15435028076172, 64.19435119628906, 64.24435424804688,
    64.57435607910156, 64.69000244140625, 64.76000213623047]
_PHI3_SHORT_FACTOR = (
    [1.1, 1.1, 1.1, 1.3000000000000003, 1.3500000000000003, 1.3500000000000003, 1.4000000000000004,
     1.5500000000000005] + [2.000000000000001] * 17 + [2.0500000000000007] * 6
    + [2.1000000000000005, 2.1000000000000005, 2.1500000000000004] + [2.25] * 5
    + [2.3999999999999995, 2.4499999999999993, 2.499999999999999, 2.6999999999999984, 2.6999999999999984,
       2.7499999999999982, 2.799999999999998, 2.8999999999999977, 3.049999999999997])


def _phi3_mini(max_pos, window, rope_scaling) -> dict:
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
            "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "max_position_embeddings": max_pos,
            "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "rope_scaling": rope_scaling, "sliding_window": window, "tie_word_embeddings": False,
            "vocab_size": 32064, "hidden_act": "silu", "attention_dropout": 0.0, "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000}


# arch -> size -> config.json architecture fields.
PRESETS: dict[str, dict[str, dict]] = {
    "qwen2": {
        "tiny": {**_qwen2(64, 96, 2, 4, 2, 256, True, vocab=512), "rope_theta": 1000000.0},
        "0.5B": _qwen2(896, 4864, 24, 14, 2, 32768, True),
        "1.5B": _qwen2(1536, 8960, 28, 12, 2, 131072, True),
        "3B": _qwen2(2048, 11008, 36, 16, 2, 32768, True),
        "7B": _qwen2(3584, 18944, 28, 28, 4, 131072, False, vocab=152064),
    },
    "llama": {
        # GQA, head_dim != hidden/heads, llama3 RoPE scaling, untied head: every llama path.
        "tiny": {**_llama3(64, 96, 2, 4, 2, False, 8.0, head_dim=24), "vocab_size": 512,
                 "max_position_embeddings": 256,
                 "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 32}},
        "1B": _llama3(2048, 8192, 16, 32, 8, True, 32.0, head_dim=64),
        "3B": _llama3(3072, 8192, 28, 24, 8, True, 32.0, head_dim=128),
        "8B": _llama3(4096, 14336, 32, 32, 8, False, 8.0),
    },
    "mistral": {
        "tiny": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,
                 "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 1, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
                 "rope_theta": 10000.0, "sliding_window": 5, "tie_word_embeddings": False,
                 "vocab_size": 512, "hidden_act": "silu"},
        "7B": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
               "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
               "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
               "vocab_size": 32000, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2},
    },
    "gpt2": {
        "tiny": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2,
                 "n_head": 4, "n_inner": None, "n_positions": 128, "vocab_size": 512,
                 "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"},
        "124M": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_layer": 12,
                 "n_head": 12, "n_inner": None, "n_positions": 1024, "vocab_size": 50257,
                 "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
                 "bos_token_id": 50256, "eos_token_id": 50256},
    },
    "gemma3": {
        # 6 sliding layers and 1 full (layer 5), window 5 < the tests' 12 tokens, head_dim 16 with
        # query_pre_attn_scalar 12, linear x8 RoPE on the full layer only, a softcap low enough
        # to bend the tiny model's small logits; transformers 5's nested rope_parameters.
        "tiny": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
                 "intermediate_size": 96, "num_hidden_layers": 7, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 12,
                 "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "sliding_window": 5,
                 "layer_types": pattern_layer_types(6, 7),
                 "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                 "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 0.5,
                 "tie_word_embeddings": True, "vocab_size": 512},
        "1B": _gemma3(1152, 6912, 26, 4, 1, 512, 32768, 262144, None),
        # The text model of the multimodal google/gemma-3-4b-pt (its text_config with defaults).
        "4B": _gemma3(2560, 10240, 34, 8, 4, 1024, 131072, 262208, {"rope_type": "linear", "factor": 8.0}),
    },
    "qwen3": {
        # head_dim 24 != hidden / heads (Qwen3 sets head_dim explicitly), tied like 0.6B-4B.
        "tiny": {**_qwen3(64, 96, 2, 4, 2, True, 2, vocab=512), "head_dim": 24,
                 "max_position_embeddings": 256},
        "0.6B": _qwen3(1024, 3072, 28, 16, 8, True, 28),
        "1.7B": _qwen3(2048, 6144, 28, 16, 8, True, 28),
        "4B": _qwen3(2560, 9728, 36, 32, 8, True, 36),
        "8B": _qwen3(4096, 12288, 36, 32, 8, False, 36),
    },
    "phi3": {
        # LongRoPE with original_max_position_embeddings 8 (so the tests' 12 tokens take the long
        # factors, 8 or fewer the short ones), factors != 1, sliding window 5 on every layer.
        "tiny": {**_phi3_mini(256, 5, {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                       "long_factor": [1.0 + 0.5 * i for i in range(8)]}),
                 "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "original_max_position_embeddings": 8, "vocab_size": 512,
                 "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        "mini-4k": _phi3_mini(4096, 2047, None),
        # sliding_window 262144 as published (above max_position_embeddings: it never binds).
        "mini-128k": _phi3_mini(131072, 262144, {"type": "longrope", "short_factor": _PHI3_SHORT_FACTOR,
                                                 "long_factor": _PHI3_LONG_FACTOR}),
    },
}

# Parameter counts published for the real models (tied heads counted once).
PUBLISHED_PARAMS = {
    ("qwen2", "0.5B"): 494_032_768, ("qwen2", "1.5B"): 1_543_714_304,
    ("qwen2", "3B"): 3_085_938_688, ("qwen2", "7B"): 7_615_616_512,
    ("llama", "1B"): 1_235_814_400, ("llama", "3B"): 3_212_749_824, ("llama", "8B"): 8_030_261_248,
    ("mistral", "7B"): 7_241_732_096, ("gpt2", "124M"): 124_439_808,
    # Gemma 3 text models, as transformers counts them (the 4B's ~0.42B vision tower excluded).
    ("gemma3", "1B"): 999_885_952, ("gemma3", "4B"): 3_880_263_168,
    # Qwen3 and Phi-3-mini as transformers counts them (meta device; Qwen's 0.6B model card says
    # 0.44B non-embedding, which matches).
    ("qwen3", "0.6B"): 596_049_920, ("qwen3", "1.7B"): 1_720_574_976, ("qwen3", "4B"): 4_022_468_096,
    ("qwen3", "8B"): 8_190_735_360, ("phi3", "mini-4k"): 3_821_079_552, ("phi3", "mini-128k"): 3_821_079_552,
}


def preset_config(arch: str, size: str) -> dict:
    """The config.json dict of preset ``size`` of ``arch``; ValueError listing the choices."""
    if arch not in PRESETS:
        raise ValueError(f"--arch: {arch!r} is not supported (allowed: {', '.join(PRESETS)})")
    if size not in PRESETS[arch]:
        raise ValueError(f"--size: {size!r} is not a preset for {arch} (allowed: {', '.join(PRESETS[arch])})")
    return copy.deepcopy(PRESETS[arch][size])


def random_reader(seed: int, init_std: float, random_norms: bool, norm_scale: float = 1.0):
    """A ParamReader of random weights: normal(init_std) matrices and embeddings, ``norm_scale``
    for norm scales (1; 0 for Gemma 3's zero-centred norms, see ``models.norm_scale_init``) and
    zeros for biases (or, with ``random_norms``, norm_scale + 0.1 N(0,1) and 0.1 N(0,1), so a
    misplaced scale or bias shows up in logits). Each tensor's values depend only on ``seed``,
    its path and layer, never on the order tensors are requested in."""
    def read(path: tuple[str, ...], layer: Optional[int], shape: tuple[int, ...]) -> np.ndarray:
        key = zlib.crc32(".".join(path).encode())
        rng = np.random.default_rng([seed, key] + ([] if layer is None else [layer + 1]))
        leaf = path[-1]
        if leaf in ("scale", "bias") and not random_norms:
            return np.full(shape, norm_scale if leaf == "scale" else 0.0, np.float32)
        noise = rng.standard_normal(shape, dtype=np.float32)
        if leaf == "scale":
            return np.float32(norm_scale) + np.float32(0.1) * noise
        noise *= np.float32(0.1 if leaf == "bias" else init_std)
        return noise

    return read


def _sample_texts() -> list[str]:
    """A deterministic corpus for the tokenizer: a few standard-library modules."""
    import json as json_module
    import os as os_module
    import textwrap

    texts = []
    for module in (os_module, json_module, textwrap):
        with open(module.__file__, encoding="utf-8") as fh:
            texts.append(fh.read())
    return texts


def make_hf_checkpoint(arch: str, size: str, out_dir: str | os.PathLike, *, dtype: str = "bfloat16",
                       seed: int = 0, random_norms: bool = False,
                       shard_bytes: int = DEFAULT_SHARD_BYTES, tokenizer_vocab: int = 512) -> Path:
    """Writes a randomly initialised ``arch``/``size`` model as a Hugging Face folder ``out_dir``
    (config.json, safetensors, tokenizer), one tensor at a time. Returns the folder."""
    from jaxascend.data import write_hf_tokenizer

    hf = preset_config(arch, size)
    cfg: ModelConfig = model_config_from_hf_dict(hf, source=f"preset {arch}/{size}")
    # Leave room for special tokens that a model-specific tokenizer class adds on load (Qwen2's
    # adds <|endoftext|>): the tokenizer must never outgrow the embedding table.
    tokenizer_vocab = min(tokenizer_vocab, cfg.vocab_size - 16)
    source = random_reader(seed, cfg.init_std, random_norms, norm_scale_init(cfg.arch))
    shapes = {m.path: m.layer_shape for m in param_plan(cfg)}
    token_ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = write_hf_tokenizer(Path(tmp) / "tokenizer", _sample_texts(), tokenizer_vocab,
                                           model_max_length=cfg.max_position_embeddings)
        return export_hf(lambda path, layer: source(path, layer, shapes[path]), cfg, out_dir,
                         tokenizer_src=tokenizer_dir, dtype=dtype, shard_bytes=shard_bytes,
                         token_ids=token_ids)
