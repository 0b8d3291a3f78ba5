"""How a step's gradients reach the SSD, chosen once from the plan (``StepPlan.gradients``):

* ``instant``: each layer's gradient (each block of a large token table, per use) leaves for the
  sink inside the backward pass (:func:`~jaxascend.offload.step.make_offload_step`); the forward
  reads the weights the plan's :class:`~jaxascend.offload.compute_weights.ComputeWeights` serve.
  With ``train.grad_accum: A`` each layer runs the step's ``A`` micro-batches in turn and sends
  their summed gradient once (:mod:`jaxascend.models.micro_batches`);
* ``post_backward``: the ZeRO-Infinity-style ablation, the whole tree and then a scan
  (:func:`~jaxascend.offload.post_backward_check.make_full_gradient_step`).

In a data-parallel run each of them runs under ``shard_map`` over this process's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.models import TokenBatch, as_token_batch, batch_loss, layer_stack_key, token_table_path
from jaxascend.offload.compute_weights import ComputeWeights
from jaxascend.offload.partition import DataParallel
from jaxascend.offload.post_backward_check import PostBackwardCheckedStep, make_full_gradient_step
from jaxascend.offload.state import OffloadedAdamState
from jaxascend.offload.state_layout import TableLayout
from jaxascend.offload.step import LeafRoutes, bit_dtypes_of, make_offload_eval, make_offload_step
from jaxascend.offload.step_plan import StepPlan


def leaf_routes(plan: StepPlan, params, model_cfg: ModelConfig, table: TableLayout) -> LeafRoutes:
    """Tensor ids of every leaf; with instant gradients each use of the token table (the lookup
    and, tied, the head) sends its gradient block by block and the sink sums the uses. Data
    parallel, a table not in blocks is sent whole once, its uses summed by the backward: its
    head use would otherwise be reduce-scattered beside the layers' (collective_order)."""
    uses = ()
    if plan.table_per_use and (table.large or plan.partition is None):
        uses = ("lookup",) + (("head",) if model_cfg.tie_word_embeddings else ())
    return LeafRoutes.for_params(params, layer_stack_key(model_cfg.arch), token_table_path(model_cfg.arch), uses,
                                  table.blocks, table_as_bits=table.large)


@dataclass
class GradientRouting:
    """The jitted forward/backward (``fwd_bwd(params, batch, loss_scale) -> (loss, statistics)``)
    and evaluation of a run, and how a step's batch becomes their input."""

    plan: StepPlan
    fwd_bwd: Any
    evaluate: Any
    data_parallel: Optional[DataParallel]

    @classmethod
    def build(cls, plan: StepPlan, graphdef: nnx.GraphDef, rest: nnx.State, routing: LeafRoutes,
              state: OffloadedAdamState, weights: ComputeWeights,
              data_parallel: Optional[DataParallel]) -> "GradientRouting":
        sink = state.gradient_sink(routing.arrivals())
        if jax.tree.leaves(state.tensor_ids()) != [r.tensor for r in routing.routes]:
            raise RuntimeError("offload: gradient-sink tensor ids disagree with the optimizer's leaf order")
        dp = data_parallel
        # A job's parameter source serves this process's slices, all-gathered in the step.
        whole_layers = weights.whole_layers() if plan.partitioned and weights.source is not None else None
        bits = bit_dtypes_of(routing, weights.bit_dtypes)  # a job's inputs held as raw bits
        if plan.gradients == "post_backward":  # ablation: full tree, then a scan
            fwd_bwd = PostBackwardCheckedStep(make_full_gradient_step(graphdef, rest, batch_loss), state)
        else:
            fwd_bwd = make_offload_step(graphdef, rest, routing, sink.handle, batch_loss, source=weights.source,
                                        data_parallel=dp, whole_layers=whole_layers, bit_dtypes=bits)
        evaluate = make_offload_eval(graphdef, rest, routing, source=weights.source, data_parallel=dp,
                                     whole_layers=whole_layers, bit_dtypes=bits)
        return cls(plan, fwd_bwd, evaluate, dp)

    def step_input(self, tokens) -> TokenBatch:
        """The batch a step's forward/backward takes: its ``A`` micro-batches ``[A, B, ...]``; in a
        data-parallel run, this process's rows of each."""
        batch = as_token_batch(tokens)
        if self.data_parallel is not None:  # the global batch: this process computes its rows
            batch = self.data_parallel.shard_rows(batch, axis=1)
        return batch

    def eval_input(self, batch: TokenBatch) -> TokenBatch:
        return self.data_parallel.shard_rows(batch) if self.data_parallel is not None else batch

    def run(self, params, batch: TokenBatch, loss_scale: float):
        return self.fwd_bwd(params, batch, jnp.float32(loss_scale))
