"""The forward/backward step with instant gradient offload.

Every parameter leaf gets a tensor id (its index in the flattened parameter tree). Leaves of the
layer stack are wrapped in :func:`~jaxascend.offload.grad_sink.offload_on_backward` inside the layer scan,
one layer at a time; the other leaves (embeddings, final norm, head) are wrapped before the model
is assembled. The loss is differentiated with respect to small "probe" arrays only, so

* each gradient leaves for the sink (the SSD store) the moment the backward pass computes it,
  in the compute dtype, and the full gradient tree never exists;
* the step returns, per leaf (and per layer), ``[sum of squares, non-finite count]`` of the
  gradient: the overflow check and the global norm for clipping, with no extra pass or buffer.

    routing = LeafRoutes.for_params(params, stack_key="layers")
    step = make_offload_step(graphdef, rest, routing, handle)
    loss, stats = step(params, tokens, loss_scale)    # gradients are already on their way to SSD
    sumsq, nonfinite = total_stats(stats)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxascend.models import loss_sum_and_count
from jaxascend.offload.collective_order import offload_leaves_on_backward
from jaxascend.offload.grad_sink import offload_on_backward
from jaxascend.offload.native_path import PROBE_SIZE
from jaxascend.offload.placement import OneDevice, Placement


@dataclasses.dataclass(frozen=True)
class LeafRoute:
    """Where one parameter leaf's gradient goes."""

    key: str  # jax.tree_util.keystr of the leaf's path in the parameter state
    tensor: int  # tensor id passed to the sink (index in the flattened parameter tree)
    layers: int  # > 0 for leaves of the layer stack (their leading axis), 0 otherwise
    shape: tuple[int, ...]
    dtype: Any


@dataclasses.dataclass(frozen=True)
class LeafRoutes:
    """Tensor ids for every parameter leaf, split into layer-stack and top-level leaves."""

    stack_key: str
    routes: tuple[LeafRoute, ...]
    table_key: Optional[str] = None  # the token table, when its uses send their gradients themselves
    table_uses: tuple[str, ...] = ()  # ("lookup",) or, tied, ("lookup", "head"): the sink sums them
    table_blocks: int = 1  # blocks of rows the table's gradient arrives in (models.vocab)
    table_as_bits: bool = False  # large: on CPU the step hands it to the model as raw bits

    @classmethod
    def for_params(cls, params: nnx.State, stack_key: str, table: Optional[tuple[str, ...]] = None,
                   table_uses: tuple[str, ...] = (), table_blocks: int = 1,
                   table_as_bits: bool = False) -> "LeafRoutes":
        """``stack_key`` is the attribute holding the scanned layers ('layers' for the Llama
        family, 'h' for GPT-2); its leaves have a leading layer axis. ``table``: the path of the
        token table, whose gradient arrives in ``table_blocks`` blocks of rows; with
        ``table_uses`` each use (the lookup and, tied, the head) wraps its blocks itself through
        the model's ``table_hook`` and the sink sums the uses."""
        flat, _ = jax.tree_util.tree_flatten_with_path(params)
        routes = []
        for tensor, (path, leaf) in enumerate(flat):
            stacked = _first_key(path) == stack_key
            routes.append(LeafRoute(_layer_key(path) if stacked else jax.tree_util.keystr(path), tensor,
                                    int(leaf.shape[0]) if stacked else 0, tuple(leaf.shape), leaf.dtype))
        if not any(r.layers for r in routes):
            raise ValueError(f"model parameters have no layer stack under {stack_key!r}")
        table_key = None
        if table is not None:
            prefix = "".join(f"[{k!r}]" for k in table)  # a Variable's key may add ".value"
            found = [r.key for r in routes if r.key == prefix or r.key.startswith(prefix + ".")]
            if len(found) != 1:
                raise ValueError(f"model parameters have no table {'.'.join(table)!r}")
            table_key = found[0]
        uses = tuple(table_uses) if table_key else ()
        return cls(stack_key, tuple(routes), table_key, uses, int(table_blocks), bool(table_as_bits and uses))

    @property
    def table_tensor(self) -> Optional[int]:
        return self.by_key()[self.table_key].tensor if self.table_key else None

    def arrivals(self) -> Optional[dict[int, int]]:
        """Gradients per layer the sink sums, for the table whose uses send them (else None)."""
        return {self.table_tensor: len(self.table_uses)} if self.table_uses else None

    def probes(self) -> dict[str, jax.Array]:
        """Zero probes: f32[L, 2] per stacked leaf, f32[2] per other leaf; a table whose uses
        send their own gradients has one probe per use, f32[blocks, 2] when in blocks."""
        probes = {r.key: jnp.zeros(((r.layers,) if r.layers else ()) + (PROBE_SIZE,), jnp.float32)
                  for r in self.routes if not (r.key == self.table_key and self.table_uses)}
        blocks = (self.table_blocks,) if self.table_blocks > 1 else ()
        probes.update({f"{self.table_key}|{use}": jnp.zeros(blocks + (PROBE_SIZE,), jnp.float32)
                       for use in self.table_uses})
        return probes

    def by_key(self) -> dict[str, LeafRoute]:
        return {r.key: r for r in self.routes}

    def is_stacked(self, path) -> bool:
        """Whether the leaf at tree path ``path`` belongs to the layer stack."""
        return _first_key(path) == self.stack_key


