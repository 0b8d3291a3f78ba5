"""A prompt prefilled in blocks (jaxascend.generation.prefill) gives what the one call over the
whole prompt gives: the same greedy tokens and the next token's logits within float32 summation
noise, for the Llama family (GQA + llama3 RoPE; phi3's longrope, whose factors depend on the
prompt's length), Gemma 3 (sliding and global layers in one scan, the window crossing block
boundaries) and GPT-2 (learned positions), with the layers resident and streamed one by one.

Blocks of 8 tokens; prompts shorter than a block, of exactly one, of one plus a token, and of
two and a half (two full blocks and a padded remainder). The one-call generator has a block
larger than every prompt, which is the prefill as it was before blocks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

from jaxascend.generation import Generator, SamplingConfig
from jaxascend.generation import prefill
from jaxascend.hf import param_plan, reader_from_params
from tests._tolerances import assert_reordered_close, logits_atol
from tests.models.test_decode import config
from tests.models.test_models import randomized_model, sample_ids

BLOCK = 8
PROMPTS = (5, 8, 9, 21)  # shorter than a block, one block, one block + 1, 2 blocks + 5
NEW_TOKENS = 13
MAX_LENGTH = 32  # every cache is 32 long (5 + 13 - 1 rounds up to 32, 21 + 13 - 1 is capped): few compilations


def test_blocks_cover_the_prompt_with_one_block_shape_and_a_bucketed_remainder():
    blocks, B = prefill.prefill_blocks, prefill.Block
    assert blocks(5, 8, 64) == (B(0, 8),)  # bucket 16, capped at the block
    assert blocks(8, 8, 64) == (B(0, 8),)
    assert blocks(9, 8, 64) == (B(0, 8), B(8, 8))
    assert blocks(21, 8, 64) == (B(0, 8), B(8, 8), B(16, 8))
    assert blocks(1300, 512, 2048) == (B(0, 512), B(512, 512), B(1024, 512))
    assert blocks(1040, 512, 2048) == (B(0, 512), B(512, 512), B(1024, 16))
    assert blocks(100, 512, 2048) == (B(0, 128),)  # a short prompt: its bucket, as before
    assert blocks(1030, 512, 1040) == (B(0, 512), B(512, 512), B(1024, 16))
    assert blocks(1030, 512, 1035) == (B(0, 512), B(512, 512), B(1024, 11))  # the cache's end
    assert blocks(20, 24, 64) == (B(0, 24),)  # a block that is not a bucket caps the padding


@pytest.mark.parametrize("args, message", [
    ((5, 0, 64), "prefill_block: must be an integer >= 1, got 0"),
    ((5, 8.0, 64), "prefill_block: must be an integer >= 1, got 8.0"),
    ((65, 8, 64), "prompt: 65 tokens do not fit a cache of 64 positions"),
    ((0, 8, 64), "prompt: 0 tokens do not fit"),
])
def test_bad_blocks_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        prefill.prefill_blocks(*args)


def test_the_generator_checks_its_block():
    cfg = config("llama")
    params = nnx.state(randomized_model(cfg), nnx.Param)
    with pytest.raises(ValueError, match="prefill_block: must be an integer >= 1, got -1"):
        Generator(cfg, params, prefill_block=-1)


@pytest.fixture(scope="module", params=["llama", "phi3", "gemma3", "gpt2"])
def generators(request):
    """The arch's model as four generators: resident and streamed, in blocks and in one call."""
    cfg = dataclasses.replace(config(request.param), max_position_embeddings=MAX_LENGTH)
    params = nnx.state(randomized_model(cfg, seed=2), nnx.Param)
    gens = {(stream, block): Generator(cfg, params, stream_layers=stream, prefill_block=block)
            for stream in (False, True) for block in (BLOCK, 1024)}
    yield request.param, gens
    for gen in gens.values():
        gen.close()


# Every prompt length once per arch, the placements alternating over them.
@pytest.mark.parametrize("length, stream", list(zip(PROMPTS, (False, True, False, True))),
                         ids=[f"{n}-{s}" for n, s in zip(PROMPTS, ("resident", "streamed") * 2)])
def test_blocked_prefill_gives_the_one_call_logits_and_tokens(generators, stream, length, monkeypatch):
    arch, gens = generators
    prompt = np.asarray(sample_ids(batch=1, length=length, seed=length))[0]
    blocked, whole = gens[stream, BLOCK], gens[stream, 1024]
    blocks_per_call = []
    call = blocked._call

    def spy(ids, blocks, *rest):
        blocks_per_call.append(len(blocks))
        return call(ids, blocks, *rest)

    monkeypatch.setattr(blocked, "_call", spy)
    got, expected = blocked.prompt_logits(prompt, NEW_TOKENS), whole.prompt_logits(prompt, NEW_TOKENS)
    assert blocks_per_call == [-(-length // BLOCK)]  # the prefill went in blocks
    # float32 sums in another order (tests/_tolerances.py): the tolerance from the model's depth,
    # widths and the logits' scale, not from one CPU's figure
    assert_reordered_close(got, expected, logits_atol(blocked.model_config, expected, MAX_LENGTH),
                           f"{arch} {'streamed' if stream else 'resident'} prompt {length}")
    settings = SamplingConfig(max_new_tokens=NEW_TOKENS)
    tokens = whole.generate(prompt, settings).tokens
    assert len(tokens) == min(NEW_TOKENS, MAX_LENGTH - length + 1)  # to the cache's end at most
    assert blocked.generate(prompt, settings).tokens == tokens


def test_longrope_blocks_must_rotate_with_the_prompts_length():
    """phi3's longrope switches factors past 8 tokens. Two cached calls of 8 over a 16-token
    prompt give the one call's logits when both pass the prompt's length as ``rope_length``; left
    to ``start + t`` the first block's keys get the short factors and the logits move (what the
    generator tests above would catch)."""
    model = randomized_model(config("phi3"), seed=2)
    ids = sample_ids(batch=1, length=16)
    whole, _ = model.decode(ids, model.init_cache(batch=1, length=16), 0)

    def in_two_blocks(rope_length):
        cache = model.init_cache(batch=1, length=16)
        _, cache = model.decode_hidden(ids[:, :8], cache, 0, rope_length)
        hidden, _ = model.decode_hidden(ids[:, 8:], cache, 8, rope_length)
        return np.asarray(model.logits(hidden))

    whole = np.asarray(whole)[:, 8:]
    atol = logits_atol(config("phi3"), whole, 16)
    assert_reordered_close(in_two_blocks(16), whole, atol, "phi3 longrope in two blocks")
    assert np.abs(in_two_blocks(None) - whole).max() > 100 * atol


def test_streamed_blocks_read_each_layer_once_per_call():
    cfg = config("llama")
    params = nnx.state(randomized_model(cfg), nnx.Param)
    read = reader_from_params(params)
    stacked = {m.path for m in param_plan(cfg) if m.stacked}
    log = []

    def recording(path, layer):
        log.append((path, layer))
        return read(path, layer)

    with Generator(cfg, recording, stream_layers=True, prefill_block=4) as gen:
        log.clear()
        gen.generate(np.asarray(sample_ids(batch=1, length=13))[0], SamplingConfig(max_new_tokens=2))
    layers = [layer for i, (_, layer) in enumerate(log) if i % len(stacked) == 0]
    # 13 tokens in 4 blocks, then one new token: two calls, each layer read once per call
    assert layers in ([0, 1] * 2, [0, 1] * 2 + [0])
