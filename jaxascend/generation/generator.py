"""Sampling from a model with a key/value cache: the weights resident, or streamed layer by layer.

    with Generator(model_cfg, weights.read, dtype="bfloat16") as gen:
        out = gen.generate(prompt_ids, SamplingConfig(max_new_tokens=64), on_token=print)
        out.tokens, out.stop_reason

Resident (``stream_layers=False``): the parameter tree is built one tensor at a time in the
compute dtype and one jitted function runs a whole call (embed, ``lax.scan`` over the layers
with the cache in the carry, final norm and head at one position, the sampler). Streamed
(``stream_layers=True``, for weights that do not fit in memory): only the embeddings, final norm
and head are resident; each call runs the same per-layer function
(:func:`jaxascend.models.decoding.layer_decode`) from a Python loop, each layer's weights read
just before it is needed and the next layer's read on a thread meanwhile. Both give the same
tokens.

The cache length is the prompt plus ``max_new_tokens`` rounded up to a bucket
(:func:`~jaxascend.generation.sampling.bucket_length`), capped at ``max_position_embeddings``.
The prompt is prefilled in calls of at most ``prefill_block`` tokens
(:mod:`~jaxascend.generation.prefill`), the last one padded to a bucket, so the attention scores
of a call are ``prefill_block x cache length`` however long the prompt, and prompts of similar
length reuse the compiled steps. Resident, each block runs the whole layer scan; streamed, each
layer runs every block before the next layer is read, so the weights are still read once per
call. Only the last block's last position goes through the head. Prompts are generated one at a
time (batch 1).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.generation.prefill import PREFILL_BLOCK, Block, check_block, prefill_blocks
from jaxascend.generation.sampling import SamplingConfig, StepInputs, bucket_length, sample_step
from jaxascend.generation.weights import LayerStream, merged, read_params
from jaxascend.hf import abstract_params, param_plan
from jaxascend.models import DTYPES
from jaxascend.models import KVCache, cache_positions, layer_decode

STOP_ID, MAX_NEW_TOKENS, MAX_LENGTH = "stop id", "max_new_tokens", "max_position_embeddings"


def check_prompt(prompt_ids, model_cfg: ModelConfig) -> np.ndarray:
    """``prompt_ids`` as int32 ``[P]``; ValueError when it is empty, longer than the model's
    ``max_position_embeddings`` or holds an id outside its vocabulary."""
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if prompt.size == 0:
        raise ValueError("prompt: empty (no tokens to start from)")
    if prompt.size > model_cfg.max_position_embeddings:
        raise ValueError(f"prompt: {prompt.size} tokens, longer than the model's max_position_embeddings "
                         f"({model_cfg.max_position_embeddings})")
    bad = (prompt < 0) | (prompt >= model_cfg.vocab_size)
    if bad.any():
        raise ValueError(f"prompt: token id {int(prompt[bad][0])} is outside the model's vocabulary "
                         f"0..{model_cfg.vocab_size - 1}")
    return prompt.astype(np.int32)


@dataclass
class Generation:
    """What one call of :meth:`Generator.generate` produced."""

    tokens: list[int]  # the new tokens, without the stop id that ended them
    stop_reason: str  # STOP_ID, MAX_NEW_TOKENS or MAX_LENGTH (the cache reached the model's limit)
    prompt_length: int
    seconds: float  # from the start of the prefill to the end
    token_seconds: list[float]  # when each token (the stop id included) was known, from the same start

    @property
    def tokens_per_second(self) -> float:
        """The steady decoding rate, from the second token on (the first step may compile); 0
        when there are fewer than three tokens."""
        times = self.token_seconds
        return (len(times) - 2) / (times[-1] - times[1]) if len(times) > 2 and times[-1] > times[1] else 0.0


class Generator:
    """A model ready to sample from (see the module doc).

    ``weights``: a reader ``read(path, layer)`` over our parameter tree (``ParamsFile.read``,
    ``CheckpointWeights.read``, ``HFParamReader.read``) or an in-memory tree (``nnx.State``,
    module, pure dict). ``model_cfg.vocab_size`` must be set. ``dtype`` is the compute dtype
    (default ``model_cfg.dtype``); the weights are held in it too. ``prefill_block``: the most
    prompt tokens one cached call takes (see :mod:`~jaxascend.generation.prefill`).
    """

    def __init__(self, model_cfg: ModelConfig, weights, *, dtype: Optional[str] = None,
                 stream_layers: bool = False, prefill_block: int = PREFILL_BLOCK):
        if not model_cfg.vocab_size:
            raise ValueError("model.vocab_size: 0 (unknown); the sampler needs the resolved model config")
        dtype = dtype or model_cfg.dtype
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not supported (allowed: {', '.join(DTYPES)})")
        self.model_config = dataclasses.replace(model_cfg, dtype=dtype, param_dtype=dtype, remat="none")
        self.vocab_size = model_cfg.vocab_size
        self.max_length = model_cfg.max_position_embeddings
        self.stream_layers = stream_layers
        self.prefill_block = check_block(prefill_block)
        self._dtype = DTYPES[dtype]
        self._graphdef, self._abstract = abstract_params(self.model_config)
        model = nnx.merge(self._graphdef, self._abstract)
        self._flags = model.layer_flags
        self._dims = model.kv_cache_dims
        plan = param_plan(self.model_config)
        self._params = read_params(plan, weights, self._dtype, layer_stack=not stream_layers)
        self._layers: Optional[LayerStream] = None
        if stream_layers:
            self._layers = LayerStream(weights, plan, self._dims[0], self._dtype)
            self._layer_graphdef, self._layer_abstract = nnx.split(getattr(model, model.LAYER_STACK))
            self._embed = jax.jit(self._embed_fn)
            self._layer = jax.jit(self._layer_fn, donate_argnames=("cache",))
            self._head = jax.jit(self._head_fn)
        else:
            self._forward = jax.jit(self._forward_fn, donate_argnames=("cache",))
            self._fill = jax.jit(self._fill_fn, donate_argnames=("cache",))

    # ------------------------------------------------------------------ jitted pieces

    def _sample_at(self, model, hidden, last, index, inputs: StepInputs) -> tuple[jax.Array, jax.Array]:
        """The next token and the float32 logits ``[B, V]`` it was drawn from, at position
        ``last`` of the call."""
        at = jax.lax.dynamic_slice_in_dim(hidden, last, 1, axis=1)  # [B, 1, D]: the head at one position
        logits = model.logits(at)[:, 0]
        return sample_step(logits, inputs, index), logits

    def _forward_fn(self, params, ids, cache, start, rope_length, last, index, inputs):
        model = merged(self._graphdef, self._abstract, params)
        hidden, cache = model.decode_hidden(ids, cache, start, rope_length)
        return self._sample_at(model, hidden, last, index, inputs), cache

    def _fill_fn(self, params, ids, cache, start, rope_length):
        """A prefill block before the last: its keys and values into the cache, no head."""
        model = merged(self._graphdef, self._abstract, params)
        return model.decode_hidden(ids, cache, start, rope_length)[1]

    def _embed_fn(self, params, ids, start):
        model = merged(self._graphdef, self._abstract, params)
        return model.embed_inputs(ids, cache_positions(ids, start))

    def _layer_fn(self, layer_params, hidden, cache, index, start, rope_length, flag):
        state = jax.tree.map(lambda x: x, self._layer_abstract)
        nnx.replace_by_pure_dict(state, layer_params)
        positions = jnp.broadcast_to(start + jnp.arange(hidden.shape[1], dtype=jnp.int32), hidden.shape[:2])
        return layer_decode(self._layer_graphdef, state, hidden, positions, cache, index, start, flag, rope_length)

    def _head_fn(self, params, hidden, last, index, inputs):
        model = merged(self._graphdef, self._abstract, params)
        return self._sample_at(model, hidden, last, index, inputs)

    def _call(self, ids: np.ndarray, blocks: tuple[Block, ...], cache: KVCache, rope_length: int, last: int,
              index: int, inputs: StepInputs) -> tuple[tuple[jax.Array, jax.Array], KVCache]:
        """The cached calls over ``ids [1, t]``, the tokens at cache indices ``blocks[0].start ..
        blocks[-1].end``, one call per block (a prefill, or one new token as a block of 1);
        returns ``(token, logits)`` sampled from position ``last`` of the last block (as the
        ``index``-th new token) and the cache. ``rope_length``: the length RoPE chooses its
        frequencies from in every block (the prompt's, in a prefill)."""
        rope_length, last, index = np.int32(rope_length), np.int32(last), np.int32(index)
        base = blocks[0].start
        pieces = [(ids if len(blocks) == 1 else ids[:, b.start - base:b.end - base], np.int32(b.start))
                  for b in blocks]
        if self._layers is None:
            for piece, start in pieces[:-1]:
                cache = self._fill(self._params, piece, cache, start, rope_length)
            piece, start = pieces[-1]
            return self._forward(self._params, piece, cache, start, rope_length, last, index, inputs)
        # Streamed: layer by layer, every block through a layer before the next layer is read.
        hidden = [self._embed(self._params, piece, start) for piece, start in pieces]
        for layer in range(self._dims[0]):
            weights = self._layers.get(layer)  # waits for this layer's read; starts the next one's
            flag = None if self._flags is None else np.bool_(self._flags[layer])
            for i, (_, start) in enumerate(pieces):
                hidden[i], cache = self._layer(weights, hidden[i], cache, np.int32(layer), start, rope_length, flag)
        return self._head(self._params, hidden[-1], last, index, inputs), cache

    def _prefill(self, prompt: np.ndarray, cache: KVCache,
                 inputs: StepInputs) -> tuple[tuple[jax.Array, jax.Array], KVCache]:
        """The prompt into ``cache`` in blocks; the first new token and its logits."""
        blocks = prefill_blocks(prompt.size, self.prefill_block, cache.length)
        padded = np.zeros((1, blocks[-1].end), np.int32)
        padded[0, :prompt.size] = prompt  # the padding's keys land past the prompt: masked, then overwritten
        return self._call(padded, blocks, cache, prompt.size, prompt.size - 1 - blocks[-1].start, 0, inputs)

    def _empty_cache(self, length: int) -> KVCache:
        return KVCache.zeros(self._dims[0], 1, length, self._dims[1], self._dims[2], self._dtype)

    def _cache_length(self, prompt_length: int, max_new_tokens: int) -> int:
        return min(bucket_length(prompt_length + max_new_tokens - 1), self.max_length)

    def prompt_logits(self, prompt_ids, max_new_tokens: int = 1) -> np.ndarray:
        """float32 ``[V]``: the logits of the token after ``prompt_ids``, from the prefill that
        :meth:`generate` runs (in blocks of ``prefill_block``) over the cache it would make for
        ``max_new_tokens`` (so the two share compiled steps)."""
        prompt = check_prompt(prompt_ids, self.model_config)
        inputs = SamplingConfig(max_new_tokens=max_new_tokens).step_inputs(self.vocab_size)
        cache = self._empty_cache(self._cache_length(prompt.size, max_new_tokens))
        (_, logits), _ = self._prefill(prompt, cache, inputs)
        return np.asarray(logits[0])  # SYNC: the caller reads them

    # ------------------------------------------------------------------ the loop

    def generate(self, prompt_ids, settings: SamplingConfig = SamplingConfig(),
                 on_token: Optional[Callable[[int], None]] = None) -> Generation:
        """Continues ``prompt_ids`` (a sequence of ints) with up to ``settings.max_new_tokens``
        tokens; ``on_token(id)`` is called for each new token as soon as it is known (not for
        the stop id)."""
        prompt = check_prompt(prompt_ids, self.model_config)
        length = prompt.size
        cache_length = self._cache_length(length, settings.max_new_tokens)
        inputs = settings.step_inputs(self.vocab_size)
        stop = set(settings.stop_ids)
        began = time.perf_counter()
        (token, _), cache = self._prefill(prompt, self._empty_cache(cache_length), inputs)
        tokens: list[int] = []
        times: list[float] = []
        while True:
            new = int(token[0])  # SYNC: the host needs the token to stop, print and feed it back
            times.append(time.perf_counter() - began)
            if new in stop:
                reason = STOP_ID
                break
            tokens.append(new)
            if on_token is not None:
                on_token(new)
            position = length + len(tokens) - 1  # the cache index the new token goes to
            if len(tokens) == settings.max_new_tokens:
                reason = MAX_NEW_TOKENS
                break
            if position >= cache_length:
                reason = MAX_LENGTH
                break
            step = (Block(position, 1),)  # one token at cache index `position`; RoPE's length is position + 1
            (token, _), cache = self._call(token.reshape(1, 1), step, cache, position + 1, 0, len(tokens), inputs)
        return Generation(tokens, reason, length, time.perf_counter() - began, times)

    def close(self) -> None:
        """Stops the layer reads of a streamed generator and drops the weights."""
        if self._layers is not None:
            self._layers.close()
        self._params = {}

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