def _first_key(path) -> str:
    entry = path[0]
    return str(getattr(entry, "key", getattr(entry, "name", entry)))


def _layer_key(path) -> str:
    """Key of a stacked leaf as seen inside the scan (its path without the stack attribute)."""
    return "layer:" + jax.tree_util.keystr(path[1:])


class _SinkHooks:
    """The identities that send each leaf's gradient to the sink in the backward pass: the
    top-level leaves wrapped before the model is assembled, each layer's inside the scan, each
    block of each use of the token table as the model computes it. One set per trace of the step."""

    def __init__(self, routing: LeafRoutes, sink: int, scatter):
        self.routing, self.sink, self.scatter = routing, sink, scatter  # scatter: the placement's share
        self.routes = routing.by_key()

    def _hook(self, key, x, probe, layer=0):
        return offload_on_backward(x, probe, sink=self.sink, tensor=self.routes[key].tensor, layer=layer,
                                   scatter=self.scatter)

    def top_leaves(self, params, probes):
        routing = self.routing

        def top(path, x):
            if routing.is_stacked(path):
                return x
            key = jax.tree_util.keystr(path)
            if key == routing.table_key and routing.table_uses:  # wrapped per use and block by table_hook
                return x
            return self._hook(key, x, probes[key])

        return jax.tree_util.tree_map_with_path(top, params)

    def layer_hook(self, probes, layer_weights):
        def hook(layer_params, index):
            def one(path, x):
                key = "layer:" + jax.tree_util.keystr(path)
                return self._hook(key, x, probes[key][index], layer=index)

            return jax.tree_util.tree_map_with_path(one, layer_weights(layer_params, index))

        return hook

    def table_hook(self, probes, table_block):
        routing = self.routing

        def hook(block, use, index):  # each block of each use sends its own gradient
            probe = probes[f"{routing.table_key}|{use}"]
            return self._hook(routing.table_key, table_block(block), probe[index] if routing.table_blocks > 1
                              else probe, layer=index)

        return hook


class _OrderedSinkHooks(_SinkHooks):
    """The hooks of a data-parallel step, whose gradients are reduce-scattered on their way to
    the sink: every collective of the backward in one order (:mod:`~jaxascend.offload.collective_order`).

    The loops order themselves: the head's blocks before the layers (which need the head's input
    gradient), the layers one after another (each layer's leaves in a chain), the lookup's blocks
    after the layers. The top-level leaves (final norm, a separate head, position embeddings, a
    token table not sent by blocks) are one group, sent in a chain once every one of their
    gradients exists and once the table's blocks have passed back the group's token (the lookup
    is the backward's last loop), so none of them runs beside a loop's collectives."""

    def __init__(self, routing: LeafRoutes, sink: int, scatter):
        super().__init__(routing, sink, scatter)
        self.token = None  # the top-level group's, which every table block passes back in the backward

    def _group(self, keys, xs, probes, layer=0, order=None):
        return offload_leaves_on_backward(xs, probes, sink=self.sink, tensors=[self.routes[k].tensor for k in keys],
                                          layer=layer, scatter=self.scatter, order=order)

    def top_leaves(self, params, probes):
        routing = self.routing
        flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: x is None)
        keys = [jax.tree_util.keystr(path) for path, _ in flat]
        chosen = [i for i, (path, x) in enumerate(flat) if x is not None and not routing.is_stacked(path)
                  and not (keys[i] == routing.table_key and routing.table_uses)]
        sent, self.token = self._group([keys[i] for i in chosen], [flat[i][1] for i in chosen],
                                       [probes[keys[i]] for i in chosen])
        leaves = [x for _, x in flat]
        for i, x in zip(chosen, sent):
            leaves[i] = x
        return treedef.unflatten(leaves)

    def layer_hook(self, probes, layer_weights):
        def hook(layer_params, index):
            flat, treedef = jax.tree_util.tree_flatten_with_path(layer_weights(layer_params, index))
            keys = ["layer:" + jax.tree_util.keystr(path) for path, _ in flat]
            sent, _ = self._group(keys, [x for _, x in flat], [probes[k][index] for k in keys], layer=index)
            return treedef.unflatten(sent)

        return hook

    def table_hook(self, probes, table_block):
        routing = self.routing

        def hook(block, use, index):  # after the layers' or the head's input gradient; passes the token back
            probe = probes[f"{routing.table_key}|{use}"]
            (sent,), _ = self._group([routing.table_key], [table_block(block)],
                                     [probe[index] if routing.table_blocks > 1 else probe], layer=index,
                                     order=self.token)
            return sent

        return hook


