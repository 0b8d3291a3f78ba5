"""The offloaded run's weights as readers ``read(path, layer)``: what an export, the run's
``params.safetensors`` and the end-of-run samples pull one tensor (one layer) at a time.

* the fp32 master weights on SSD (:meth:`WeightReaders.exported`), for saving and exporting;
* the compute weights (:meth:`WeightReaders.sampled`): the resident tree itself, or a reader
  that reads a streamed layer from SSD when asked.

These are the readers of a process that holds every tensor whole (one device, or this process's
devices). In a job each process holds a slice of every tensor, and the job's placement wraps
them (:class:`~jaxascend.offload.partition.JobWeightReaders`): process 0 reads whole tensors
while the others serve their slices, one tensor whole at a time; the other processes get None.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import numpy as np

from jaxascend.offload.compute_weights import ComputeWeights
from jaxascend.offload.state import OffloadedAdamState


class WeightReaders:
    """Readers over ``state`` and ``weights`` by our parameter paths (``paths``, in the state's
    leaf order); ``finish()`` waits for a running update before anything is read."""

    def __init__(self, state: OffloadedAdamState, weights: ComputeWeights, paths: list[tuple[str, ...]],
                 finish: Callable[[], None]):
        self._state, self._weights = state, weights
        self.finish = finish
        self._index = {path: i for i, path in enumerate(paths)}

    @property
    def paths(self) -> list[tuple[str, ...]]:
        """Our parameter path of every leaf, in the state's leaf order (what the readers take)."""
        return list(self._index)

    @property
    def leaves(self) -> list:
        """The state's leaves (their layouts), in leaf order."""
        return self._state.leaves

    @property
    def full_shapes(self) -> list[tuple]:
        """Each leaf's whole shape (a job's state holds slices)."""
        return self._weights.full_shapes

    @property
    def served(self) -> bool:
        """Whether the parameter source serves some leaves (streamed, or from host buffers)."""
        return self._weights.source is not None

    def read_served(self, leaf, layer: int) -> np.ndarray:
        """Layer ``layer`` of a leaf the source serves, as this process holds it."""
        return self._weights.read_served(leaf, layer)

    def local_params(self):
        """The compute params as this process holds them (waits for a running update)."""
        self.finish()
        return self._weights.tree()

    def compute(self):
        """The compute params to sample from: the tree itself when the layer stack is resident,
        else a reader that reads a streamed layer from SSD when asked. One process's own."""
        if self._weights.kind != "ssd":
            return self.local_params()
        return self.compute_reader(self._weights.read_served)

    @contextlib.contextmanager
    def sampled(self):
        """:meth:`compute`, in a ``with`` block (what a job's readers gather in one)."""
        yield self.compute()

    def master(self):
        """A reader of the fp32 master weights on SSD."""
        self.finish()
        return self.reader(self.read_master, " to export")

    @contextlib.contextmanager
    def exported(self):
        """:meth:`master`, in a ``with`` block (what a job's readers gather in one)."""
        yield self.master()

    def read_master(self, leaf, layer: Optional[int]) -> np.ndarray:
        """Layer ``layer`` (None: all) of a leaf's fp32 master weights, as this process holds them."""
        return self._state.read_state(leaf, "master", layer=layer)

    def compute_reader(self, read_served: Callable):
        """``read(path, layer)`` of the compute params: the layers of a leaf the source serves
        through ``read_served(leaf, layer)``, the others from this process's copy."""
        weights = self._weights
        self.finish()
        leaves = weights.local_leaves()

        def value(leaf, layer):
            if weights.served(leaf):
                return read_served(leaf, layer)
            x = np.asarray(leaves[leaf.index])
            return x if layer is None else x[layer]

        return self.reader(value, "")

    def reader(self, value: Callable, purpose: str):
        """``read(path, layer)`` by our parameter path: ``value(leaf, layer)`` of that leaf's layout."""
        def read(path: tuple[str, ...], layer):
            if tuple(path) not in self._index:
                raise ValueError(f"offload: no parameter {'.'.join(path)!r}{purpose}")
            return value(self._state.leaves[self._index[tuple(path)]], layer)

        return read
