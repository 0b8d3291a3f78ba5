"""The forward/backward step with instant gradient offload.

Every parameter leaf gets a tensor id (its index in the flattened parameter tree). Leaves of the
layer stack are wrapped in :func:`~jaxascend.offload.grad_sink.offload_on_backward` inside the layer scan,
one layer at a time; the other leaves (embeddings, final norm, head) are wrapped before the model
is assembled. The loss is differentiated with respect to small "probe" arrays only, so

* each gradient leaves for the sink (the SSD store) the moment the backward pass computes it,
  in the compute dtype, and the full gradient tree never exists;
* the step returns, per leaf (and per layer), ``[sum of squares, non-finite count]`` of the
  gradient: the overflow check and the global norm for clipping, with no extra pass or buffer.

    routing = SinkRouting.for_params(params, stack_key="layers")
    step = make_offload_step(graphdef, rest, routing, handle)
    loss, stats = step(params, tokens, loss_scale)    # gradients are already on their way to SSD
    sumsq, nonfinite = total_stats(stats)
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxascend.offload.grad_sink import PROBE_SIZE, offload_on_backward, sink_gradient


@dataclasses.dataclass(frozen=True)
class LeafRoute:
    """Where one parameter leaf's gradient goes."""

    key: str  # jax.tree_util.keystr of the leaf's path in the parameter state
    tensor: int  # tensor id passed to the sink (index in the flattened parameter tree)
    layers: int  # > 0 for leaves of the layer stack (their leading axis), 0 otherwise
    shape: tuple[int, ...]
    dtype: Any


@dataclasses.dataclass(frozen=True)
class SinkRouting:
    """Tensor ids for every parameter leaf, split into layer-stack and top-level leaves."""

    stack_key: str
    routes: tuple[LeafRoute, ...]

    @classmethod
    def for_params(cls, params: nnx.State, stack_key: str) -> "SinkRouting":
        """``stack_key`` is the attribute holding the scanned layers ('layers' for the Llama
        family, 'h' for GPT-2); its leaves have a leading layer axis."""
        flat, _ = jax.tree_util.tree_flatten_with_path(params)
        routes = []
        for tensor, (path, leaf) in enumerate(flat):
            stacked = _first_key(path) == stack_key
            routes.append(LeafRoute(_layer_key(path) if stacked else jax.tree_util.keystr(path), tensor,
                                    int(leaf.shape[0]) if stacked else 0, tuple(leaf.shape), leaf.dtype))
        if not any(r.layers for r in routes):
            raise ValueError(f"model parameters have no layer stack under {stack_key!r}")
        return cls(stack_key, tuple(routes))

    def probes(self) -> dict[str, jax.Array]:
        """Zero probes: f32[L, 2] per stacked leaf, f32[2] per other leaf."""
        return {r.key: jnp.zeros(((r.layers,) if r.layers else ()) + (PROBE_SIZE,), jnp.float32)
                for r in self.routes}

    def by_key(self) -> dict[str, LeafRoute]:
        return {r.key: r for r in self.routes}


def _first_key(path) -> str:
    entry = path[0]
    return str(getattr(entry, "key", getattr(entry, "name", entry)))


def _layer_key(path) -> str:
    """Key of a stacked leaf as seen inside the scan (its path without the stack attribute)."""
    return "layer:" + jax.tree_util.keystr(path[1:])


def make_offload_step(graphdef: nnx.GraphDef, rest: nnx.State, routing: SinkRouting, sink: int,
                      loss_fn) -> Any:
    """A jitted ``step(params, tokens, loss_scale) -> (loss, stats)`` (with ``step.lower``).

    ``loss_fn(model, tokens, layer_hook)`` returns the scalar loss of one batch. ``stats`` maps each
    leaf key to its probe's gradient (``[..., 2]``: sum of squares, non-finite count) of the
    *scaled* gradient. ``loss`` is unscaled. On the CPU backend the layer stack's 16-bit leaves
    enter the jitted function as uint16 views of the same buffers (see :func:`stacked_as_bits`).
    """
    routes = routing.by_key()

    def hook_leaf(key, x, probe, layer=0):
        route = routes[key]
        return offload_on_backward(x, probe, sink=sink, tensor=route.tensor, layer=layer)

    def scaled_loss(probes, params, tokens, loss_scale, bit_dtypes):
        def top(path, x):
            if _first_key(path) == routing.stack_key:
                return x
            key = jax.tree_util.keystr(path)
            return hook_leaf(key, x, probes[key])

        params = jax.tree_util.tree_map_with_path(top, params)
        float_dtypes = dict(bit_dtypes)

        def layer_hook(layer_params, index):
            def one(path, x):
                key = "layer:" + jax.tree_util.keystr(path)
                if key in float_dtypes:  # this layer's slice, back from raw bits
                    x = jax.lax.bitcast_convert_type(x, float_dtypes[key])
                return hook_leaf(key, x, probes[key][index], layer=index)

            return jax.tree_util.tree_map_with_path(one, layer_params)

        model = nnx.merge(graphdef, params, rest)
        loss = loss_fn(model, tokens, layer_hook)
        return loss * loss_scale.astype(loss.dtype), loss

    grad_of_probes = jax.value_and_grad(scaled_loss, has_aux=True)

    @partial(jax.jit, static_argnames="bit_dtypes")
    def jitted(params, tokens, loss_scale, bit_dtypes=()):
        (_, loss), stats = grad_of_probes(routing.probes(), params, tokens, loss_scale, bit_dtypes)
        return loss, stats

    return _OffloadStep(jitted, routing, use_bits=jax.default_backend() == "cpu")


