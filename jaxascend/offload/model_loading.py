"""How a run's model loads, as its step's plan needs it: the model the engine is built around and
where its fp32 master weights start. The trainer asks; the plan decides.

    loaded = load_model(plan, model_cfg, sized, seed, source=reader)   # reader: an HFParamReader or None
    engine = build_engine(cfg, loaded.model, model_cfg, plan, master=loaded.master)

With streamed weights (``plan.weights == "ssd"``) the layer stack is never loaded whole: the
model holds only its shapes there, and the engine reads the stack layer by layer into its SSD
regions (with the master weights) through ``master``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.hf import HFParamReader, build_model_lean, lean_init_reader, load_hf_model
from jaxascend.offload.engine import MasterReader
from jaxascend.offload.step_plan import StepPlan


@dataclass(frozen=True)
class LoadedModel:
    """The model to build the engine around and the reader of its master weights' first values
    (None: the engine takes them from the model's parameters)."""

    model: nnx.Module
    master: Optional[MasterReader]


def load_model(plan: StepPlan, model_cfg: ModelConfig, sized: ModelConfig, seed: int,
               source: Optional[HFParamReader] = None) -> LoadedModel:
    """``model_cfg``'s model (``sized``: the same with the run's vocabulary), loaded tensor by
    tensor from ``source`` (a checkpoint, whose own values start the fp32 master weights, not
    the rounded compute copy), else initialised lean from ``seed``; its layer stack left out
    when the plan streams it from SSD."""
    stack = plan.weights != "ssd"
    if source is not None:
        return LoadedModel(load_hf_model(source.folder, model_cfg, layer_stack=stack), source.read)
    model = build_model_lean(model_cfg, sized.vocab_size, seed, layer_stack=stack)
    return LoadedModel(model, None if stack else lean_init_reader(sized, seed))
