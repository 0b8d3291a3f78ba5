"""The offloaded engine: gradients leave during the backward pass, AdamW runs streamed from SSD.

* :class:`OffloadEngine` -- the trainer's offloaded engine: instant gradient offload, on-the-fly
  overflow check and global norm, loss scaling, clipping in the kernel, the streamed AdamW step,
  and the ablation paths (``offload.*`` switches);
* :class:`OffloadedAdamState` / :class:`OffloadLayout` -- the SSD layout of fp32 master/m/v and
  the per-layer gradient regions, init, the streamed fused step;
  :func:`specs_for_offload_layout` -- that state's regions as :mod:`jaxascend.checkpoint` arrays;
* :func:`offload_on_backward` / :func:`make_offload_step` -- the forward/backward step whose
  gradients go to a sink (:func:`register_store_sink`, :class:`MemorySink`) layer by layer;
* :func:`ssd_adamw` -- AdamW on SSD as an optax ``GradientTransformation``;
  :func:`ssd_adamw_step` -- the trainer's fast path without an update tree;
* :func:`make_full_gradient_step` -- the ZeRO-Infinity-style post-backward overflow check (ablation);
* :class:`ParamSource` / :func:`fetch_layer` -- ``offload.params: ssd``: the layer scan's weights
  read from SSD layer by layer, ahead of the ask;
* :class:`BackgroundUpdate` -- ``offload.overlap``: the optimizer of step t on a thread beside
  step t+1's forward/backward; :class:`StepTimeline` -- which thread did what, when;
* :class:`Partition` / :class:`DataParallel` / :class:`JobReads` -- a data-parallel job: each
  process's slice of every tensor, the collectives outside the step, process 0's whole-tensor reads;
* :func:`plan_run` / :func:`resolve` / :class:`RunPlan` -- the run planner (host memory by part,
  SSD footprint and traffic, the step-time floor; ``offload.params: auto``).

Imports :mod:`jaxascend.config`, :mod:`jaxascend.models`, :mod:`jaxascend.hf` (parameter names),
:mod:`jaxascend.ssd`, :mod:`jaxascend.optim` and :mod:`jaxascend.checkpoint`.
"""

from jaxascend.offload.checkpoint_specs import specs_for_offload_layout
from jaxascend.offload.engine import OffloadEngine
from jaxascend.offload.step_plan import JobShape, StepPlan
from jaxascend.offload.grad_sink import (GradientScatter, GradientSinkError, MemorySink, fetch_step_outputs,
                                         offload_on_backward, register_memory_sink, sink_gradient, unregister_sink)
from jaxascend.offload.layout import (GRAD_SLOT_CLASS, PARAM_SLOT_CLASS, SOURCE_SLOT_CLASS, STATE_SLOT_CLASS,
                                     OffloadLayout)
from jaxascend.offload.overlap import BackgroundUpdate
from jaxascend.offload.partition import DataParallel, JobReads, Partition
from jaxascend.offload.param_source import ParamSource, ParamSourceError, fetch_layer
from jaxascend.offload.planner import PlanError, RunPlan, deepspeed_zero3_estimate, plan_run, resolve
from jaxascend.offload.post_backward_check import (PostBackwardCheckedStep, make_full_gradient_step,
                                                   post_backward_stats)
from jaxascend.offload.ssd_adamw import SsdAdamWState, adamw_on_ssd, ssd_adamw, ssd_adamw_state, ssd_adamw_step
from jaxascend.offload.state import OffloadedAdamState
from jaxascend.offload.streamed_update import StepStats
from jaxascend.offload.step import (SinkRouting, make_accumulating_offload_step, make_offload_step,
                                    stacked_as_bits, total_stats)
from jaxascend.offload.store_sink import SinkTarget, StoreGradientSink, register_store_sink
from jaxascend.offload.timeline import StepTimeline, write_timeline_png

__all__ = [
    "BackgroundUpdate", "DataParallel", "JobReads", "JobShape", "StepPlan", "write_timeline_png", "Partition", "StepTimeline", "GRAD_SLOT_CLASS", "PARAM_SLOT_CLASS", "SOURCE_SLOT_CLASS", "STATE_SLOT_CLASS", "GradientSinkError",
    "GradientScatter", "MemorySink", "OffloadEngine", "OffloadLayout", "OffloadedAdamState", "ParamSource", "ParamSourceError",
    "PlanError", "PostBackwardCheckedStep", "RunPlan", "SinkRouting", "SinkTarget", "SsdAdamWState", "StepStats",
    "StoreGradientSink", "adamw_on_ssd", "deepspeed_zero3_estimate", "fetch_layer", "fetch_step_outputs",
    "make_accumulating_offload_step", "make_full_gradient_step", "make_offload_step", "offload_on_backward",
    "plan_run", "post_backward_stats", "register_memory_sink", "register_store_sink", "resolve", "sink_gradient",
    "specs_for_offload_layout", "ssd_adamw", "ssd_adamw_state", "ssd_adamw_step", "stacked_as_bits", "total_stats",
    "unregister_sink",
]
