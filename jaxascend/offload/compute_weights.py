"""The compute-dtype weights the forward/backward takes, placed as the step's plan says
(:attr:`~jaxascend.offload.step_plan.StepPlan.weight_source`):

* ``arrays``: every leaf is an array (the device memory kind), an input of the jitted step,
  replaced by the new leaves each update emits;
* ``host``: (overlapped, resident) the layer stack lives in host buffers that the background
  update writes in place and the parameter source serves to the layer scan, layer by layer; the
  other leaves are arrays;
* ``ssd``: (``offload.params: ssd``) the layer stack lives on SSD and the parameter source reads
  it ahead of the scan; the other leaves are arrays.

In a job (data parallel) the arrays are replicated global arrays: a process's updated slices
are all-gathered into them after each update (:meth:`ComputeWeights.whole`).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import jax
import numpy as np

from jaxascend.offload.param_source import ParamSource
from jaxascend.offload.partition import DataParallel, local_value
from jaxascend.offload.state import OffloadedAdamState
from jaxascend.offload.step_plan import StepPlan


class ComputeWeights:
    """Owns the compute weights' places: the step's input leaves, the host buffers of an
    overlapped resident stack, and the parameter source (closed with the state)."""

    def __init__(self, plan: StepPlan, state: OffloadedAdamState, leaves: list, full_shapes: list[tuple],
                 data_parallel: Optional[DataParallel]):
        """``leaves``: the compute weights in the state's leaf order (None for streamed leaves),
        this process's (the same on every process of a job); ``full_shapes``: each leaf's whole
        shape (a job's state holds slices)."""
        self.kind = plan.weight_source
        self._state = state
        self._dp = data_parallel
        self._partitioned = plan.partitioned
        self.full_shapes = [tuple(s) for s in full_shapes]
        if data_parallel is not None:  # the whole compute weights on every process, as the step's replicated input
            leaves = [data_parallel.replicate(x) for x in leaves]
        # Overlapped and resident: the stack's weights move to host buffers that the optimizer
        # updates in place and the parameter source serves to the layer scan, layer by layer.
        self.host: dict[int, np.ndarray] = {}
        if self.kind == "host":
            for leaf in state.leaves:
                if leaf.stacked:
                    self.host[leaf.index] = np.ascontiguousarray(leaves[leaf.index]).reshape(-1).copy()
                    leaves[leaf.index] = None
        self._leaves = list(leaves)
        self.source: Optional[ParamSource] = None
        if self.kind != "arrays":
            self.source = state.param_source(host=self.host or None)

    def inputs(self):
        """The step's parameter tree: arrays, with None for the leaves the source serves."""
        return self._state.layout.treedef.unflatten(self._leaves)

    def tree(self):
        """The compute params as they stand: a host-served stack as views of its buffers,
        streamed leaves None (the caller has waited for a running update)."""
        leaves = list(self._leaves)
        for index, buf in self.host.items():
            leaves[index] = buf.reshape(self._state.leaves[index].shape)
        return self._state.layout.treedef.unflatten(leaves)

    def local(self, tree):
        """``tree`` as this process holds it (a job's replicated arrays as numpy)."""
        return tree if self._dp is None else jax.tree.map(local_value, tree)

    def release_updated(self) -> None:
        """Drops the arrays an update is about to replace (the old ones need not outlive it)."""
        for leaf in self._state.leaves:
            if not leaf.streamed and leaf.index not in self.host:
                self._leaves[leaf.index] = None

    def put(self, new: dict[int, Any]) -> None:
        """Takes an update's new leaves (by leaf index), whole (see :meth:`whole`)."""
        for index, leaf in new.items():
            self._leaves[index] = leaf

    def put_all(self, leaves: list) -> None:
        """Takes every leaf a sequential update emitted (this process's slices in a job)."""
        if self._partitioned:  # every process's slices make the whole (replicated) weights again
            leaves = self._dp.gather(leaves, self.full_shapes, [leaf.layers for leaf in self._state.leaves])
        elif self._dp is not None:  # the whole weights, as the next step's replicated input
            leaves = [self._dp.replicate(x) for x in leaves]
        self._leaves = list(leaves)

    def whole(self, new: dict[int, Any]) -> dict[int, Any]:
        """A job's updated top-level leaves (an overlapped update's, by leaf index) whole and
        replicated, from every process's slices; as they are for one process."""
        if not new or not self._partitioned:
            return new
        indices = sorted(new)
        full = self._dp.gather([np.asarray(new[i]) for i in indices], [self.full_shapes[i] for i in indices],
                               [self._state.leaves[i].layers for i in indices])
        return dict(zip(indices, full))

    def restore(self, leaves: list) -> None:
        """The compute params of a restored checkpoint (a host-served stack into its buffers)."""
        if self._dp is not None:
            leaves = [self._dp.replicate(x) for x in leaves]
        for index, buf in self.host.items():
            np.copyto(buf, np.asarray(leaves[index]).reshape(-1))
            leaves[index] = None
        self._leaves = list(leaves)

    def whole_layers(self) -> list:
        """One whole layer of each streamed leaf (what a job's step gathers the slices into)."""
        return [jax.ShapeDtypeStruct(self.full_shapes[leaf.index][1:], leaf.dtype)
                for leaf in self._state.layout.streamed_leaves]

    def begin_step(self, forward_only: bool = False) -> None:
        if self.source is not None:
            self.source.begin_step(forward_only=forward_only)  # reads layer 0, 1, ... (once updated)

    def end_step(self) -> None:
        if self.source is not None:
            self.source.end_step()

    def source_events(self) -> Iterable:
        return self.source.take_events() if self.source is not None else ()
