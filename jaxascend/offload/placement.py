"""Where a step runs, chosen once from the step's plan (:func:`placement_of`): on one device
(:class:`OneDevice`), on this process's devices (:class:`LocalDevices`, the mesh ``[1, D]``), or
across the processes of a job (:class:`Job`, ``[P, D]``). The engine's parts (the compute
weights, the gradient routing, the step builder, the weight readers) ask the placement and never
test which one they have:

    placement = placement_of(plan)
    spec = placement.local_spec(full_spec, stacked, row_blocks)    # the state this process holds
    x = placement.input(leaf, as_bits)                             # a weight as the step takes it
    batch = placement.rows(batch, axis=1)                          # this process's rows, the job's arrays
    step = placement.compile_step(local_step, routing, bit_dtypes) # jitted; shard_map'ed over a mesh
    leaves = placement.assemble(slices, shapes, layers, as_bits)   # an update's new leaves, whole again

What it owns:

* replication and gathering: the step's inputs (replicated global arrays over a mesh), an
  update's slices made whole (:meth:`Job.assemble`), a job's host buffers and readers;
* splitting rows (:meth:`rows`) and the state (:meth:`local_spec`, the initial state, host buffers);
* the reduce-scatter and "first device only": :attr:`share`, how a gradient reaches the sink
  (:class:`~jaxascend.offload.grad_sink.WholeGradient` or ``GradientScatter``), and the fetch of
  a served layer (:meth:`layer_fetch`);
* the 16-bit-as-uint16 encoding (:mod:`~jaxascend.offload.raw_bits`): viewed at each call on one
  device, held as bits from the start over a mesh;
* the collective order (:mod:`~jaxascend.offload.collective_order`): the ordered sink hooks
  (:meth:`choose`), the job's sums of the loss and of an evaluation, the table's uses;
* the host-callback choice (:attr:`native`, a :class:`~jaxascend.offload.native_path.NativePath`
  of the plan's ``host_callbacks``; for a step built without a plan, the environment's): how a
  gradient reaches its sink, a layer is fetched, and a jitted step is called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxascend.offload import collective_order
from jaxascend.offload.grad_sink import GradientScatter, GradientShare, WholeGradient
from jaxascend.offload.partition import AXIS, LOCAL, DataParallel, JobWeightReaders, Partition, local_value
from jaxascend.offload.native_path import NativePath, native_path
from jaxascend.offload.state import to_default_device
from jaxascend.offload.step_plan import StepPlan


class Placement(Protocol):
    """What the engine's parts ask of where the step runs (see the module doc)."""

    partition: Partition  # this process's slice of every tensor's state ((0, 1): all of it)
    devices: int  # the devices the rows are split over
    native: NativePath  # how jitted code reaches the native side (the host-callback choice)
    share: GradientShare  # how a gradient reaches the sink, inside the backward

    def local_spec(self, spec, stacked: Callable[[tuple], bool], row_blocks=None):
        """The state's leaves as this process holds them (``Partition.local_spec``)."""

    def write_initial_state(self, state, params, read: Optional[Callable], compute: Callable) -> None:
        """This process's initial state: from ``read(leaf, layer)`` (whole layers) or ``params``."""

    def host_buffer(self, whole: np.ndarray) -> np.ndarray:
        """A stacked leaf's host buffer (flat) from its whole value: every layer, or this process's slices."""

    def whole_host(self, buffer: np.ndarray, shape: tuple, layers: int, local_shape: tuple) -> np.ndarray:
        """A host buffer as the whole leaf (a job's: gathered, a collective of every process)."""

    def readers(self, readers):
        """The weight readers of this placement over a process's own ``readers``."""

    def input(self, x, as_bits: bool):
        """A leaf's value (the same on every process) as the step takes it."""

    def restored_input(self, x, as_bits: bool):
        """A restored leaf's value as the step takes it."""

    def local(self, x, dtype=None):
        """A step input as this process holds it (``dtype``: the float dtype of a leaf held as bits)."""

    def local_values(self, tree):
        """The step's (replicated) outputs as this process holds them."""

    def assemble(self, slices: Sequence, shapes: Sequence[tuple], layers: Sequence[int],
                 as_bits: Sequence[bool]) -> list:
        """An update's new leaves (this process's slices) as the step takes them."""

    def rows(self, batch, axis: int = 0):
        """A global batch as the step takes it (rows on ``axis``)."""

    def choose(self, one_device, collectives):
        """``one_device``, or ``collectives`` where the step runs collectives (in one order)."""

    def table_uses(self, uses: tuple[str, ...], large: bool) -> tuple[str, ...]:
        """The token table's uses that send their own gradients."""

    def layer_fetch(self, read: Callable, specs: Sequence, wholes: Sequence) -> Callable:
        """``fetch(index)``: one served layer of every leaf, whole, from ``read(index)`` (this process's)."""

    def compile_step(self, step: Callable, routing, bit_dtypes: tuple) -> Any:
        """``step(params, tokens, loss_scale, bit_dtypes)`` jitted: ``(params, tokens, loss_scale) -> (loss, stats)``."""

    def compile_eval(self, evaluate: Callable, routing, bit_dtypes: tuple) -> Any:
        """``evaluate(params, batch, bit_dtypes)`` jitted: ``(params, batch) -> (loss sum, count)``."""