def make_offload_step(graphdef: nnx.GraphDef, rest: nnx.State, routing: LeafRoutes, sink: int,
                      loss_fn, source=None, placement: Placement = OneDevice(), bit_dtypes=()) -> Any:
    """A jitted ``step(params, tokens, loss_scale) -> (loss, stats)`` (with ``step.lower``).

    ``tokens``: the step's ``A`` micro-batches ``[A, B, ...]``, which each layer runs in turn
    (:mod:`jaxascend.models.micro_batches`), its gradient sent once per step.
    ``loss_fn(model, tokens, layer_hook)`` returns the scalar loss of one batch (with a tied table
    in the routing: ``loss_fn(model, tokens, layer_hook, table_hook)``, passing ``table_hook`` to
    the model, and the sink must sum 2 arrivals of that tensor). ``stats`` maps each
    leaf key to its probe's gradient (``[..., 2]``: sum of squares, non-finite count) of the
    *scaled* gradient. ``loss`` is unscaled. On the CPU backend the layer stack's 16-bit leaves
    enter the jitted function as uint16 views of the same buffers (see ``raw_bits.stacked_as_bits``).

    ``source``: a :class:`~jaxascend.offload.param_source.ParamSource` over every leaf of the layer
    stack (``offload.params: ssd``). The stacked leaves of ``params`` are then None: the scan
    fetches each layer's weights from the source (and, under remat, again in the backward).

    ``placement`` (:mod:`~jaxascend.offload.placement`; default: one device, the native side as
    the environment says): over several devices the step runs under ``shard_map``: ``params``
    are replicated global arrays, ``tokens`` the step's micro-batches ``[A, B, ...]`` as global
    arrays sharded by rows (axis 1), each gradient is reduce-scattered so the sink gets this
    process's slice, and the loss and statistics are the job's (summed). With a ``source`` in a
    job, it serves this process's slice of each layer, all-gathered into whole layers in the
    step. ``bit_dtypes`` (``((key, float dtype name), ...)``, see ``raw_bits.bit_leaves``) are
    the leaves ``params`` holds as raw ``uint16`` bits over several devices (on one device the
    step views them so itself).
    """
    stacked_keys = [r.key for r in routing.routes if r.layers]
    if source is not None and len(source.specs) != len(stacked_keys):
        raise ValueError(f"offload step: the parameter source serves {len(source.specs)} leaves, the layer "
                         f"stack has {len(stacked_keys)}")
    abstract, fetch = _stack_shapes(routing, source, placement)

    def scaled_loss(probes, params, tokens, loss_scale, bit_dtypes):
        # Collectives (several devices): every one of the backward in one order (see _OrderedSinkHooks).
        hooks = placement.choose(_SinkHooks, _OrderedSinkHooks)(routing, sink, placement.share)
        if abstract is not None:
            params = _with_abstract_stack(params, abstract)
        layer_weights, table_block = _weight_hooks(routing, fetch, stacked_keys, dict(bit_dtypes))
        model = nnx.merge(graphdef, hooks.top_leaves(params, probes), rest)
        layer_hook = hooks.layer_hook(probes, layer_weights)
        if routing.table_uses:
            loss = loss_fn(model, tokens, layer_hook, hooks.table_hook(probes, table_block))
        else:
            loss = loss_fn(model, tokens, layer_hook)
        return loss * loss_scale.astype(loss.dtype), loss

    grad_of_probes = jax.value_and_grad(scaled_loss, has_aux=True)

    def local_step(params, tokens, loss_scale, bit_dtypes=()):
        (_, loss), stats = grad_of_probes(routing.probes(), params, tokens, loss_scale, bit_dtypes)
        return loss, stats

    return placement.compile_step(local_step, routing, tuple(bit_dtypes))