class _OffloadStep:
    """The step :func:`make_offload_step` returns: calls (or lowers) the jitted function, on CPU
    with the layer stack's 16-bit leaves as raw bits (:func:`stacked_as_bits`)."""

    def __init__(self, jitted, routing: SinkRouting, use_bits: bool):
        self._jitted = jitted
        self._routing = routing
        self._use_bits = use_bits

    def _args(self, params):
        if not self._use_bits:
            return params, ()
        return stacked_as_bits(params, self._routing)

    def __call__(self, params, tokens, loss_scale):
        params, bit_dtypes = self._args(params)
        return self._jitted(params, tokens, loss_scale, bit_dtypes=bit_dtypes)

    def lower(self, params, tokens, loss_scale):
        params, bit_dtypes = self._args(params)
        return self._jitted.lower(params, tokens, loss_scale, bit_dtypes=bit_dtypes)


def stacked_as_bits(params, routing: SinkRouting) -> tuple[Any, tuple[tuple[str, str], ...]]:
    """The layer stack's 16-bit float leaves as uint16 arrays sharing their buffers, and
    ``((key, dtype name), ...)`` to turn each layer's slice back inside the scan.

    Why: XLA's CPU backend computes in fp32 whatever it cannot do in bf16/fp16, and its
    float-normalization pass treats the layer scan's ``dynamic-slice`` of a stacked bf16 weight
    that way: it converts the *whole stack* to fp32 once per step (4 B/param of temporaries;
    1.75 GB for a 0.5B model) just to slice one layer out of it. Sliced as integers, the stack
    stays as it is and only the current layer is ever widened. The bitcast is done here, outside
    XLA, where it is free for a CPU array (``np.asarray`` shares the buffer and ``device_put``
    with ``may_alias`` keeps sharing it); inside XLA it would be a copy of the stack. The
    parameters are not differentiated by the step (the probes are), so the integer detour
    costs no gradient.
    """
    leaves, treedef = jax.tree.flatten(params)
    if len(leaves) != len(routing.routes):
        raise ValueError(f"offload step: params have {len(leaves)} leaves, the routing has {len(routing.routes)}")
    out, bit_dtypes = [], []
    for x, route in zip(leaves, routing.routes):
        dtype = jnp.dtype(x.dtype)
        if route.layers and dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating):
            out.append(_uint16_view(x))
            bit_dtypes.append((route.key, dtype.name))
        else:
            out.append(x)
    return treedef.unflatten(out), tuple(bit_dtypes)


def _uint16_view(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, jnp.uint16)
    if isinstance(x, np.ndarray):
        return x.view(np.uint16)
    devices = x.devices() if isinstance(x, jax.Array) else ()
    if len(devices) == 1 and next(iter(devices)).platform == "cpu":
        device = next(iter(devices))
        return jax.device_put(np.asarray(x).view(np.uint16), device, may_alias=True)
    return jax.lax.bitcast_convert_type(x, jnp.uint16)  # elsewhere: a copy, still correct


def total_stats(stats: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Sums per-leaf probe statistics into ``(sum of squares, non-finite count)``."""
    sumsq = sum(jnp.sum(s[..., 0]) for s in stats.values())
    nonfinite = sum(jnp.sum(s[..., 1]) for s in stats.values())
    return sumsq, nonfinite


def make_accumulating_offload_step(graphdef: nnx.GraphDef, rest: nnx.State, routing: SinkRouting, sink: int,
                                   loss_fn) -> Any:
    """Gradient accumulation with the sink: ``step(params, tokens[A, B, T+1], loss_scale)``.

    The ``A`` micro-batches' gradients are summed in a float32 accumulator (4 B/param in the
    device memory kind; on a CPU-only machine that is host RAM), averaged, cast to the compute
    dtype and sent to the sink leaf by leaf, layer by layer. Only ``grad_accum > 1`` pays for
    the accumulator; a single micro-batch uses :func:`make_offload_step`.
    """
    routes = routing.by_key()

    def scaled_loss(params, tokens, loss_scale):
        loss = loss_fn(nnx.merge(graphdef, params, rest), tokens, None)
        return loss * loss_scale.astype(loss.dtype), loss

    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

    def send(key, g):
        route = routes[key]
        if not route.layers:
            return sink_gradient(g, 0, sink=sink, tensor=route.tensor)
        return jax.lax.map(lambda xs: sink_gradient(xs[0], xs[1], sink=sink, tensor=route.tensor),
                           (g, jnp.arange(route.layers, dtype=jnp.int32)))

    @jax.jit
    def step(params, tokens, loss_scale):
        def micro(acc, micro_tokens):
            (_, loss), g = grad_fn(params, micro_tokens, loss_scale)
            return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g), loss

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        acc, losses = jax.lax.scan(micro, zeros, tokens)
        count = tokens.shape[0]
        stats = {}
        flat, _ = jax.tree_util.tree_flatten_with_path(acc)
        dtypes = [p.dtype for p in jax.tree.leaves(params)]
        for (path, a), dtype in zip(flat, dtypes):
            stacked = _first_key(path) == routing.stack_key
            key = _layer_key(path) if stacked else jax.tree_util.keystr(path)
            stats[key] = send(key, (a / count).astype(dtype))
        return losses.mean(), stats

    return step
