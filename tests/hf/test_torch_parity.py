"""Our Flax models against transformers' PyTorch models on the same weights.

Skipped when torch is not installed (``pip install torch==2.13.0`` installs a CPU build).
Tolerance: fp32 logits agree to atol 1e-4, rtol 1e-4 (observed differences are ~3e-7).
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed; pip install torch==2.13.0 (CPU build)")
transformers = pytest.importorskip("transformers")

from jaxascend.config import ModelConfig  # noqa: E402
from jaxascend.hf import model_config_from_hf  # noqa: E402
from jaxascend.hf import export_hf  # noqa: E402
from jaxascend.hf import load_hf_model, load_hf_params  # noqa: E402
from jaxascend.hf import PRESETS, make_hf_checkpoint, model_config_from_hf_dict  # noqa: E402

ARCHS = ("llama", "qwen2", "mistral", "gpt2")
FP32 = ModelConfig(dtype="float32", param_dtype="float32")
ATOL = RTOL = 1e-4


def sample_ids() -> np.ndarray:
    # 12 tokens: longer than the tiny Mistral's sliding window (5), so the window matters.
    return np.random.default_rng(1).integers(0, 512, (2, 12))


def ours(folder) -> np.ndarray:
    model = load_hf_model(folder, model_config_from_hf(folder, FP32))
    return np.asarray(model(jnp.asarray(sample_ids(), jnp.int32)))


def theirs(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True, output_loading_info=True)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(sample_ids())).logits.numpy()
    return logits, info


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_on_the_same_weights(arch, tmp_path):
    folder = make_hf_checkpoint(arch, "tiny", tmp_path / arch, dtype="float32", random_norms=True)
    reference, info = theirs(folder)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    np.testing.assert_allclose(ours(folder), reference, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_our_export_unchanged(arch, tmp_path):
    folder = make_hf_checkpoint(arch, "tiny", tmp_path / "src", dtype="float32", random_norms=True)
    cfg = model_config_from_hf(folder, FP32)
    out = export_hf(load_hf_params(folder, cfg), cfg, tmp_path / "out", tokenizer_src=folder,
                    dtype="float32", shard_bytes=50_000)
    reference, info = theirs(out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    np.testing.assert_allclose(ours(folder), reference, atol=ATOL, rtol=RTOL)
    copied = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    original = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert len(copied) == len(original) > 259  # a trained BPE vocabulary, not just bytes + specials
    assert copied("def f(x): return x")["input_ids"] == original("def f(x): return x")["input_ids"]


@pytest.mark.parametrize("arch", ARCHS)
def test_we_load_what_transformers_saves(arch, tmp_path):
    """A folder written by transformers' own save_pretrained (its names, its tying, its config)."""
    hf_config = transformers.AutoConfig.for_model(**{
        k: v for k, v in PRESETS[arch]["tiny"].items() if k != "architectures"})
    hf_config.architectures = PRESETS[arch]["tiny"]["architectures"]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        with torch.no_grad():  # randomize norms and biases too, so a misplaced one shows
            for name, p in model.named_parameters():
                if p.ndim == 1:
                    p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "weight" in name else 0.0))
        model.save_pretrained(tmp_path)
    assert model_config_from_hf(tmp_path) == model_config_from_hf_dict(
        PRESETS[arch]["tiny"], path=str(tmp_path))
    reference, _ = theirs(tmp_path)
    np.testing.assert_allclose(ours(tmp_path), reference, atol=ATOL, rtol=RTOL)
