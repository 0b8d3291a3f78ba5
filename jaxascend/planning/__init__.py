"""The run planner: what a run needs of this machine (host memory, device memory, disk, SSD
traffic), computed from the config and the model's shapes before anything is allocated, and
whether it fits. "What fits, and why" lives here; "how a step runs" lives in
:mod:`jaxascend.offload`, whose engine is built after this plan and never consulted by it.

What the rest of jaxascend (and its users) take from here:

* :func:`plan_resources` -- the run's resource plan, made in this process (its memory measured),
  with ``offload.params: auto`` and ``offload.gradients: auto`` resolved into the config;
* :func:`plan_run` -- the plan for given figures (a placement, a runtime part), as the scripts
  and the levers replan;
* :class:`ResourcePlan` -- the plan: host memory by part, device memory, disk per filesystem, SSD bytes
  per step and the step-time floor, the planner's choices, each part that does not fit with its
  levers (``format()``, ``to_dict()``, ``check()``);
* :class:`PlanError` -- a part that does not fit, in one line naming it.

Its own modules: ``resource_plan`` (the plan's figures, computed; ``offload.params`` and
``offload.gradients`` auto resolved), ``plan_figures`` (the plan: its parts, problems and printout), ``step_memory`` (what a step holds:
activations and the largest working set), ``machine_limits`` (what the machine can give: memory,
cgroups, filesystems), ``disk_plan`` (disk per filesystem), ``plan_levers`` (the settings that
would make a part fit, with figures) and ``deepspeed_anchor`` (the DeepSpeed estimate printed
beside the plan).

Imports :mod:`jaxascend.config`, :mod:`jaxascend.devices`, :mod:`jaxascend.models`,
:mod:`jaxascend.ssd` and, through its face, :mod:`jaxascend.offload` for the layout and the arena
plan the engine will have (from shapes alone).
"""

from jaxascend.planning.resource_plan import PlanError, ResourcePlan, plan_resources, plan_run

__all__ = ["PlanError", "ResourcePlan", "plan_resources", "plan_run"]
