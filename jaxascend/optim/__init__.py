"""Optimizer arithmetic: optax AdamW, schedules, loss scaling and the fused host kernels.

* :func:`adamw_in_memory` -- the in-memory baseline (``clip_by_global_norm`` + ``optax.adamw``);
* :func:`decay_mask` / :func:`leaf_decay` / :func:`check_decay_rule` -- which parameters weight
  decay applies to (``optimizer.weight_decay_mask``), by parameter path (:func:`param_path`);
* :func:`learning_rate_schedule` -- warmup, then constant, cosine or linear decay;
* :class:`AdamWSettings` / :class:`AdamHyperParams` -- AdamW's hyperparameters for the fused kernel;
* :func:`fused_adamw_update` (FFI target) / :func:`fused_adamw_update_numpy` (in place) -- the
  fused AdamW kernel (scalar, AVX2 and AVX-512 variants, chosen at run time);
* :class:`StateFormat` / :data:`~jaxascend.optim.state_codes.STATE_DTYPES` -- how the moments are stored (``optimizer.state_dtype``:
  float32, bfloat16, block-wise int8 codes; :mod:`~jaxascend.optim.state_codes` has their numpy reference);
  :class:`StateRecord` -- where master, m, v (and int8's scales) sit in one chunk's record;
* :class:`MasterFormat` -- how the master weights are stored: float32, or bfloat16 compensated (Kahan
  companion) or stochastically rounded (:mod:`~jaxascend.optim.master_codes` has their numpy reference);
* :func:`grad_stats` / :func:`tree_grad_stats` -- fused overflow check + sum of squares;
* :class:`LossScaleState` / :class:`LossScaling` -- dynamic loss scaling for fp16 (its state, its settings).

No disk, no arena: the SSD-resident AdamW that runs these kernels is :mod:`jaxascend.offload`.
"""

from jaxascend.optim.adamw import AdamWSettings, adamw_in_memory
from jaxascend.optim.decay_mask import check_decay_rule, decay_mask, leaf_decay, param_path
from jaxascend.optim.fused_adam import (AdamHyperParams, adamw_reference, default_isa, fused_adamw_update,
                                        fused_adamw_update_numpy)
from jaxascend.optim.grad_stats import grad_stats, tree_grad_stats
from jaxascend.optim.loss_scale import LossScaleState, LossScaling
from jaxascend.optim import master_codes  # the numpy reference of the master's formats, as a namespace
from jaxascend.optim.master_codes import MasterFormat
from jaxascend.optim.schedules import learning_rate_schedule, unfinished_warmup_note
from jaxascend.optim import state_codes  # the numpy reference of the moments' formats, as a namespace
from jaxascend.optim.state_codes import StateFormat, StateRecord, chunk_seed

__all__ = [
    "AdamHyperParams", "AdamWSettings", "LossScaleState", "LossScaling", "MasterFormat", "StateFormat", "StateRecord", "adamw_in_memory",
    "adamw_reference", "check_decay_rule", "chunk_seed", "decay_mask", "default_isa", "fused_adamw_update", "fused_adamw_update_numpy", "grad_stats",
    "leaf_decay", "learning_rate_schedule", "master_codes", "param_path", "state_codes", "tree_grad_stats", "unfinished_warmup_note",
]
