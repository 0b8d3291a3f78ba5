"""How a step's gradients reach the SSD, chosen once from the plan (``StepPlan.gradients``):

* ``instant``: each layer's gradient (each block of a large token table, per use) leaves for the
  sink inside the backward pass (:func:`~jaxascend.offload.step.make_offload_step`); the forward
  reads the weights the plan's :class:`~jaxascend.offload.compute_weights.ComputeWeights` serve.
  With ``train.grad_accum: A`` each layer runs the step's ``A`` micro-batches in turn and sends
  their summed gradient once (:mod:`jaxascend.models.micro_batches`);
* ``post_backward``: the ZeRO-Infinity-style ablation, the whole tree and then a scan
  (:func:`~jaxascend.offload.post_backward_check.make_full_gradient_step`).

Where the step runs (one device, or ``shard_map`` over this process's rows of a data-parallel
run) is the placement's (:mod:`~jaxascend.offload.placement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.models import TokenBatch, as_token_batch, batch_loss, layer_stack_key, token_table_path
from jaxascend.offload.compute_weights import ComputeWeights
from jaxascend.offload.placement import Placement
from jaxascend.offload.post_backward_check import PostBackwardCheckedStep, make_full_gradient_step
from jaxascend.offload.raw_bits import bit_dtypes_of
from jaxascend.offload.state import OffloadedAdamState
from jaxascend.offload.state_layout import TableLayout
from jaxascend.offload.step import LeafRoutes, make_offload_eval, make_offload_step
from jaxascend.offload.step_plan import StepPlan


def leaf_routes(plan: StepPlan, placement: Placement, params, model_cfg: ModelConfig,
                table: TableLayout) -> LeafRoutes:
    """Tensor ids of every leaf; with instant gradients each use of the token table (the lookup
    and, tied, the head) sends its gradient block by block and the sink sums the uses, as far as
    the placement lets them (over several devices, a table not in blocks is sent whole once,
    its uses summed by the backward: ``Placement.table_uses``)."""
    uses = ("lookup",) + (("head",) if model_cfg.tie_word_embeddings else ())
    uses = placement.table_uses(uses, table.large) if plan.table_per_use else ()
    return LeafRoutes.for_params(params, layer_stack_key(model_cfg.arch), token_table_path(model_cfg.arch), uses,
                                  table.blocks, table_as_bits=table.large)


@dataclass
class GradientRouting:
    """The jitted forward/backward (``fwd_bwd(params, batch, loss_scale) -> (loss, statistics)``)
    and evaluation of a run, and how a step's batch becomes their input."""

    plan: StepPlan
    fwd_bwd: Any
    evaluate: Any
    placement: Placement

    @classmethod
    def build(cls, plan: StepPlan, graphdef: nnx.GraphDef, rest: nnx.State, routing: LeafRoutes,
              state: OffloadedAdamState, weights: ComputeWeights, placement: Placement) -> "GradientRouting":
        sink = state.gradient_sink(routing.arrivals())
        if jax.tree.leaves(state.tensor_ids()) != [r.tensor for r in routing.routes]:
            raise RuntimeError("offload: gradient-sink tensor ids disagree with the optimizer's leaf order")
        bits = bit_dtypes_of(routing, weights.bit_dtypes)  # the inputs taken as raw bits
        if plan.gradients == "post_backward":  # ablation: full tree, then a scan
            fwd_bwd = PostBackwardCheckedStep(make_full_gradient_step(graphdef, rest, batch_loss), state)
        else:
            fwd_bwd = make_offload_step(graphdef, rest, routing, sink.handle, batch_loss, source=weights.source,
                                        placement=placement, bit_dtypes=bits)
        evaluate = make_offload_eval(graphdef, rest, routing, source=weights.source, placement=placement,
                                     bit_dtypes=bits)
        return cls(plan, fwd_bwd, evaluate, placement)

    def step_input(self, tokens) -> TokenBatch:
        """The batch a step's forward/backward takes: its ``A`` micro-batches ``[A, B, ...]``; in a
        data-parallel run, this process's rows of each (the job's global arrays)."""
        return self.placement.rows(as_token_batch(tokens), axis=1)

    def eval_input(self, batch: TokenBatch) -> TokenBatch:
        return self.placement.rows(batch)

    def run(self, params, batch: TokenBatch, loss_scale: float):
        return self.fwd_bwd(params, batch, jnp.float32(loss_scale))
