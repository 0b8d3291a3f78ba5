"""Cached decoding (jaxascend.models.decoding, the Generator of jaxascend.generation): a prefill
and then one token at a time over the key/value cache give the logits of the full forward pass,
greedy generation gives the tokens of recomputing the whole prefix at every step, and the
layer-at-a-time (streamed) generator gives the tokens of the resident one.

The full forward is causal (tests/models/test_models.py), so its logits at position ``i`` are
the last-position logits of the prefix ``[0, i]``: one jitted forward of a fixed length serves
every prefix. Every architecture family: GQA + llama3 RoPE (llama), q/k norms + yarn (qwen3), a
sliding window shorter than the sequence (mistral), the window + longrope + partial rotary
(phi3), mixed sliding and global layers with two RoPEs and softcapping (gemma3), learned
positions (gpt2).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxascend.generation import Generator, SamplingConfig
from jaxascend.models import KVCache
from jaxascend.models.rope import Rotary
from tests._tolerances import assert_reordered_close, logits_atol
from tests.models.test_gemma3 import gemma3_config
from tests.models.test_models import VOCAB, forward, randomized_model, sample_ids, tiny_config

ARCHS = ["llama", "qwen3", "mistral", "phi3", "gemma3", "gpt2"]
LENGTH = 16  # the whole sequence; mistral's and phi3's window is 5, gemma3's sliding layers' too
PROMPT = 9  # > phi3's original_max_position_embeddings (8): every call uses the long factors, as the
            # full forward over 16 tokens does


def config(arch: str):
    cfg = gemma3_config() if arch == "gemma3" else tiny_config(arch)
    return dataclasses.replace(cfg, vocab_size=VOCAB)


@pytest.fixture(scope="module", params=ARCHS)
def case(request):
    cfg = config(request.param)
    return request.param, cfg, randomized_model(cfg)


@pytest.fixture(scope="module")
def generators(case):
    """The case's model as a resident and as a layer-at-a-time generator (compiled once)."""
    _, cfg, model = case
    params = nnx.state(model, nnx.Param)
    with Generator(cfg, params) as resident, Generator(cfg, params, stream_layers=True) as streamed:
        yield resident, streamed


@functools.partial(jax.jit, static_argnums=0)
def _decode(graphdef, state, ids, cache, start):
    return nnx.merge(graphdef, state).decode(ids, cache, start)


def cached_logits(model, ids, prompt: int, cache: KVCache) -> np.ndarray:
    """float32 [B, T, V]: the prompt's logits from the prefill, then each later position's from a
    one-token call, all through the cache."""
    graphdef, state = nnx.split(model)
    logits, cache = _decode(graphdef, state, ids[:, :prompt], cache, 0)
    rows = [np.asarray(logits)]
    for i in range(prompt, ids.shape[1]):
        logits, cache = _decode(graphdef, state, ids[:, i:i + 1], cache, i)
        rows.append(np.asarray(logits))
    return np.concatenate(rows, axis=1)


def test_prefill_and_steps_match_the_full_forward(case):
    arch, cfg, model = case
    ids = sample_ids(batch=2, length=LENGTH)
    full = forward(model, ids)
    cache = model.init_cache(batch=2, length=LENGTH + 4)  # longer than needed: the tail stays masked
    got = cached_logits(model, ids, PROMPT, cache)
    # float32 sums in another order (tests/_tolerances.py)
    assert_reordered_close(got, full, logits_atol(cfg, full, LENGTH + 4), f"{arch} cached")


def test_cache_entries_past_the_call_are_never_seen(case):
    """Garbage in the cache beyond ``start + t`` (a padded prefill's keys) changes nothing."""
    arch, cfg, model = case
    ids = sample_ids(batch=1, length=LENGTH, seed=3)
    ids = jnp.concatenate([ids, ids[:, ::-1]])  # the shapes of the test above: no new compilation
    clean = cached_logits(model, ids, PROMPT, model.init_cache(batch=2, length=LENGTH + 4))
    shape = model.init_cache(batch=2, length=LENGTH + 4).k.shape
    rng = np.random.default_rng(0)
    dirty = KVCache(*(jnp.asarray(50 * rng.standard_normal(shape), jnp.float32) for _ in range(2)))
    # The same program over the same visible entries: the masked scores are float32's min, whose
    # exp is an exact 0, so the garbage changes no bit.
    np.testing.assert_array_equal(cached_logits(model, ids, PROMPT, dirty), clean)


