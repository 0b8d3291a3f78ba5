"""How a run lays out its state on SSD, decided from the config and the model: which leaves are
layer stacks, in how many blocks of rows a large token table arrives, whether the compute weights
live there too, and the format of m and v. The engine and the run planner lay out with the same
:class:`StateLayoutOptions`, so the plan is the layout the run will have.

    options = StateLayoutOptions.of(cfg, model_cfg, params, stream=plan.weights == "ssd")
    layout = options.plan(spec, cfg.offload)          # an OffloadLayout

The run planner (:mod:`jaxascend.planning`) sizes a run from shapes alone, before any engine
exists: :func:`job_state_layout` and :func:`state_arena_plan` are the layout and the arena plan
the engine will make, stated here beside the engine's own use of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax

from jaxascend.checkpoint import checkpoint_arena_requests
from jaxascend.config import Config, ModelConfig, OffloadConfig
from jaxascend.hf import abstract_params
from jaxascend.models import DTYPES, is_large_table, layer_stack_key, table_blocks, token_table_path
from jaxascend.offload.layout import OffloadLayout
from jaxascend.offload.partition import Partition
from jaxascend.offload.step_plan import grad_store
from jaxascend.optim import StateFormat
from jaxascend.ssd import ArenaPlan, SlotRequest, SsdStore


def state_format(cfg: Config) -> StateFormat:
    """The format of the state on SSD: m and v as ``optimizer.state_dtype`` (and ``state_block``
    for int8), rounded as ``optimizer.state_rounding`` says; the master as ``optimizer.master_dtype``
    and ``master_rounding``."""
    o = cfg.optimizer
    return StateFormat.of(o.state_dtype, o.state_block, o.state_rounding, o.master_dtype, o.master_rounding)


@dataclass(frozen=True)
class TableLayout:
    """How the token table's gradient arrives: ``row_blocks`` per leaf in flattening order (a
    large table's in the blocks of rows the model computes it in, see models.vocab; 1 for every
    other leaf), the table's ``blocks``, and whether it is ``large``."""

    row_blocks: tuple[int, ...]
    blocks: int
    large: bool

    @classmethod
    def of(cls, params, model_cfg: ModelConfig) -> "TableLayout":
        table = token_table_path(model_cfg.arch)
        blocks, large = [], False
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            keys = tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
            is_table = keys[:len(table)] == table and len(leaf.shape) == 2
            blocks.append(table_blocks(*leaf.shape) if is_table else 1)
            large = large or (is_table and is_large_table(leaf))
        return cls(tuple(blocks), max(blocks), large)


@dataclass(frozen=True)
class StateLayoutOptions:
    """The keywords of :meth:`OffloadLayout.plan` (and ``OffloadedAdamState.create``) for a run."""

    stack_key: str
    stream_params: bool
    row_blocks: tuple[int, ...]
    state: StateFormat
    grad_store: str = "ssd"  # the plan's: where the gradients wait (ssd, host, host_fp32)
    host_grad_layers: Optional[int] = None  # with host: the stack's first N layers' only (offload.host_gradient_layers)

    @classmethod
    def of(cls, cfg: Config, model_cfg: ModelConfig, row_blocks: tuple[int, ...], stream: bool) -> "StateLayoutOptions":
        return cls(layer_stack_key(model_cfg.arch), bool(stream), tuple(row_blocks), state_format(cfg),
                   grad_store(cfg), cfg.offload.host_gradient_layers)

    def stacked(self, path: str, shape) -> bool:
        """Whether the leaf at ``path`` ('layers/...') is a layer stack ``[L, ...]``."""
        return path.split("/")[0] == self.stack_key

    def keywords(self) -> dict:
        return {"stacked": self.stacked, "stream_params": self.stream_params, "row_blocks": list(self.row_blocks),
                "state": self.state, "grad_store": self.grad_store, "host_grad_layers": self.host_grad_layers}

    def plan(self, spec, cfg: OffloadConfig) -> OffloadLayout:
        return OffloadLayout.plan(spec, cfg, **self.keywords())


def checkpoint_slot_requests(layout: OffloadLayout, cfg: OffloadConfig) -> tuple[SlotRequest, ...]:
    """Checkpoints stream master/m/v through the step's state slots, idle between steps; a model
    so small that those slots hold under 3 SSD blocks gets a few slots of its own (these)."""
    if layout.state_slot_bytes < 3 * cfg.block_bytes:
        return tuple(checkpoint_arena_requests(cfg, chunk_bytes=cfg.block_bytes))
    return ()


def job_state_layout(cfg: Config, model_cfg: ModelConfig, stream: bool, processes: int = 1) -> OffloadLayout:
    """The layout of the state :class:`~jaxascend.offload.engine.PlannedOffloadEngine` creates for
    ``model_cfg`` (its ``vocab_size`` the run's), from shapes alone: the whole model's, or
    (``processes`` > 1) process 0's slices of every tensor (no smaller than any other's), as the
    engine lays out a job's. ``stream``: ``offload.params: ssd``."""
    _, params = abstract_params(model_cfg)
    dtype = DTYPES[model_cfg.dtype]
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)
    row_blocks = TableLayout.of(params, model_cfg).row_blocks
    options = StateLayoutOptions.of(cfg, model_cfg, row_blocks, stream)
    if processes > 1:
        stacked = lambda path: str(getattr(path[0], "key", path[0])) == options.stack_key  # noqa: E731
        spec = Partition(0, processes).local_spec(spec, stacked, row_blocks)
    return options.plan(spec, cfg.offload)


def state_arena_plan(cfg: Config, layout: OffloadLayout) -> ArenaPlan:
    """The arena plan the engine carves for ``layout``: the store's staging, the step's slots and
    the checkpoint's own slots where the step's are too small (before ``offload.pow2_buffers``
    rounds them, as :class:`~jaxascend.ssd.HostArena` does)."""
    return (ArenaPlan().extend(SsdStore.arena_requests(cfg.offload)).extend(layout.arena_requests())
            .extend(checkpoint_slot_requests(layout, cfg.offload)))
