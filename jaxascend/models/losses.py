"""Training losses: the next-token cross-entropy, over every token or a weighted (masked) subset.

    batch = token_batch(tokens, loss_mask, segment_ids, positions)   # [A, B, ...]: one optimizer step
    loss = batch_loss(model, batch)          # the step's loss: A micro-batches, each layer runs them in turn

The loss of one optimizer step is the **per-token** mean over the tokens that count, across all
its micro-batches: every counted target weighs ``1 / (counted targets in the step)``, and each
micro-batch contributes the weighted *sum* over its own targets. So gradient accumulation is
exact: the sum over ``A`` micro-batches of ``B`` rows is the loss of one batch of ``A * B`` rows,
whatever the number of counted tokens in each (a per-batch mean would give a micro-batch with
few assistant tokens as much weight as one with many). A step's batch ``[A, B, ...]`` runs as
that one batch, vertically (:mod:`~jaxascend.models.micro_batches`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxascend.models.blocked_loss import blocked_token_losses, chosen_loss
from jaxascend.models.micro_batches import step_rows


class TokenBatch(NamedTuple):
    """What the forward pass and the loss read, for one micro-batch ``[B, ...]`` or a step of
    ``A`` of them ``[A, B, ...]``. ``segment_ids`` / ``positions`` are None for plain rows (one
    sequence per row, positions 0..T-1)."""

    tokens: jax.Array  # int32 [..., B, T+1]: inputs tokens[..., :-1], targets tokens[..., 1:]
    weights: jax.Array  # float32 [..., B, T]: each target's weight in the step's loss (0: not counted)
    segment_ids: Optional[jax.Array] = None  # int32 [..., B, T]: the example of each input token
    positions: Optional[jax.Array] = None  # int32 [..., B, T]: position of each input in its example


def token_batch(tokens, loss_mask=None, segment_ids=None, positions=None) -> TokenBatch:
    """A step's :class:`TokenBatch` (numpy, on the host) with per-token weights: each counted
    target of all the step's micro-batches weighs ``1 / count`` (``loss_mask`` None: every target
    counts). A step with no counted target gets all-zero weights (loss 0, no gradient)."""
    tokens = np.asarray(tokens, np.int32)
    shape = tokens.shape[:-1] + (tokens.shape[-1] - 1,)
    mask = np.ones(shape, bool) if loss_mask is None else np.asarray(loss_mask, bool)
    if mask.shape != shape:
        raise ValueError(f"loss_mask: expected shape {list(shape)} (the targets of tokens "
                         f"{list(tokens.shape)}), got {list(mask.shape)}")
    for name, value in (("segment_ids", segment_ids), ("positions", positions)):
        if value is not None and np.shape(value) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(np.shape(value))}")
    count = int(mask.sum())
    weights = mask.astype(np.float32) / np.float32(max(count, 1))
    as_int = lambda x: None if x is None else np.asarray(x, np.int32)  # noqa: E731
    return TokenBatch(tokens, weights, as_int(segment_ids), as_int(positions))


def as_token_batch(batch) -> TokenBatch:
    """``batch`` itself, or a step's plain token rows ``int32 [A, B, T+1]`` (every target counts)."""
    return batch if isinstance(batch, TokenBatch) else token_batch(batch)


def token_losses(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """float32 ``[B, T]`` cross-entropy of each target ``tokens[:, 1:]`` given ``logits [B, T, V]``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:])


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from logits over ``tokens[:, :-1]``."""
    return token_losses(logits, tokens).mean()


def forward(model, batch: TokenBatch, layer_hook=None, table_hook=None) -> jax.Array:
    """float32 logits ``[B, T, V]`` of one micro-batch (hooks: see the models' ``__call__``)."""
    return model(batch.tokens[:, :-1], batch.positions, layer_hook=layer_hook, table_hook=table_hook,
                 segment_ids=batch.segment_ids)


def target_losses(model, batch: TokenBatch, layer_hook=None, table_hook=None) -> jax.Array:
    """float32 ``[B, T]`` cross-entropy of each target of one micro-batch (``[A, B, T]`` of a
    step's ``A`` micro-batches, run as one batch whose layers take them in turn:
    :mod:`~jaxascend.models.micro_batches`), through the whole logits or, by ``model.loss``
    (:func:`models.blocked_loss.chosen_loss`), in blocks of tokens and vocabulary that never hold
    them (hooks: see the models' ``__call__``)."""
    micro_batches = batch.tokens.shape[0] if batch.tokens.ndim == 3 else 1
    if batch.tokens.ndim == 3:
        batch = TokenBatch(*(step_rows(x) for x in batch))
    inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]
    hidden = model.hidden_states(inputs, batch.positions, layer_hook, table_hook, batch.segment_ids,
                                 micro_batches=micro_batches)
    head = model.output_head(table_hook)
    if chosen_loss(model.loss, targets.shape[0], targets.shape[1], head.vocab_size) == "blocked":
        losses = blocked_token_losses(model.head_input(hidden), head, targets)
    else:
        losses = token_losses(model.logits(hidden, table_hook), batch.tokens)
    return losses.reshape((micro_batches, -1) + losses.shape[1:]) if micro_batches > 1 else losses


def batch_loss(model, batch: TokenBatch, layer_hook=None, table_hook=None) -> jax.Array:
    """The weighted sum of the target losses of one micro-batch (its share of the step's loss)
    or of a step's micro-batches ``[A, B, ...]`` (the step's loss)."""
    return jnp.sum(target_losses(model, batch, layer_hook, table_hook) * batch.weights)


def loss_sum_and_count(model, batch: TokenBatch, layer_hook=None, table_hook=None) -> tuple[jax.Array, jax.Array]:
    """``(sum of the counted targets' losses, their number)`` of one micro-batch, where a target
    counts iff its weight is non-zero: what an evaluation adds up over many batches."""
    counted = batch.weights > 0
    losses = target_losses(model, batch, layer_hook, table_hook)
    return jnp.sum(jnp.where(counted, losses, 0.0)), jnp.sum(counted.astype(jnp.int32))
