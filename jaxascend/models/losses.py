"""Training losses."""

import jax
import jax.numpy as jnp
import optax


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from logits over ``tokens[:, :-1]``."""
    labels = tokens[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()