def naive_greedy(model, prompt: np.ndarray, new_tokens: int) -> list[int]:
    """Greedy decoding without a cache: the whole prefix through the model at every step (in a
    buffer of a fixed length, the tail ignored by causality, so that one compilation serves)."""
    buffer = np.zeros((1, LENGTH), np.int32)
    buffer[0, :prompt.size] = prompt
    length = prompt.size
    for _ in range(new_tokens):
        logits = forward(model, jnp.asarray(buffer))[0, length - 1]
        buffer[0, length] = int(np.argmax(logits))
        length += 1
    return buffer[0, prompt.size:length].tolist()


def test_greedy_generation_gives_the_tokens_of_recomputing_the_prefix(case, generators):
    _, _, model = case
    prompt = np.asarray(sample_ids(batch=1, length=PROMPT, seed=5))[0]
    expected = naive_greedy(model, prompt, LENGTH - PROMPT)
    settings = SamplingConfig(max_new_tokens=LENGTH - PROMPT)
    resident, streamed = generators
    assert resident.generate(prompt, settings).tokens == expected
    assert streamed.generate(prompt, settings).tokens == expected


def test_streamed_layers_sample_the_tokens_of_the_resident_model(generators):
    prompt = np.asarray(sample_ids(batch=1, length=PROMPT, seed=7))[0]
    settings = SamplingConfig(max_new_tokens=LENGTH - PROMPT, temperature=1.0, top_p=0.9, seed=11)
    resident, streamed = generators
    tokens = resident.generate(prompt, settings).tokens
    assert streamed.generate(prompt, settings).tokens == tokens
    # and sampling does draw: another seed gives another continuation
    assert resident.generate(prompt, dataclasses.replace(settings, seed=12)).tokens != tokens


def test_longrope_chooses_its_factors_from_the_call_length():
    """Below the original length the short factors apply (the full forward over 4 tokens), past
    it the long ones (the forward over 16, above): as transformers chooses per call."""
    cfg = config("phi3")
    model = randomized_model(cfg)
    ids = sample_ids(batch=1, length=4)
    got, want = cached_logits(model, ids, 4, model.init_cache(batch=1, length=8)), forward(model, ids)
    assert_reordered_close(got, want, logits_atol(cfg, want, 8), "phi3 short factors")


@pytest.mark.parametrize("scaling, mpe", [
    ({"rope_type": "longrope", "original_max_position_embeddings": 8, "short_factor": [1.0, 1.5, 2.0, 2.5],
      "long_factor": [3.0, 4.0, 5.0, 6.0]}, 32),
    ({"rope_type": "dynamic", "factor": 4.0}, 16),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}, 32),
])
def test_traced_length_frequencies_equal_the_static_ones(scaling, mpe):
    rope = Rotary(8, 10000.0, Rotary.freeze(scaling), mpe)
    choose = jax.jit(rope.inverse_frequencies_at)
    for length in (1, 8, 9, 16, 17, 40):
        np.testing.assert_allclose(np.asarray(choose(jnp.int32(length))), rope.inverse_frequencies(length),
                                   rtol=2e-6, err_msg=f"length {length}")


def test_decode_checks_the_cache_depth():
    cfg = config("llama")
    model = randomized_model(cfg)
    wrong = KVCache.zeros(cfg.num_hidden_layers + 1, 1, 8, cfg.num_key_value_heads, 24, jnp.float32)
    with pytest.raises(ValueError, match="cache: 3 layers for a model of 2"):
        model.decode(sample_ids(batch=1, length=2), wrong, 0)
