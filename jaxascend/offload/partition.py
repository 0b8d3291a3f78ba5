"""Data parallel over processes: each owns 1/P of every tensor's optimizer state.

    dp = DataParallel(Partition(index, count))      # after jax.distributed has joined the job
    spec = dp.partition.local_spec(full_spec, stacked)   # the slices this process's SSD state holds
    master = dp.partition.take(full_layer)          # this process's slice of one layer (zero-padded)
    batch = dp.shard_rows(global_batch)             # this process's rows of it, as the job's global arrays
    full = dp.gather(new_slices, shapes, stacked)   # the updated compute params, whole, on every process

A tensor (one layer of a stacked leaf, or a whole top-level leaf) is split as a flat array,
zero-padded to a multiple of P: process ``i`` owns elements ``[i*s, (i+1)*s)`` with
``s = ceil(n / P)``. The optimizer is element-wise, so each process runs AdamW on its slices
alone; the backward pass reduce-scatters each layer's gradient so that only a process's own
slice reaches its sink (:class:`~jaxascend.offload.grad_sink.GradientScatter`), and the updated
compute params are all-gathered after the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxascend.offload.grad_sink import GradientScatter

AXIS = "data"


@dataclass(frozen=True)
class Partition:
    """Process ``index`` of ``count``: which slice of every tensor's state it owns."""

    index: int
    count: int

    def slice_size(self, size: int) -> int:
        return -(-size // self.count)

    def local_spec(self, spec, stacked: Callable[[tuple], bool]):
        """The state's leaves as this process holds them: ``[L, s]`` for a stacked leaf (each
        layer split on its own), ``[s]`` for any other; ``stacked(path)`` says which is which."""
        def local(path, leaf):
            if stacked(path):
                per_layer = int(np.prod(leaf.shape[1:]))
                return jax.ShapeDtypeStruct((leaf.shape[0], self.slice_size(per_layer)), leaf.dtype)
            return jax.ShapeDtypeStruct((self.slice_size(int(np.prod(leaf.shape))),), leaf.dtype)

        return jax.tree_util.tree_map_with_path(local, spec)

    def take(self, values) -> np.ndarray:
        """This process's slice of one tensor (one layer, or a whole top-level leaf), flat, the
        last slice zero-padded."""
        flat = np.asarray(values).reshape(-1)
        s = self.slice_size(flat.size)
        out = np.zeros(s, flat.dtype)
        part = flat[self.index * s:(self.index + 1) * s]
        out[:part.size] = part
        return out

    @property
    def scatter(self) -> GradientScatter:
        return GradientScatter(AXIS, self.count)


class DataParallel:
    """The job's mesh (one device per process) and the few collectives the engine needs outside
    the step: replicated inputs, row-sharded batches, the all-gather of updated params."""

    def __init__(self, partition: Partition):
        devices = jax.devices()
        if len(devices) != partition.count or jax.local_device_count() != 1:
            raise ValueError(f"data parallel: {partition.count} processes need one device each; this job has "
                             f"{len(devices)} devices, {jax.local_device_count()} in this process")
        self.partition = partition
        self.mesh = Mesh(np.array(devices), (AXIS,))
        self.replicated = NamedSharding(self.mesh, P())
        self.rows = NamedSharding(self.mesh, P(AXIS))
        self._gather = jax.jit(jax.shard_map(lambda xs: [jax.lax.all_gather(x, AXIS, tiled=True) for x in xs],
                                             mesh=self.mesh, in_specs=P(AXIS), out_specs=P(), check_vma=False))

    def replicate(self, x):
        """``x`` (the same on every process) as a replicated global array."""
        if x is None:
            return None
        return jax.make_array_from_process_local_data(self.replicated, np.asarray(x))

    def shard_rows(self, batch):
        """A global batch (a pytree, the same on every process, rows on axis 0) as global arrays
        of which this process supplies its contiguous block of rows."""
        rows, part = jax.tree.leaves(batch)[0].shape[0], self.partition
        if rows % part.count:
            raise ValueError(f"data.batch_size: {rows} rows do not split evenly over {part.count} processes")
        mine = slice(part.index * rows // part.count, (part.index + 1) * rows // part.count)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(self.rows, np.asarray(x)[mine]), batch)

    def step(self, fn, in_specs, out_specs):
        """``fn`` under ``shard_map`` over the processes (``check_vma=False``: see GradientScatter)."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def gather(self, slices: Sequence[np.ndarray], shapes: Sequence[tuple],
               stacked: Sequence[bool]) -> list[np.ndarray]:
        """Each tensor whole, on every process, from every process's slice of it: ``slices[k]``
        is this process's ``[L, s]`` (a stacked leaf) or ``[s]``; ``shapes[k]`` the full shape."""
        columns = []
        for x, is_stacked in zip(slices, stacked):
            x = np.asarray(x)
            columns.append(np.ascontiguousarray((x if is_stacked else x[None]).T))  # [s, L]
        gathered = self._gather([jax.make_array_from_process_local_data(self.rows, c) for c in columns])
        out = []
        for full, shape, is_stacked in zip(gathered, shapes, stacked):
            whole = local_value(full).T  # [L, P*s]
            per_layer = int(np.prod(shape[1:] if is_stacked else shape))
            whole = whole[:, :per_layer]
            out.append(np.ascontiguousarray(whole).reshape(shape))
        return out


def local_value(x) -> np.ndarray:
    """The value of a replicated global array, as this process holds it."""
    return np.asarray(x.addressable_shards[0].data)
