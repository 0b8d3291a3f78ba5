"""Instant gradient offload: hand each gradient to a sink the moment the backward pass makes it.

The trick (see docs/architecture.md): wrap parameters in :func:`offload_on_backward`, an identity
``custom_vjp`` that takes an extra ``probe`` array. Differentiate the loss with respect to the
probes only. The backward rule passes the parameters' cotangent to the side-effecting FFI target
``jaxascend_grad_sink`` (which copies it out and computes its statistics) and returns those
statistics as the probe's "gradient". Inside ``lax.scan`` this runs once per layer, so the full
gradient tree never exists and the jitted step outputs only a few bytes per tensor.

    probes = jnp.zeros((2,), jnp.float32)       # [sumsq, nonfinite]
    def loss(probes):
        w_ = offload_on_backward(w, probes, sink=handle, tensor=0)
        return f(w_)
    stats = jax.grad(loss)(probes)              # stats[0] = |dw|^2, stats[1] = #inf/nan in dw

Data parallel (``scatter=GradientScatter(axis, parts)``, inside ``jax.shard_map`` over ``axis``):
each shard's cotangent is its own batch rows' contribution; the backward rule reduce-scatters it
over the axis (``psum_scatter``, the flat gradient zero-padded to a multiple of ``parts``), so
shard ``i`` sends only slice ``i`` of the summed gradient to its own sink (the state it owns), and
the statistics are summed over the axis, so every shard sees the global overflow count and norm.
The full gradient exists on no shard. With several devices per process (``local``, a second mesh
axis) each device's slice is also summed over its process's devices, and the first device of
each process alone sends it. The ``shard_map`` must have ``check_vma=False``: with the
check on, JAX sums the cotangent of a replicated parameter over the axis by itself before this
rule sees it (an all-reduce, and the reduce-scatter would then count it twice).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp

from jaxascend.native import extension as _native
from jaxascend.offload.native_path import PROBE_SIZE, sink_gradient  # the environment's way, by default


MemorySink = _native.MemorySink

_SINK_PREFIX = "grad_sink:"  # how ffi/offload_grad_sink.cc starts every error it returns


class GradientSinkError(OSError):
    """A sink could not take a gradient during the backward pass (e.g. the SSD is full); the
    message is the sink's, naming the tensor, layer, file and offset."""


def fetch_step_outputs(outputs, more_errors=()):
    """``jax.device_get(outputs)`` of a step whose backward pass fed a gradient sink, with its
    errors translated as :func:`step_errors` does."""
    with step_errors(more_errors):
        return jax.device_get(outputs)


@contextlib.contextmanager
def step_errors(more_errors=()):
    """Around a step's dispatch and the fetch of its outputs (XLA may raise at either): a sink
    that failed makes the step fail with an XLA runtime error; it becomes a
    :class:`GradientSinkError` with the sink's own message (``more_errors``: further ``(message
    prefix, exception class)`` pairs of native calls inside the step, e.g. the parameter
    source's). The failed step's ordered-effect tokens are then dropped: JAX would otherwise
    raise the same error again, as tracebacks, from its exit handlers."""
    try:
        yield
    except jax.errors.JaxRuntimeError as err:
        text = str(err)
        for prefix, error in ((_SINK_PREFIX, GradientSinkError),) + tuple(more_errors):
            if prefix in text:
                _forget_failed_effects()
                raise error(text[text.index(prefix):].splitlines()[0]) from None
        raise


def _forget_failed_effects() -> None:
    # JAX has no public call for this: its runtime tokens keep the failed computation, and both
    # jax.effects_barrier() and its atexit hooks re-raise the failure until they are cleared.
    from jax._src import dispatch

    tokens = getattr(dispatch, "runtime_tokens", None)
    if tokens is not None and hasattr(tokens, "clear"):
        tokens.clear()


@dataclass(frozen=True)
class WholeGradient:
    """One device's way to the sink: the whole gradient, sent as it is (by ``native``: a native
    path's ``send``; :func:`sink_gradient`, the environment's, by default).
    :class:`GradientScatter` is the way of several devices; a step's placement
    (:mod:`~jaxascend.offload.placement`) chooses."""

    native: Callable = sink_gradient

    def send(self, g: jax.Array, layer, *, sink: int, tensor: int) -> jax.Array:
        """``g`` to the sink: its statistics."""
        return self.native(g, layer, sink=sink, tensor=tensor)