def placement_of(plan: StepPlan) -> Placement:
    """The placement of ``plan``'s step (its ``partition``, ``local_devices`` and
    ``host_callbacks``): the one place it is decided."""
    if plan.partition is None:
        return OneDevice(plan.host_callbacks)
    mesh = DataParallel(plan.partition, plan.local_devices)
    return (Job if plan.partitioned else LocalDevices)(mesh, plan.host_callbacks)


class _WholeState:
    """The state of a process that holds every tensor whole (one device, or this process's devices)."""

    def local_spec(self, spec, stacked, row_blocks=None):
        return spec

    def write_initial_state(self, state, params, read, compute) -> None:
        if read is None:
            state.init(params)  # fp32 master weights from the loaded/initialised params
        else:
            state.init_from(read, compute=compute)

    def host_buffer(self, whole: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(whole).reshape(-1).copy()

    def whole_host(self, buffer, shape, layers, local_shape) -> np.ndarray:
        return buffer.reshape(local_shape)

    def readers(self, readers):
        return readers


@dataclass(frozen=True)
class OneDevice(_WholeState):
    """One device: the step's inputs are its arrays, the whole gradient goes to the sink, no
    collective runs; the 16-bit stack (and a large table) is viewed as raw bits at each call,
    unless the native side is reached through host callbacks."""

    via_host: Optional[bool] = None  # the plan's host_callbacks; None: the environment's, when traced
    partition: ClassVar[Partition] = Partition(0, 1)
    devices: ClassVar[int] = 1

    @property
    def native(self) -> NativePath:
        return native_path(self.via_host)

    @property
    def share(self) -> WholeGradient:
        return WholeGradient(self.native.send)

    def input(self, x, as_bits: bool):
        return x

    def restored_input(self, x, as_bits: bool):
        # Placed as an update places its new leaves (uncommitted): a restored array committed to
        # its device would make the next step compile once more.
        return None if x is None else to_default_device(np.asarray(x))

    def local(self, x, dtype=None):
        return x

    def local_values(self, tree):
        return tree

    def assemble(self, slices, shapes, layers, as_bits) -> list:
        return list(slices)

    def rows(self, batch, axis: int = 0):
        return batch

    def choose(self, one_device, collectives):
        return one_device

    def table_uses(self, uses, large: bool) -> tuple[str, ...]:
        return uses

    def layer_fetch(self, read, specs, wholes):
        return read

    def compile_step(self, step, routing, bit_dtypes: tuple):
        jitted = jax.jit(step, static_argnames="bit_dtypes")
        return self.native.called(jitted, routing)

    compile_eval = compile_step


class LocalDevices(_WholeState):
    """This process's devices share the rows (the mesh ``[1, D]``, ``mesh``): the step runs under
    ``shard_map``, its inputs replicated (a 16-bit stack and a large table held as ``uint16``
    bits), each gradient summed over the devices and sent whole by the first device, which alone
    fetches the layers the parameter source serves; the state is this process's, whole."""

    def __init__(self, mesh: DataParallel, via_host: Optional[bool] = None):
        self.mesh, self.native = mesh, native_path(via_host)
        self.partition, self.devices = mesh.partition, mesh.devices
        self.share = GradientScatter(AXIS, mesh.partition.count, local=LOCAL if mesh.local_devices > 1 else None,
                                     native=self.native.send)

    def input(self, x, as_bits: bool):
        if x is None:
            return None
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x  # made whole by a gather already
        x = np.asarray(x)
        return self.mesh.replicate(x.view(np.uint16) if as_bits else x)

    restored_input = input

    def local(self, x, dtype=None):
        if x is None:
            return None
        x = local_value(x)
        return x if dtype is None else x.view(dtype)

    def local_values(self, tree):
        return jax.tree.map(local_value, tree)

    def assemble(self, slices, shapes, layers, as_bits) -> list:
        return [self.input(x, b) for x, b in zip(slices, as_bits)]

    def rows(self, batch, axis: int = 0):
        return self.mesh.shard_rows(batch, axis=axis)

    def choose(self, one_device, collectives):
        return collectives

    def table_uses(self, uses, large: bool) -> tuple[str, ...]:
        # A table not in blocks is sent whole, once, its uses summed by the backward: its head
        # use would otherwise be reduce-scattered beside the layers' (collective_order).
        return uses if large else ()

    def layer_fetch(self, read, specs, wholes):
        """The first device of each process fetches, its devices share the bytes; each leaf's
        collectives follow the previous leaf's (collective_order)."""
        def fetch(index):
            values = self.share.first_device(lambda: tuple(read(index)),
                                             lambda: tuple(jnp.zeros(s.shape, s.dtype) for s in specs))
            whole = collective_order.after_each(list(values), None, self._collect)
            return [x[:math.prod(w.shape)].reshape(w.shape) for x, w in zip(whole, wholes)]

        return fetch

    def _collect(self, x):
        """One leaf of a fetched layer, from the first device of the process."""
        return jax.lax.all_gather(x, self.share.local)[0] if self.share.local else x

    def compile_step(self, step, routing, bit_dtypes: tuple):
        axes = self.share.axes

        def local_step(params, tokens, loss_scale):
            loss, stats = step(params, tokens, loss_scale, bit_dtypes=bit_dtypes)
            # each process's loss is its rows' share of the job's: the last collective
            return jax.lax.psum(collective_order.after(loss, collective_order.token_of(stats)), axes), stats

        # the step's micro-batches [A, B, ...]: each process computes its rows (axis 1) of every one
        return self.mesh.batch_step(local_step, batch_axis=1, scalars=1)

    def compile_eval(self, evaluate, routing, bit_dtypes: tuple):
        axes = self.share.axes

        def summed(params, batch):
            loss_sum, count = evaluate(params, batch, bit_dtypes)
            loss_sum = jax.lax.psum(loss_sum, axes)
            after, token_of = collective_order.after, collective_order.token_of
            return loss_sum, jax.lax.psum(after(count, token_of(loss_sum)), axes)  # one after the other

        return self.mesh.batch_step(summed)


class Job(LocalDevices):
    """A job of processes (the mesh ``[P, D]``): as :class:`LocalDevices`, and each process holds
    its slice of every tensor's state (``partition``): the gradients are reduce-scattered over
    the processes, an update's new slices all-gathered into whole replicated weights, the served
    layers all-gathered inside the step, and process 0 reads whole tensors while the others serve
    (:class:`~jaxascend.offload.partition.JobWeightReaders`)."""

    def local_spec(self, spec, stacked, row_blocks=None):
        # this process's slices of every tensor (of every block of a large table)
        return self.partition.local_spec(spec, stacked, row_blocks)

    def write_initial_state(self, state, params, read, compute) -> None:
        full, take = jax.tree.leaves(params), self.partition.take

        def value(leaf, layer):  # this process's slice of each layer, from the reader or the params
            if read is not None:
                return read(leaf, layer)
            return _layer_of(np.asarray(full[leaf.index]), leaf, layer)

        state.init_from(lambda leaf, layer: take(value(leaf, layer)).astype(np.float32), compute=compute)

    def host_buffer(self, whole: np.ndarray) -> np.ndarray:
        take = self.partition.take
        return np.concatenate([take(whole[layer]) for layer in range(whole.shape[0])])

    def whole_host(self, buffer, shape, layers, local_shape) -> np.ndarray:
        return local_value(self.mesh.gather([buffer], [shape], [layers])[0])

    def readers(self, readers):
        return JobWeightReaders(readers, self.mesh)

    def assemble(self, slices, shapes, layers, as_bits) -> list:
        # every process's slices make the whole (replicated) weights again
        slices = [None if x is None else np.asarray(x).view(np.uint16) if b else np.asarray(x)
                  for x, b in zip(slices, as_bits)]
        return self.mesh.gather(slices, list(shapes), list(layers))

    def _collect(self, x):
        """One leaf's slice of a fetched layer, from every process: the whole layer (flat, padded)."""
        return jax.lax.all_gather(super()._collect(x).reshape(-1), AXIS, tiled=True)


def _layer_of(x: np.ndarray, leaf, layer: Optional[int]) -> np.ndarray:
    """One layer (or block of rows of a large table; None: all) of a leaf's whole value ``x``."""
    if leaf.row_blocks > 1:  # one block of rows of a large table
        rows = x.shape[0] // leaf.row_blocks
        return x[layer * rows:(layer + 1) * rows]
    return x if layer is None or not leaf.stacked else x[layer]
