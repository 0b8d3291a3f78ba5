"""What the decoder-only LMs (GPT-2, the Llama family, Gemma 3) share around their layer stack: the
token embedding that starts it, the final norm and output head that end it, and the forward
between them.

A model class mixes in :class:`CausalLM` after ``nnx.Module`` and names its parts by attribute, as
:class:`~jaxascend.models.decoding.CachedDecoding` names the stack: ``TOKEN_TABLE`` (the token
table's path, an ``L.Embed``, also the head when tied), ``FINAL_NORM`` (the norm before the head)
and ``LAYER_STACK``; its ``__init__`` sets ``lm_head`` (None when tied), ``remat`` and ``dtype``.
The mixin holds no parameters, so the parameter paths stay each model's own.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxascend.models import layers as L
from jaxascend.models.decoding import CachedDecoding


class CausalLM(CachedDecoding):
    """The embedding, head and forward of a causal LM: ``model(input_ids [B,T], positions [B,T] |
    None, layer_hook, table_hook, segment_ids [B,T] | None) -> float32 [B,T,V]``.

    Class data a model may set: ``embed_scale`` (Gemma 3's ``sqrt(hidden_size)``, the embedding's
    multiplier) and ``final_logit_softcapping`` (Gemma 3's ``tanh(logits / cap) * cap``)."""

    FINAL_NORM = "norm"  # the attribute of the norm before the head
    embed_scale: Optional[float] = None
    final_logit_softcapping: Optional[float] = None

    def token_table(self) -> L.Embed:
        """The token embedding table (``TOKEN_TABLE``), also the head when tied."""
        return getattr(self, self.TOKEN_TABLE[0])

    def embed(self, input_ids: jax.Array, table_hook: Optional[L.TableHook] = None) -> jax.Array:
        """The token embedding in the compute dtype, times ``embed_scale`` when set: the scalar
        rounded to the compute dtype first, as HF rounds it to the weight dtype (bf16 34.0 for
        Gemma 3 1B's ``sqrt(1152)``, not 33.94)."""
        tokens = self.token_table()(input_ids, table_hook)
        if self.embed_scale is None:
            return tokens
        return tokens * jnp.asarray(self.embed_scale, self.dtype)

    def embed_inputs(self, input_ids: jax.Array, positions: jax.Array,
                     table_hook: Optional[L.TableHook] = None) -> jax.Array:
        """The first layer's input ``[B, T, D]``: the token embedding (positions enter through
        RoPE, not here; GPT-2 adds its position table)."""
        del positions
        return self.embed(input_ids, table_hook)

    def head_input(self, hidden: jax.Array) -> jax.Array:
        """What the output head multiplies: the last layer's output after the final norm."""
        return getattr(self, self.FINAL_NORM)(hidden)

    def output_head(self, table_hook: Optional[L.TableHook] = None):
        """The head's weights as the blocked loss reads them (``L.head_weights``), with the final
        logit softcapping."""
        return L.head_weights(self.token_table(), self.lm_head, table_hook, self.final_logit_softcapping)

    def logits(self, hidden: jax.Array, table_hook: Optional[L.TableHook] = None) -> jax.Array:
        """float32 logits ``[B, T, V]`` of the last layer's output: final norm, head, then the
        final logit softcapping when set."""
        logits = L.lm_logits(self.head_input(hidden), self.token_table(), self.lm_head, table_hook)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = jnp.tanh(logits / cap) * cap
        return logits

    def hidden_states(self, input_ids: jax.Array, positions: Optional[jax.Array] = None,
                      layer_hook: Optional[L.LayerHook] = None, table_hook: Optional[L.TableHook] = None,
                      segment_ids: Optional[jax.Array] = None, micro_batches: int = 1) -> jax.Array:
        """The last layer's output ``[B, T, D]`` (before the final norm); arguments as ``__call__``; ``micro_batches``:
        the rows are that many micro-batches, each layer runs them in turn (``L.scan_layers``)."""
        positions = L.default_positions(input_ids, positions)
        L.check_segment_ids(input_ids, segment_ids)
        hidden = self.embed_inputs(input_ids, positions, table_hook)
        return L.scan_layers(getattr(self, self.LAYER_STACK), hidden, positions, self.remat, layer_hook,
                             self.layer_flags, segment_ids=segment_ids, micro_batches=micro_batches)

    def __call__(self, input_ids: jax.Array, positions: Optional[jax.Array] = None,
                 layer_hook: Optional[L.LayerHook] = None, table_hook: Optional[L.TableHook] = None,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        return self.logits(self.hidden_states(input_ids, positions, layer_hook, table_hook, segment_ids), table_hook)