@dataclass(frozen=True)
class GradientScatter:
    """Reduce-scatter each gradient over the mesh axis ``axis`` of ``parts`` shards (see the
    module doc): the sink of shard ``i`` receives slice ``i`` of the flat, zero-padded sum.
    ``local``: the mesh's second axis, the several devices of each process (which owns one
    slice of the state): each device's slice is then summed over the process's devices as well,
    and the first device of each process alone sends it to the sink (by ``native``, as for
    :class:`WholeGradient`)."""

    axis: str
    parts: int
    local: Optional[str] = None
    native: Callable = sink_gradient

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the rows are split over: what the job's sums run over."""
        return (self.axis,) + ((self.local,) if self.local else ())

    def slice_size(self, size: int) -> int:
        """Elements of a ``size``-element gradient that each shard receives (the last zero-padded)."""
        return -(-size // self.parts)

    def __call__(self, g: jax.Array) -> jax.Array:
        flat = g.reshape(-1)
        pad = self.slice_size(flat.size) * self.parts - flat.size
        if pad:
            flat = jnp.pad(flat, (0, pad))
        if self.parts > 1:
            flat = jax.lax.psum_scatter(flat, self.axis, scatter_dimension=0, tiled=True)
        return jax.lax.psum(flat, self.local) if self.local else flat

    def first_device(self, send, otherwise):
        """``send()`` on the first device of each process, ``otherwise()`` on its others (the
        same on every device without a ``local`` axis): a native call a process makes once."""
        if not self.local:
            return send()
        return jax.lax.cond(jax.lax.axis_index(self.local) == 0, send, otherwise)

    def send(self, g: jax.Array, layer, *, sink: int, tensor: int) -> jax.Array:
        """:func:`sink_gradient` of ``g`` (this shard's contribution, under ``shard_map``) as data
        parallelism shares it: each process's slice of the summed gradient (the whole sum for
        one process), sent once by its first device; the statistics are those of the whole
        summed gradient, on every device."""
        mine = self(g)
        stats = self.first_device(lambda: self.native(mine, layer, sink=sink, tensor=tensor),
                                  lambda: jnp.zeros((PROBE_SIZE,), jnp.float32))
        return jax.lax.psum(stats, self.axes)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _offload_identity(x, probe, layer, sink, tensor, scatter):
    del probe, layer
    return x


def _offload_fwd(x, probe, layer, sink, tensor, scatter):
    del probe
    return x, layer


GradientShare = Union[WholeGradient, GradientScatter]  # how a placement sends a gradient: ``send(g, layer, ...)``


def _offload_bwd(sink, tensor, scatter, layer, g):
    stats = scatter.send(g, layer, sink=sink, tensor=tensor)
    # The parameter's own cotangent is dropped: nobody differentiates with respect to it, so XLA
    # eliminates the zeros; the layer index is an integer input (float0 cotangent).
    return jnp.zeros_like(g), stats, None


_offload_identity.defvjp(_offload_fwd, _offload_bwd)


def offload_on_backward(x: jax.Array, probe: jax.Array, *, sink: int, tensor: int,
                        layer: jax.Array | int = 0, scatter: GradientShare = WholeGradient()) -> jax.Array:
    """Identity on ``x``; on the backward pass ``x``'s cotangent goes to the sink and ``probe``
    (f32[2]) receives ``[sum of squares, non-finite count]`` of it.

    ``layer`` (an int32 scalar, may be traced, e.g. a scan counter) tells the sink where in the
    tensor's layer stack this slice belongs. ``scatter``: a :class:`GradientScatter`, data
    parallel: the cotangent is reduce-scattered first and the sink gets this shard's slice (see
    the module doc); by default the whole cotangent goes to the sink (:class:`WholeGradient`).
    """
    return _offload_identity(x, probe, jnp.asarray(layer, jnp.int32), int(sink), int(tensor), scatter)


def register_memory_sink(sink: "MemorySink") -> int:
    """Registers a :class:`MemorySink` and returns the handle FFI calls use."""
    return _native.register_memory_sink(sink)


def unregister_sink(handle: int) -> bool:
    return _native.unregister_sink(handle)
