"""What one step's forward/backward holds in memory, by sequence length and remat policy.

    memory = step_memory(cfg, model_cfg, layout)
    memory.activations      # what the backward keeps for every layer (remat: the layer inputs)
    memory.working          # the largest working set on top of it, and memory.phase, which one

The step is one jitted function, so what it holds is XLA's buffer assignment: the arrays the
backward keeps (``saved``, per layer), plus the largest of three working sets, each the arrays
live together at one point of the backward (``jax.checkpoint`` recomputes a layer there):

* ``attention``: one layer's attention in the backward. The scores ``[B, K, G, T, S]`` are
  float32 as ``models.layers.causal_attention`` computes them (dense, the causal mask applied
  with ``where``), and so are their softmax, its gradient and the scores' gradient: about 22 B
  per score with the copy the executed step adds (:data:`EXECUTED_SCORES`),
  ``B * num_attention_heads * T**2`` of them, so this phase grows with T squared. With blockwise
  attention (``model.attention``) the same per score of one block of queries against one block
  of keys (``models.scores_held``), whatever T, and the backward keeps no scores;
* ``mlp``: one layer's MLP in the backward, ``[B, T, intermediate]`` arrays;
* ``head``: the float32 logits ``[B, T, V]`` and their gradient, with the output head's weights
  widened and their gradient when the head is differentiated whole (a large tied table is done
  in blocks of rows, see models.vocab). With the blocked loss (``model.loss``,
  models.blocked_loss) no logits are whole: the head's input, its float32 copy and gradient
  (:data:`HEAD_BLOCKED`, per token x hidden) plus one chunk of logits and one block of weights
  whatever T (:func:`blocked_head_bytes`).

Each term is bytes per element of a count (tokens x hidden, tokens x intermediate, attention
scores, tokens x vocabulary, weights of one layer or of the head). XLA's CPU backend computes in
float32 what it cannot do in bfloat16 and keeps float32 copies, so most terms are float32
arrays, often two or three of one shape. The coefficients were fitted to the compiled offloaded
step's ``memory_analysis().temp_size_in_bytes`` over 33 Llama-family shapes for ``full`` (hidden
256-3584, 2-28 layers, vocabulary 259-152064, tied and untied heads, B x T from 2 x 128 to
4 x 2048; within 7% of XLA on each) and 25 for ``none`` (within 5%, but 13% under at Qwen2.5-0.5B
seq 1024), and 8 each for the other policies (within 5%; ``offload``, whose saved arrays go to
the pinned host memory kind, within 15%); the whole plan is then checked against measured peaks
(``scripts/bench_plan.py``, docs/bench_plan.md). On a GPU backend the saved arrays keep the
compute dtype, so these figures are an upper bound there.

``train.grad_accum: A`` runs the step's ``A`` micro-batches vertically (models.micro_batches):
what the backward keeps and the head phase count the step's ``A * B`` rows, a layer's phases one
micro-batch of ``B`` rows, plus that layer's weights widened to float32 and their float32
gradient sum (:data:`MICRO_BATCH_WEIGHT_BYTES`). No whole-model accumulator exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxascend.config import Config, ModelConfig
from jaxascend.models import LOSS_CHUNK_ELEMENTS, chosen_loss, scores_held, table_blocks
from jaxascend.offload import OffloadLayout

# A layer running A > 1 micro-batches: its weights widened to float32 (4 B) and the float32 sum of
# their gradient over the micro-batches (4 B), per parameter of one layer.
MICRO_BATCH_WEIGHT_BYTES = 8


@dataclass(frozen=True)
class Counts:
    """The element counts the terms multiply, for some rows of one process (a micro-batch, or
    the step's micro-batches together)."""

    hidden: int = 0  # tokens x hidden_size
    mlp: int = 0  # tokens x intermediate_size
    scores: int = 0  # attention scores of one layer: B x num_attention_heads x T x T
    vocab: int = 0  # tokens x vocabulary: the logits
    weights: int = 0  # parameters of one layer (attention, mlp phases) or of the whole head (head phase)


@dataclass(frozen=True)
class Terms:
    """Bytes per element of each count."""

    hidden: float = 0.0
    mlp: float = 0.0
    scores: float = 0.0
    vocab: float = 0.0
    weights: float = 0.0

    def bytes(self, n: Counts) -> int:
        return int(self.hidden * n.hidden + self.mlp * n.mlp + self.scores * n.scores + self.vocab * n.vocab
                   + self.weights * n.weights)


@dataclass(frozen=True)
class RematTerms:
    """One remat policy: what each layer keeps for the backward and the two layer phases."""

    saved: Terms  # per layer
    attention: Terms
    mlp: Terms


# Executing the step holds one more float32 scores array than XLA's buffer assignment counts
# (measured: the step's RSS high-water mark less its temp size grows by 4.2 B per score, from
# 2M to 134M scores, remat none and full alike).
EXECUTED_SCORES = 4.2
# The float32 logits and their gradient, the final hidden states around them, and a head
# differentiated whole (its weights widened, their float32 gradient): the same for every policy.
HEAD = Terms(hidden=29.1, vocab=8.1, weights=7.9)
# The blocked loss: the head's input (compute dtype), its float32 copy and gradient, the final
# norm's backward, and the per-token statistics of every vocabulary block (XLA's temp bytes of
# the head's forward/backward at Qwen2.5-0.5B's 151936 x 896 table grow 12.3 B per token x hidden
# from 4096 to 16384 tokens); a separate head's kernel gradient is whole in the compute dtype.
HEAD_BLOCKED = Terms(hidden=12.3, weights=2.0)
# One chunk's float32 logits and what the backward derives from them (exp, gradient, mask) ...
CHUNK_ARRAYS = 4
# ... and one block of weights widened to float32, its float32 gradient and its rounded copy.
BLOCK_WEIGHT_BYTES = 4 + 4 + 2


def blocked_head_bytes(model_cfg: ModelConfig, head: Counts) -> int:
    """The blocked loss's head phase: :data:`HEAD_BLOCKED` of ``head``'s counts, one chunk of
    logits and one block of the head's weights (models.blocked_loss)."""
    rows = model_cfg.vocab_size // table_blocks(model_cfg.vocab_size, model_cfg.hidden_size)
    block = BLOCK_WEIGHT_BYTES * rows * model_cfg.hidden_size
    untied = 0 if model_cfg.tie_word_embeddings else head.weights
    return HEAD_BLOCKED.bytes(dataclasses.replace(head, vocab=0, weights=untied)) + CHUNK_ARRAYS * 4 * LOSS_CHUNK_ELEMENTS + block
_FULL_ATTENTION = Terms(hidden=55.0, scores=17.4 + EXECUTED_SCORES, weights=3.5)
_FULL_MLP = Terms(hidden=66.8, mlp=29.5, weights=3.5)
REMAT = {
    # the layer input (float32 on the CPU backend); the layer is recomputed in the backward
    "full": RematTerms(Terms(hidden=3.9), _FULL_ATTENTION, _FULL_MLP),
    # every intermediate, the scores' softmax among them (float32 and compute dtype)
    "none": RematTerms(Terms(hidden=24.0, mlp=30.9, scores=8.8),
                       Terms(hidden=55.7, scores=8.0 + EXECUTED_SCORES, weights=19.5),
                       Terms(hidden=6.8, mlp=5.2, weights=19.5)),
    # every matmul's output, the scores among them (a batched matmul)
    "dots": RematTerms(Terms(hidden=43.9, scores=3.3), _FULL_ATTENTION, _FULL_MLP),
    # the projections' outputs only
    "dots_no_batch": RematTerms(Terms(hidden=32.3, scores=0.2), _FULL_ATTENTION, _FULL_MLP),
    # the named projections, moved to the pinned host memory kind
    "offload": RematTerms(Terms(mlp=10.7), _FULL_ATTENTION, _FULL_MLP),
}


@dataclass(frozen=True)
class StepMemory:
    """Bytes one forward/backward holds at its peak, by part."""

    activations: int  # what the backward keeps, all layers
    working: int  # the largest working set on top of it
    phase: str  # which: "attention", "mlp" or "head"


def step_counts(cfg: Config, model_cfg: ModelConfig, layout: OffloadLayout,
                rows: int | None = None) -> tuple[Counts, Counts]:
    """(the counts of one layer, the counts of the head phase) of ``rows`` rows of ``cfg``'s
    length (None: one micro-batch, ``data.batch_size``)."""
    rows = cfg.data.batch_size if rows is None else rows
    tokens = rows * cfg.data.seq_len
    heads = model_cfg.num_attention_heads
    layer_weights = sum(leaf.layer_elements for leaf in layout.leaves if leaf.stacked)
    # the largest table differentiated whole (a large tied table is computed in blocks of rows)
    whole = max((leaf.size for leaf in layout.leaves
                 if not leaf.stacked and len(leaf.shape) == 2 and leaf.row_blocks == 1), default=0)
    layer = Counts(hidden=tokens * model_cfg.hidden_size, mlp=tokens * model_cfg.intermediate_size,
                   scores=rows * heads * scores_held(model_cfg.attention, cfg.data.seq_len),
                   weights=layer_weights)
    head = Counts(hidden=layer.hidden, vocab=tokens * model_cfg.vocab_size, weights=whole)
    return layer, head


def step_memory(cfg: Config, model_cfg: ModelConfig, layout: OffloadLayout) -> StepMemory:
    """The activations and the peak working set of one step of ``cfg`` (see the module's doc)."""
    terms = REMAT[model_cfg.remat]
    micro_batches = cfg.train.grad_accum
    rows = micro_batches * cfg.data.batch_size  # the step's rows, all micro-batches
    layer, _ = step_counts(cfg, model_cfg, layout)
    step_layer, head = step_counts(cfg, model_cfg, layout, rows)
    blocked = chosen_loss(model_cfg.loss, rows, cfg.data.seq_len, model_cfg.vocab_size) == "blocked"
    head_bytes = blocked_head_bytes(model_cfg, head) if blocked else HEAD.bytes(head)
    widened = MICRO_BATCH_WEIGHT_BYTES * layer.weights if micro_batches > 1 else 0
    phases = {"attention": terms.attention.bytes(layer) + widened, "mlp": terms.mlp.bytes(layer) + widened,
              "head": head_bytes}
    phase = max(phases, key=phases.get)
    # Blockwise attention keeps no scores for the backward (it recomputes them from q, k, v).
    dense = scores_held(model_cfg.attention, cfg.data.seq_len) == cfg.data.seq_len ** 2
    saved = step_layer if dense else dataclasses.replace(step_layer, scores=0)
    return StepMemory(model_cfg.num_hidden_layers * terms.saved.bytes(saved), phases[phase], phase)
