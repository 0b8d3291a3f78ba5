"""The offloaded engine: gradients leave during the backward pass, AdamW runs streamed from SSD.

What the rest of jaxascend (and its users) take from here:

* :class:`StepPlan` / :class:`JobShape` -- the step's strategy, resolved once from the config and
  the job: where the weights live, how gradients leave, overlap, data parallel; refusals and notes;
* :class:`PlannedOffloadEngine` -- the trainer's offloaded engine (an ``engine_contract.Engine``),
  built from the plan and :class:`EngineSettings` (typed: AdamW, the state's options, loss
  scaling, clip; it reads no config), composed from the plan: the compute weights
  (``compute_weights``), the gradient routing (``gradient_routing``), the update runner
  (``update_runner``) and the weight readers;
  :class:`OffloadEngine` -- the same engine built from a config (``OffloadEngine(cfg, model,
  model_cfg, plan)``: tests, benchmark scripts);
* :func:`load_model` -- the model as the plan needs it (the layer stack left out when it streams)
  and the reader its master weights start from: the trainer asks, the plan decides;
* :func:`job_state_layout` / :func:`state_arena_plan` / :func:`overlap_refusal` -- the layout, the
  arena plan and the overlap refusal the engine will have, from shapes alone, for the run planner
  (:mod:`jaxascend.planning`) to size a run before any engine exists;
* :class:`OffloadedAdamState` / :class:`OffloadLayout` / :data:`STATE_SLOT_CLASS` -- the SSD layout
  of fp32 master/m/v and the per-layer gradient regions, init, the streamed fused step;
  :func:`specs_for_offload_layout` -- that state's regions as :mod:`jaxascend.checkpoint` arrays;
* :func:`ssd_adamw` -- AdamW on SSD as an optax ``GradientTransformation``;
* :func:`offload_on_backward` / :func:`sink_gradient` / :func:`fetch_layer` -- the instant
  gradient offload inside a backward pass and the parameter source's fetch inside a layer scan;
* :func:`write_timeline_png` -- one step's timeline (which thread did what, when) as a picture;
* :class:`StepJournal` / :data:`JOURNAL_NAME` / :func:`durable_disk_bytes` -- durable steps: the
  journal that names the step the offload files hold, and the disk the spare records take.

Everything else (the sinks, the parameter source, the overlapped update, the partitions of a
job, the ablation paths) is the engine's own, in the modules named in docs/architecture.md.

Imports :mod:`jaxascend.config`, :mod:`jaxascend.models`, :mod:`jaxascend.hf` (parameter names),
:mod:`jaxascend.ssd`, :mod:`jaxascend.optim`, :mod:`jaxascend.checkpoint` and
:mod:`jaxascend.engine_contract`.
"""

from jaxascend.offload.checkpoint_specs import specs_for_offload_layout
from jaxascend.offload.engine import PlannedOffloadEngine
from jaxascend.offload.engine_settings import EngineSettings
from jaxascend.offload.from_config import OffloadEngine
from jaxascend.offload.step_plan import JobShape, StepPlan, overlap_refusal, streaming_refusal
from jaxascend.offload.grad_sink import offload_on_backward
from jaxascend.offload.layout import OffloadLayout, STATE_SLOT_CLASS
from jaxascend.offload.model_loading import load_model
from jaxascend.offload.native_path import fetch_layer, sink_gradient
from jaxascend.offload.ssd_adamw import ssd_adamw
from jaxascend.offload.state import OffloadedAdamState
from jaxascend.offload.state_layout import job_state_layout, state_arena_plan
from jaxascend.offload.timeline import write_timeline_png
from jaxascend.offload.slot_rings import durable_disk_bytes
from jaxascend.offload.step_journal import JOURNAL_NAME, StepJournal, read_journal

__all__ = [
    "EngineSettings", "JOURNAL_NAME", "JobShape", "OffloadEngine", "PlannedOffloadEngine", "OffloadLayout", "OffloadedAdamState", "STATE_SLOT_CLASS", "StepPlan",
    "fetch_layer", "job_state_layout", "load_model", "offload_on_backward", "overlap_refusal", "sink_gradient",
    "specs_for_offload_layout", "ssd_adamw", "state_arena_plan", "StepJournal", "read_journal", "streaming_refusal",
    "durable_disk_bytes", "write_timeline_png",
]
