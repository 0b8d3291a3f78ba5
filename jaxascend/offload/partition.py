"""Data parallel over processes: each owns 1/P of every tensor's optimizer state. The tools of
the placements over several devices (:mod:`~jaxascend.offload.placement`), which the engine's
parts call:

    dp = DataParallel(Partition(index, count))      # after jax.distributed has joined the job
    spec = dp.partition.local_spec(full_spec, stacked)   # the slices this process's SSD state holds
    master = dp.partition.take(full_layer)          # this process's slice of one layer (zero-padded)
    batch = dp.shard_rows(global_batch)             # this process's rows of it, as the job's global arrays
    full = dp.gather(new_slices, shapes, layers)    # the updated compute params, whole, on every process
    with JobReads(dp, read_slice, shapes, layers, stacked) as reads:  # process 0 reads whole tensors, one at a time;
        if reads.is_reader: export(reads.read)      # the others serve their slices until it is done

A tensor (one layer of a stacked leaf, or a whole top-level leaf) is split as a flat array,
zero-padded to a multiple of P: process ``i`` owns elements ``[i*s, (i+1)*s)`` with
``s = ceil(n / P)``. The optimizer is element-wise, so each process runs AdamW on its slices
alone; the backward pass reduce-scatters each layer's gradient so that only a process's own
slice reaches its sink (:class:`~jaxascend.offload.grad_sink.GradientScatter`), and the updated
compute params are all-gathered after the step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"  # the processes of a job: the state is split over them
LOCAL = "local"  # the devices of one process


@dataclass(frozen=True)
class Partition:
    """Process ``index`` of ``count``: which slice of every tensor's state it owns."""

    index: int
    count: int

    def slice_size(self, size: int) -> int:
        return -(-size // self.count)

    def local_spec(self, spec, stacked: Callable[[tuple], bool], row_blocks: Optional[Sequence[int]] = None):
        """The state's leaves as this process holds them: ``[L, s]`` for a stacked leaf (each
        layer split on its own), ``[K * s]`` for a table in ``K`` blocks of rows (``row_blocks``,
        one per leaf in flattening order: each block split on its own, like a layer), ``[s]``
        for any other; ``stacked(path)`` says which leaves are stacked."""
        paths, treedef = jax.tree_util.tree_flatten_with_path(spec)
        blocks = list(row_blocks) if row_blocks is not None else [1] * len(paths)
        out = []
        for (path, leaf), k in zip(paths, blocks):
            if stacked(path):
                shape = (leaf.shape[0], self.slice_size(int(np.prod(leaf.shape[1:]))))
            else:
                shape = (int(k) * self.slice_size(int(np.prod(leaf.shape)) // int(k)),)
            out.append(jax.ShapeDtypeStruct(shape, leaf.dtype))
        return treedef.unflatten(out)

    def take(self, values) -> np.ndarray:
        """This process's slice of one tensor (one layer, or a whole top-level leaf), flat, the
        last slice zero-padded."""
        flat = np.asarray(values).reshape(-1)
        s = self.slice_size(flat.size)
        out = np.zeros(s, flat.dtype)
        part = flat[self.index * s:(self.index + 1) * s]
        out[:part.size] = part
        return out


class DataParallel:
    """The job's mesh and the few collectives the engine needs outside the step: replicated
    inputs, row-sharded batches, the all-gather of updated params.

    The mesh is ``[processes, devices per process]`` (axes :data:`AXIS` and :data:`LOCAL`): the
    rows are split over every device, the state over the processes (``partition``: this
    process's slice; ``(0, 1)``: one process owns it whole). A layer's gradient is reduce-scattered
    over the processes and summed over each process's devices, and the first device of each
    process sends its slice to the process's sink and fetches the layers the parameter source
    serves (the placement's :class:`~jaxascend.offload.grad_sink.GradientScatter`)."""

    def __init__(self, partition: Partition, local_devices: Optional[int] = None):
        """``local_devices``: the devices of each process the step uses (default: all of them;
        1: the first of each)."""
        local = jax.local_device_count() if local_devices is None else int(local_devices)
        by_process: dict[int, list] = {}
        for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
            by_process.setdefault(device.process_index, []).append(device)
        if len(by_process) != partition.count or any(len(d) < local for d in by_process.values()):
            raise ValueError(f"data parallel: a job of {partition.count} process(es) with {local} device(s) each; "
                             f"this one has {len(by_process)} process(es) with "
                             f"{sorted({len(d) for d in by_process.values()})} devices")
        if partition.count * local < 2:
            raise ValueError("data parallel: one process needs several devices to share the rows")
        self.partition = partition
        self.local_devices = local
        self.devices = partition.count * local
        grid = np.array([by_process[p][:local] for p in sorted(by_process)])  # [processes, local]
        self.mesh = Mesh(grid, (AXIS, LOCAL))
        self.replicated = NamedSharding(self.mesh, P())
        self.rows = NamedSharding(self.mesh, P(AXIS))
        self._columns = NamedSharding(self.mesh, P(None, AXIS))
        self._gathers: dict = {}  # (shape, layers) -> the jitted gather of one tensor
        self._broadcast = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, AXIS), mesh=self.mesh,
                                                in_specs=P(AXIS), out_specs=P(), check_vma=False))

    def replicate(self, x):
        """``x`` (the same on every process) as a replicated global array."""
        if x is None:
            return None
        return jax.make_array_from_process_local_data(self.replicated, np.asarray(x))

    def shard_rows(self, batch, axis: int = 0):
        """A global batch (a pytree, the same on every process, rows on ``axis``: 1 for a
        step's micro-batches ``[A, B, ...]``) as global arrays of which this
        process supplies its contiguous block of rows."""
        rows, part = jax.tree.leaves(batch)[0].shape[axis], self.partition
        if rows % self.devices:
            raise ValueError(f"data.batch_size: {rows} rows do not split evenly over {self.devices} devices")
        mine = (slice(None),) * axis + (slice(part.index * rows // part.count, (part.index + 1) * rows // part.count),)
        sharding = NamedSharding(self.mesh, _rows_spec(axis))
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)[mine]), batch)

    def step(self, fn, in_specs, out_specs):
        """``fn`` under ``shard_map`` over the processes (``check_vma=False``: see GradientScatter)."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def batch_step(self, fn, batch_axis: int = 0, scalars: int = 0):
        """``fn(params, batch, *scalars)`` jitted under :meth:`step`: ``params`` and the scalars
        replicated, the batch (as :meth:`shard_rows` makes it) sharded on ``batch_axis``; every
        output replicated (the job's)."""
        replicated = P()
        return jax.jit(self.step(fn, (replicated, _rows_spec(batch_axis)) + (replicated,) * scalars, replicated))

    def gather(self, slices: Sequence[Optional[np.ndarray]], shapes: Sequence[tuple],
               layers: Sequence[int]) -> list:
        """Each tensor whole, as a replicated global array, from every process's slice of it:
        ``slices[k]`` is this process's ``[layers, s]`` (or the same flat: a stacked leaf, a
        table in blocks of rows, a tensor of one layer; None: a leaf that is not gathered, e.g.
        streamed); ``shapes[k]`` the whole shape, ``layers[k]`` its layers (1: none). One tensor
        at a time, trimmed and reshaped inside the collective, so that a tensor's only whole copy
        is the replicated array itself."""
        out = []
        for x, shape, count in zip(slices, shapes, layers):
            if x is None:
                out.append(None)
                continue
            rows = np.asarray(x).reshape(int(count), -1)  # [layers, s]
            sharded = jax.make_array_from_process_local_data(self._columns, np.ascontiguousarray(rows))
            out.append(self._gather_one_tensor(tuple(shape), int(count))(sharded))
        return out

    def _gather_one_tensor(self, shape: tuple, layers: int):
        key = (shape, layers)
        if key not in self._gathers:
            per_layer = int(np.prod(shape)) // layers

            def whole(rows):  # [L, s] on each process -> [L, P * s] -> the tensor
                full = jax.lax.all_gather(rows, AXIS, axis=1, tiled=True)
                return full[:, :per_layer].reshape(shape)

            self._gathers[key] = jax.jit(jax.shard_map(whole, mesh=self.mesh, in_specs=P(None, AXIS), out_specs=P(),
                                                       check_vma=False))
        return self._gathers[key]

    def broadcast(self, values: Sequence[int]) -> list[int]:
        """Process 0's ``values`` (small integers) on every process (the others' are ignored)."""
        mine = np.asarray(values if self.partition.index == 0 else np.zeros(len(values)), np.int32)[None]
        total = self._broadcast(jax.make_array_from_process_local_data(self.rows, mine))
        return [int(v) for v in local_value(total)[0]]

    def gather_one(self, piece: np.ndarray, size: int) -> np.ndarray:
        """One tensor's ``size`` elements, flat, on every process, from every process's slice."""
        return local_value(self.gather([piece], [(size,)], [1])[0])


class JobReads:
    """Process 0 reads whole tensors from a job whose processes each hold a slice of them: its
    ``read(tensor, layer)`` names the tensor to every process (a broadcast), and each answers with
    its slice (an all-gather), so that only one tensor is whole at a time. The other processes
    serve inside ``__enter__`` until process 0 leaves the ``with`` block (also on an error).

    ``read_slice(tensor, layer)``: this process's flat slice of one layer (``layer`` None: of a
    tensor without layers); ``shapes[tensor]``: the whole shape; ``layers[tensor]``: its layers,
    each split on its own (a stacked leaf's axis 0, a table's blocks of rows; 1: none)."""

    _STOP = -1

    def __init__(self, dp: DataParallel, read_slice: Callable[[int, Optional[int]], np.ndarray],
                 shapes: Sequence[tuple], layers: Sequence[int], stacked: Sequence[bool]):
        self.dp, self.read_slice = dp, read_slice
        self.shapes, self.layers, self.stacked = [tuple(x) for x in shapes], list(layers), list(stacked)
        self.is_reader = dp.partition.index == 0

    def read(self, tensor: int, layer: Optional[int]) -> np.ndarray:
        """Tensor ``tensor`` (one layer of a stacked one, or all when ``layer`` is None), whole
        (process 0); a table in blocks of rows is read a block at a time."""
        if not self.is_reader:
            raise RuntimeError("JobReads.read: only process 0 reads; the others serve")
        shape, count = self.shapes[tensor], self.layers[tensor]
        if layer is None and count > 1:
            parts = [self.read(tensor, i) for i in range(count)]
            return np.stack(parts) if self.stacked[tensor] else np.concatenate(parts).reshape(shape)
        self.dp.broadcast([tensor, -1 if layer is None else layer])
        whole = self._one(tensor, layer)
        return whole.reshape(shape[1:]) if self.stacked[tensor] else whole.reshape((-1,) + shape[1:])

    def _one(self, tensor: int, layer: Optional[int]) -> np.ndarray:
        size = math.prod(self.shapes[tensor]) // self.layers[tensor]  # of one layer (block)
        return self.dp.gather_one(self.read_slice(tensor, layer), size)

    def __enter__(self) -> "JobReads":
        if not self.is_reader:
            while True:
                tensor, layer = self.dp.broadcast([0, 0])
                if tensor == self._STOP:
                    break
                self._one(tensor, None if layer < 0 else layer)
        return self

    def __exit__(self, *exc) -> None:
        if self.is_reader:
            self.dp.broadcast([self._STOP, 0])


class JobWeightReaders:
    """A job's :class:`~jaxascend.offload.weight_readers.WeightReaders`: each process holds a
    slice of every tensor, so process 0 reads whole tensors while the others serve their slices
    (:class:`JobReads`), one tensor (one layer) whole at a time; the others get None. What a
    process reads of its own (``local_params``, ``compute``) is ``readers``' own."""

    def __init__(self, readers, dp: DataParallel):
        self._readers, self._dp = readers, dp

    @property
    def paths(self) -> list[tuple[str, ...]]:
        return self._readers.paths

    def local_params(self):
        return self._readers.local_params()

    def compute(self):
        return self._readers.compute()

    @contextlib.contextmanager
    def sampled(self):
        """The compute params on process 0 (None on the others); the layers the parameter source
        serves (streamed, or this process's slices in host buffers) are gathered from every
        process's slices as process 0 reads them."""
        readers = self._readers
        if not readers.served:
            yield readers.compute() if self._dp.partition.index == 0 else None
            return
        readers.finish()  # on every process: its gather is a collective, and the served layers must be new
        with self._reads(readers.read_served) as reads:
            yield readers.compute_reader(lambda leaf, layer: reads.read(leaf.index, layer)) if reads.is_reader else None

    def master(self):
        raise RuntimeError("offload: a job's weights are read through exported_weights() on every process")

    @contextlib.contextmanager
    def exported(self):
        """A reader of the fp32 master weights on process 0 (None on the others, which serve their
        slices of each tensor process 0 reads, gathered one tensor, or one layer, at a time)."""
        readers = self._readers
        readers.finish()
        with self._reads(readers.read_master) as reads:
            yield readers.reader(lambda leaf, layer: reads.read(leaf.index, layer), " to export") \
                if reads.is_reader else None

    def _reads(self, read_slice: Callable) -> JobReads:
        """Process 0's whole-tensor reads of what ``read_slice(leaf, layer)`` reads of this
        process's slices."""
        leaves = self._readers.leaves
        return JobReads(self._dp, lambda index, layer: read_slice(leaves[index], layer).reshape(-1),
                        self._readers.full_shapes, [leaf.layers for leaf in leaves], [leaf.stacked for leaf in leaves])


def _rows_spec(axis: int) -> P:
    """Sharded over every device (process-major) on ``axis``, whole on the axes before it."""
    return P(*([None] * axis), (AXIS, LOCAL))


def local_value(x) -> np.ndarray:
    """The value of a replicated global array, as this process holds it."""
    return np.asarray(x.addressable_shards[0].data)