def _stack_shapes(routing: LeafRoutes, source, placement: Placement):
    """(the layer stack's abstract leaves, ``fetch(index)`` of one layer's whole weights) of a
    step whose stack is read through ``source`` (else ``(None, None)``): the model sees whole
    layers, which the placement makes of what the source serves (over several devices the first
    device of each process fetches; in a job the source serves this process's slice of each
    layer, all-gathered inside the step)."""
    if source is None:
        return None, None
    stacked = [r for r in routing.routes if r.layers]
    wholes = [jax.ShapeDtypeStruct(r.shape[1:], spec.dtype) for r, spec in zip(stacked, source.specs)]
    shapes = iter(wholes)
    abstract = tuple(_stacked_spec(r.layers, next(shapes)) if r.layers else None for r in routing.routes)

    def read(index):
        return placement.native.fetch(source.handle, index, source.specs)

    return abstract, placement.layer_fetch(read, source.specs, wholes)


def _weight_hooks(routing: LeafRoutes, fetch, stacked_keys: list[str], float_dtypes: dict[str, str]):
    """``(layer_weights(layer_params, index), table_block(block))``: a layer's real weights
    inside the scan (``fetch(index)``: from the parameter source, see :func:`_stack_shapes`; or
    its slice back from raw bits) and a token-table block back from raw bits; what both the
    training step and the evaluation use."""

    def layer_weights(layer_params, index):
        fetched = {}
        if fetch is not None:  # this layer's weights, read from SSD (host buffers) ahead of the ask
            fetched = dict(zip(stacked_keys, fetch(index)))

        def one(path, x):
            key = "layer:" + jax.tree_util.keystr(path)
            if key in fetched:
                return fetched[key]
            if key in float_dtypes:  # this layer's slice, back from raw bits
                return jax.lax.bitcast_convert_type(x, float_dtypes[key])
            return x

        return jax.tree_util.tree_map_with_path(one, layer_params)

    def table_block(block):
        if routing.table_key in float_dtypes:  # this block, back from raw bits
            return jax.lax.bitcast_convert_type(block, float_dtypes[routing.table_key])
        return block

    return layer_weights, table_block


def make_offload_eval(graphdef: nnx.GraphDef, rest: nnx.State, routing: LeafRoutes, source=None,
                      placement: Placement = OneDevice(), bit_dtypes=()) -> Any:
    """A jitted ``evaluate(params, batch) -> (sum of the counted targets' losses, their count)``
    on the compute params, forward only: nothing is differentiated, so no gradient reaches the
    sink and the optimizer state is not read. ``params`` and ``source`` are as for
    :func:`make_offload_step` (streamed stacked leaves None, read layer by layer through the
    source, which the caller starts with ``begin_step(forward_only=True)``); on the CPU backend
    the stack enters as raw bits, as in the training step, so evaluating costs no fp32 copy of it.
    ``placement``: over several devices each process evaluates its rows of the batch (the job's
    global arrays), and the sums are the job's."""
    stacked_keys = [r.key for r in routing.routes if r.layers]
    abstract, fetch = _stack_shapes(routing, source, placement)

    def local(params, batch, bit_dtypes=()):
        if abstract is not None:
            params = _with_abstract_stack(params, abstract)
        float_dtypes = dict(bit_dtypes)
        layer_weights, table_block = _weight_hooks(routing, fetch, stacked_keys, float_dtypes)
        table_hook = (lambda block, use, index: table_block(block)) if routing.table_key in float_dtypes else None
        model = nnx.merge(graphdef, params, rest)
        return loss_sum_and_count(model, batch, layer_weights, table_hook)

    return placement.compile_eval(local, routing, tuple(bit_dtypes))


def _stacked_spec(layers: int, layer: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((layers,) + tuple(layer.shape), layer.dtype)


def _with_abstract_stack(params, abstract):
    """``params`` with each None leaf (a streamed leaf of the layer stack) replaced by its
    ``jax.ShapeDtypeStruct`` from ``abstract``: the model sees the stack's shapes, not its values."""
    leaves, treedef = jax.tree.flatten(params, is_leaf=lambda x: x is None)
    if len(leaves) != len(abstract):
        raise ValueError(f"offload step: params have {len(leaves)} leaves, the routing has {len(abstract)}")
    return treedef.unflatten([a if x is None else x for x, a in zip(leaves, abstract)])


def total_stats(stats: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Sums per-leaf probe statistics into ``(sum of squares, non-finite count)``."""
    sumsq = sum(jnp.sum(s[..., 0]) for s in stats.values())
    nonfinite = sum(jnp.sum(s[..., 1]) for s in stats.values())
    return sumsq, nonfinite
