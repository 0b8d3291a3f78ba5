"""The compute-dtype weights the forward/backward takes, placed as the step's plan says
(:attr:`~jaxascend.offload.step_plan.StepPlan.weight_source`):

* ``arrays``: every leaf is an array (the device memory kind), an input of the jitted step,
  replaced by the new leaves each update emits;
* ``host``: (overlapped, resident) the layer stack lives in host buffers that the background
  update writes in place and the parameter source serves to the layer scan, layer by layer; the
  other leaves are arrays;
* ``ssd``: (``offload.params: ssd``) the layer stack lives on SSD and the parameter source reads
  it ahead of the scan; the other leaves are arrays.

Over several devices the arrays are replicated global arrays, and in a job a process's updated
slices are all-gathered into them after each update (:meth:`ComputeWeights.whole`): the
placement's (:mod:`~jaxascend.offload.placement`) to do.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np

from jaxascend.offload.param_source import ParamSource
from jaxascend.offload.placement import Placement
from jaxascend.offload.state import OffloadedAdamState
from jaxascend.offload.step_plan import StepPlan


class ComputeWeights:
    """Owns the compute weights' places: the step's input leaves, the host buffers of an
    overlapped resident stack, and the parameter source (closed with the state).

    How each leaf is placed is the ``placement``'s: over several devices the step's inputs are
    replicated global arrays, and the 16-bit float leaves the step takes as raw bits (the layer
    stack, a large token table: ``bits``, see ``raw_bits.stacked_as_bits``) are held as ``uint16``
    arrays from the start (a bitcast of a global array would be a copy each step; one device
    views its arrays at each call). An overlapped resident stack of a job keeps this process's
    slice of every layer in its host buffers, all-gathered in the step as a streamed one is."""

    def __init__(self, plan: StepPlan, state: OffloadedAdamState, leaves: list, full_shapes: list[tuple],
                 placement: Placement, bits: Optional[dict[int, Any]] = None):
        """``leaves``: the compute weights in the state's leaf order (None for streamed leaves),
        this process's (the same on every process of a job); ``full_shapes``: each leaf's whole
        shape (a job's state holds slices); ``bits``: leaf index -> float dtype of the leaves the
        step takes as raw bits."""
        self.kind = plan.weight_source
        self._state = state
        self._placement = placement
        self._bits = dict(bits or {})
        self.full_shapes = [tuple(s) for s in full_shapes]
        leaves = list(leaves)
        # Overlapped and resident: the stack's weights move to host buffers that the optimizer
        # updates in place and the parameter source serves to the layer scan, layer by layer.
        self.host: dict[int, np.ndarray] = {}
        if self.kind == "host":
            for leaf in state.leaves:
                if leaf.stacked:
                    self.host[leaf.index] = self._host_buffer(leaf, np.asarray(leaves[leaf.index]))
                    leaves[leaf.index] = None
        self._leaves = [self._replicated(i, x) for i, x in enumerate(leaves)]
        self.source: Optional[ParamSource] = None
        if self.kind != "arrays":
            self.source = state.param_source(host=self.host or None)

    def _host_buffer(self, leaf, whole: np.ndarray) -> np.ndarray:
        """A stacked leaf's host buffer: every layer whole, or (a job) this process's slice of each."""
        return self._placement.host_buffer(whole)

    def _replicated(self, index: int, x):
        """Leaf ``index`` as the step takes it: as it is, or (several devices) a replicated global
        array of the same bytes (as uint16 when the step takes it as bits)."""
        return self._placement.input(x, index in self._bits)

    @property
    def bit_dtypes(self) -> dict[int, Any]:
        """Leaf index -> float dtype of the inputs the step takes as raw bits."""
        return dict(self._bits)

    def inputs(self):
        """The step's parameter tree: arrays, with None for the leaves the source serves."""
        return self._state.layout.treedef.unflatten(self._leaves)

    def tree(self):
        """The compute params as they stand, on this process: a host-served stack as views of
        its buffers (a job's: gathered whole, a collective every process makes), streamed
        leaves None, a job's arrays as numpy (the caller has waited for a running update)."""
        leaves = self.local_leaves()
        for index, buf in self.host.items():
            leaf = self._state.leaves[index]
            leaves[index] = self._placement.whole_host(buf, self.full_shapes[index], leaf.layers, leaf.shape)
        return self._state.layout.treedef.unflatten(leaves)

    def local_leaves(self) -> list:
        """The input leaves as this process holds them (over several devices as float numpy),
        None for the leaves the source serves."""
        return [self._placement.local(x, self._bits.get(i)) for i, x in enumerate(self._leaves)]

    def served(self, leaf) -> bool:
        """Whether the parameter source serves ``leaf`` (from SSD or a host buffer)."""
        return leaf.streamed or leaf.index in self.host

    def read_served(self, leaf, layer: int) -> np.ndarray:
        """Layer ``layer`` of a served leaf as this process holds it (a job's: its slice)."""
        if leaf.streamed:
            return self._state.read_params(leaf, layer)
        return self.host[leaf.index].reshape(leaf.shape)[layer].copy()

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
        self._leaves = self._assemble(list(range(len(leaves))), leaves)

    def whole(self, new: dict[int, Any]) -> dict[int, Any]:
        """An overlapped update's new top-level leaves (by leaf index) as the step takes them:
        a job's whole and replicated, from every process's slices (one process's devices:
        replicated); as they are for one device."""
        indices = sorted(new)
        return dict(zip(indices, self._assemble(indices, [new[i] for i in indices])))

    def _assemble(self, indices: list[int], slices: list) -> list:
        """Leaves ``indices`` as the step takes them, from this process's ``slices`` (None: not an input)."""
        return self._placement.assemble(slices, [self.full_shapes[i] for i in indices],
                                        [self._state.leaves[i].layers for i in indices],
                                        [i in self._bits for i in indices])

    def restore(self, leaves: list) -> None:
        """The compute params of a restored checkpoint, whole (a host-served stack into its buffers).
        One device's are placed as an update places its new leaves (uncommitted): a restored
        array committed to its device would make the next step compile once more."""
        leaves = list(leaves)
        for index, buf in self.host.items():
            np.copyto(buf, self._host_buffer(self._state.leaves[index], np.asarray(leaves[index])))
            leaves[index] = None
        self._leaves = [self._placement.restored_input(x, i in self._bits) for i, x in enumerate(leaves)]

    def begin_step(self, forward_only: bool = False) -> None:
        if self.source is not None:
            self.source.begin_step(forward_only=forward_only)  # reads layer 0, 1, ... (once updated)

    def end_step(self) -> None:
        if self.source is not None:
            self.source.end_step()

    def source_events(self) -> Iterable:
        return self.source.take_events() if self.source is not None else ()
