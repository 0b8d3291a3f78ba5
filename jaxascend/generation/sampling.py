"""Choosing the next token: greedy, temperature, nucleus (top-p), and the settings of one generation.

    settings = SamplingConfig(max_new_tokens=64, temperature=0.8, top_p=0.95, seed=1, stop_ids=(2,))
    token = sample_logits(logits, jax.random.key(1), jnp.float32(0.8), jnp.float32(0.95))

Everything here runs inside the jitted decoding step, the settings as traced scalars: changing
them (greedy included, temperature 0) does not recompile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class SamplingConfig:
    """How one generation chooses and stops.

    ``temperature`` 0 is greedy (argmax); otherwise the logits are divided by it and a token is
    drawn from the smallest set of most likely tokens whose probability reaches ``top_p``
    (1: all of them). The ``seed`` fixes the draws: token ``i`` uses ``fold_in(key(seed), i)``.
    Generation stops after ``max_new_tokens``, or at any of ``stop_ids`` (not part of the output).
    ``vocab_limit``: only ids below it are ever chosen (the tokenizer's size, when the embedding
    has more rows than the tokenizer has tokens); None: the whole vocabulary.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    vocab_limit: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature: must be a number >= 0 (0: greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 32:
            # jax.random.key keeps 32 bits of a seed: larger ones would alias smaller ones
            raise ValueError(f"seed: must be an integer in [0, 2**32), got {self.seed!r}")
        if self.vocab_limit is not None and self.vocab_limit < 1:
            raise ValueError(f"vocab_limit: must be >= 1, got {self.vocab_limit!r}")
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))

    def step_inputs(self, vocab_size: int) -> "StepInputs":
        """The traced scalars the jitted step reads."""
        return StepInputs(jax.random.key(self.seed), jnp.float32(self.temperature), jnp.float32(self.top_p),
                          jnp.int32(min(self.vocab_limit or vocab_size, vocab_size)))


@dataclass(frozen=True)
class StepInputs:
    """The sampling settings as device scalars, passed to every jitted step."""

    key: jax.Array  # the generation's base key; token i draws with fold_in(key, i)
    temperature: jax.Array  # float32; 0: greedy
    top_p: jax.Array  # float32
    vocab_limit: jax.Array  # int32: ids >= it are never chosen


jax.tree_util.register_dataclass(StepInputs, data_fields=["key", "temperature", "top_p", "vocab_limit"],
                                 meta_fields=[])


def top_p_filter(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """``logits [..., V]`` with every token outside the nucleus set to -inf: the nucleus is the
    most likely tokens, in order, until their probability reaches ``top_p`` (the most likely
    token always stays; tokens tied with the last one kept stay too)."""
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
    kept = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1
    threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample_logits(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  vocab_limit: Optional[jax.Array] = None) -> jax.Array:
    """int32 ``[...]``: the next token for each row of float32 ``logits [..., V]``: the argmax
    where ``temperature`` is 0, else a draw from ``softmax(top_p_filter(logits / temperature))``.
    Ids ``>= vocab_limit`` are never chosen."""
    logits = logits.astype(jnp.float32)
    if vocab_limit is not None:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    greedy = temperature == 0
    filtered = top_p_filter(logits / jnp.where(greedy, 1.0, temperature), top_p)
    drawn = jax.random.categorical(key, filtered, axis=-1)
    return jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)


def sample_step(logits: jax.Array, inputs: StepInputs, index: jax.Array) -> jax.Array:
    """The ``index``-th new token of a generation from ``logits [B, V]`` (see :func:`sample_logits`)."""
    key = jax.random.fold_in(inputs.key, index)
    return sample_logits(logits, key, inputs.temperature, inputs.top_p, inputs.vocab_limit)


def bucket_length(n: int, minimum: int = 16) -> int:
    """``n`` rounded up to a power of two (at least ``minimum``), then to a multiple of 1024 past
    1024: the cache and prefill lengths the jitted steps are compiled for, so that prompts of
    similar length share a compilation."""
    if n <= 1024:
        size = minimum
        while size < n:
            size *= 2
        return size
    return -(-n // 1024) * 1024
