"""The offloaded run's weights as readers ``read(path, layer)``: what an export, the run's
``params.safetensors`` and the end-of-run samples pull one tensor (one layer) at a time.

* the fp32 master weights on SSD (:meth:`WeightReaders.exported`), for saving and exporting;
* the compute weights (:meth:`WeightReaders.sampled`): the resident tree itself, or a reader
  that reads a streamed layer from SSD when asked.

In a job each process holds a slice of every tensor: process 0 reads whole tensors while the
others serve their slices (:class:`~jaxascend.offload.partition.JobReads`), one tensor whole at a
time; the other processes get None.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import jax
import numpy as np

from jaxascend.offload.compute_weights import ComputeWeights
from jaxascend.offload.partition import DataParallel, JobReads
from jaxascend.offload.state import OffloadedAdamState


class WeightReaders:
    """Readers over ``state`` and ``weights`` by our parameter paths (``paths``, in the state's
    leaf order); ``finish()`` waits for a running update before anything is read."""

    def __init__(self, state: OffloadedAdamState, weights: ComputeWeights, paths: list[tuple[str, ...]],
                 data_parallel: Optional[DataParallel], partitioned: bool, finish: Callable[[], None]):
        self._state, self._weights, self._dp = state, weights, data_parallel
        self._partitioned = partitioned
        self._finish = finish
        self._index = {path: i for i, path in enumerate(paths)}

    @property
    def paths(self) -> list[tuple[str, ...]]:
        """Our parameter path of every leaf, in the state's leaf order (what the readers take)."""
        return list(self._index)

    @property
    def _is_reader(self) -> bool:
        return not self._partitioned or self._dp.partition.index == 0

    def local_params(self):
        """The compute params as this process holds them (waits for a running update)."""
        self._finish()
        return self._weights.tree()

    def compute(self):
        """The compute params to sample from: the tree itself when the layer stack is resident,
        else a reader that reads a streamed layer from SSD when asked. One process's own."""
        if self._weights.kind != "ssd":
            return self.local_params()
        return self._compute_reader(self._weights.read_served)

    @contextlib.contextmanager
    def sampled(self):
        """:meth:`compute` on process 0 (None on a job's others); a job's layers served by the
        parameter source (streamed, or its slices in host buffers) are gathered from every
        process's slices as process 0 reads them."""
        if not (self._partitioned and self._weights.source is not None):
            yield self.compute() if self._is_reader else None
            return
        self._finish()  # on every process: its gather is a collective, and the served layers must be new
        with self._job_reads(self._weights.read_served) as reads:
            yield self._compute_reader(lambda leaf, layer: reads.read(leaf.index, layer)) if reads.is_reader else None

    def master(self):
        """A reader of the fp32 master weights on SSD (one process only; a job: :meth:`exported`)."""
        if self._partitioned:
            raise RuntimeError("offload: a job's weights are read through exported_weights() on every process")
        self._finish()
        return self._reader(self._read_master, " to export")

    @contextlib.contextmanager
    def exported(self):
        """:meth:`master` on process 0 (None on a job's others, which serve their slices of each
        tensor process 0 reads, gathered one tensor, or one layer, at a time)."""
        if not self._partitioned:
            yield self.master()
            return
        self._finish()
        with self._job_reads(self._read_master) as reads:
            yield self._reader(lambda leaf, layer: reads.read(leaf.index, layer), " to export") \
                if reads.is_reader else None

    def _read_master(self, leaf, layer: Optional[int]) -> np.ndarray:
        return self._state.read_state(leaf, "master", layer=layer)

    def _compute_reader(self, read_served: Callable):
        """``read(path, layer)`` of the compute params: the layers of a leaf the source serves
        through ``read_served(leaf, layer)``, the others from this process's copy."""
        weights = self._weights
        self._finish()
        leaves = weights.local_leaves()

        def value(leaf, layer):
            if weights.served(leaf):
                return read_served(leaf, layer)
            x = np.asarray(leaves[leaf.index])
            return x if layer is None else x[layer]

        return self._reader(value, "")

    def _job_reads(self, read_slice: Callable) -> JobReads:
        """Process 0's whole-tensor reads of what ``read_slice(leaf, layer)`` reads of this
        process's slices."""
        leaves = self._state.leaves
        return JobReads(self._dp, lambda index, layer: read_slice(leaves[index], layer).reshape(-1),
                        self._weights.full_shapes, [leaf.layers for leaf in leaves], [leaf.stacked for leaf in leaves])

    def _reader(self, value: Callable, purpose: str):
        """``read(path, layer)`` by our parameter path: ``value(leaf, layer)`` of that leaf's layout."""
        def read(path: tuple[str, ...], layer):
            if tuple(path) not in self._index:
                raise ValueError(f"offload: no parameter {'.'.join(path)!r}{purpose}")
            return value(self._state.leaves[self._index[tuple(path)]], layer)

        return read
