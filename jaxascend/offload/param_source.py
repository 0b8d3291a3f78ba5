"""The parameter source: the layer scan's weights, read from SSD layer by layer.

With ``offload.params: ssd`` the compute-dtype weights of the layer stack live in the shard
store (one ``param`` region per leaf and layer, written by the optimizer step; see
:mod:`jaxascend.offload.layout`). Inside the jitted step, :func:`fetch_layer` asks the native
source (``ffi/offload_param_source.cc``) for layer ``L`` of every streamed leaf; native I/O
threads have read it into an arena slot ahead of the ask, in the order the step asks: layers
0..L-1 in the forward, L-1..0 when the backward recomputes each layer under remat. The call is
a *pure* FFI call: ``jax.checkpoint`` recomputes it in the backward like any other value (an
effectful call is refused by remat's partial evaluation), and the weights it returns do not
change during a step, so the recomputation returns the same bytes. Nothing differentiates
through it: the step's probes are its only differentiated inputs.

    source = state.param_source()              # owns the native source and its handle
    source.begin_step()                        # before each forward/backward: start reading layer 0..
    loss, stats = step(...)                    # the scan calls fetch_layer(source.handle, i, specs)
    jax.block_until_ready(loss); source.end_step()

Overlapped step (``offload.overlap``): the optimizer of step t runs in the background while
step t+1's forward/backward runs; :meth:`ParamSource.gate` marks every layer as not yet updated,
the optimizer calls :meth:`ParamSource.mark_ready` layer by layer, and a fetch of a layer waits
for that (``optimizer_wait_seconds``). With the weights resident in host memory the source
serves them from host buffers (``host=``) the optimizer writes in place, with the same gating.

On a GPU backend the FFI target (registered for the CPU platform) cannot run in device code:
:func:`fetch_layer` then goes through a ``pure_callback`` whose host side copies the layer out
of the (pinned) arena slot, and the runtime copies it to the device (on the CPU too with
``JAXASCEND_HOST_CALLBACKS=1``, see :func:`jaxascend.native.host_callbacks`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np

from jaxascend.native import extension as _native
from jaxascend.offload.layout import SOURCE_SLOT_CLASS, LeafLayout

_PREFIX = "param_source:"  # how ffi/offload_param_source.cc starts every error it returns


class ParamSourceError(OSError):
    """The source could not read a layer's weights (an I/O error or a damaged block)."""


# What grad_sink.step_errors turns into a one-line error when a step's native call failed.
PARAM_SOURCE_ERRORS = ((_PREFIX, ParamSourceError),)


class ParamSource:
    """Owns one native parameter source over the streamed leaves of an offloaded state."""

    def __init__(self, store, leaves: Sequence[LeafLayout], depth: int, records=None,
                 host: Optional[Sequence[np.ndarray]] = None):
        """``host``: one flat array per leaf (every layer, in the compute dtype) to serve instead
        of the leaves' SSD regions: the resident weights of an overlapped step. ``records``: the
        state's records part, which says where each layer is (``param_region``) and tells the
        source when a layer moves (``watch``: durable steps rotate a bfloat16 master's layers)."""
        if not leaves:
            raise ValueError("param source: no leaves to serve")
        self.leaves = tuple(leaves)
        self.depth = int(depth)
        self.num_layers = self.leaves[0].layers
        self._native = _native.ParamSource(store.handle, SOURCE_SLOT_CLASS)
        if host is not None:
            if len(host) != len(self.leaves):
                raise ValueError(f"param source: {len(host)} host buffers for {len(self.leaves)} leaves")
            for leaf, buf in zip(self.leaves, host):
                if buf.dtype != leaf.dtype or buf.size != leaf.size or not buf.flags.c_contiguous:
                    raise ValueError(f"param source: the host buffer of {leaf.path!r} is {buf.size} x {buf.dtype}; "
                                     f"expected a contiguous {leaf.size} x {leaf.dtype}")
                self._native.add_host_leaf(buf.reshape(-1).view(np.uint8), leaf.grad_layer_bytes, leaf.dtype.name)
        else:
            for leaf in self.leaves:
                if not leaf.streamed:
                    raise ValueError(f"param source: leaf {leaf.path!r} has no SSD weights (offload.params is not "
                                     f"'ssd'); pass host= buffers")
                names = [records.param_region(leaf, layer) if records is not None else name
                         for layer, name in enumerate(leaf.param_regions)]
                self._native.add_leaf([store.region(name).id for name in names], leaf.grad_layer_bytes,
                                      leaf.dtype.name)
        self._handle = _native.register_param_source(self._native)
        if host is None and records is not None:
            position = {leaf.index: k for k, leaf in enumerate(self.leaves)}
            records.watch(lambda leaf, layer, name: self._native.set_layer_region(
                position[leaf], layer, store.region(name).id) if not self.closed else None)
        # What one fetch returns: one layer of every streamed leaf, in leaf order.
        self.specs = tuple(jax.ShapeDtypeStruct(leaf.layer_shape, leaf.dtype) for leaf in self.leaves)

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise ValueError("param source: closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def step_order(self) -> list[int]:
        """The layers a forward/backward with remat asks for, in order."""
        layers = list(range(self.num_layers))
        return layers + layers[::-1]

    def begin_step(self, forward_only: bool = False) -> None:
        """Starts reading the first layers of the next forward/backward (after the optimizer
        step that wrote them); ``forward_only``: of a forward pass alone (an evaluation), which
        asks for each layer once."""
        order = list(range(self.num_layers)) if forward_only else self.step_order()
        self._native.begin(order, self.depth)

    def end_step(self) -> None:
        """Waits for any read still in flight and frees its slot (call once the step is done)."""
        self._native.drain()

    def gate(self, handover: bool = False) -> None:
        """An optimizer step is about to update every layer: fetches wait for :meth:`mark_ready`
        (or, with ``handover``, for the layer's :meth:`handover`)."""
        self._native.gate(bool(handover))

    def acquire_handover(self, layer: int):
        """``(slot, views)``: an arena slot to fill with layer ``layer``'s new weights (one uint8
        view per leaf), or None when none will be free (then :meth:`skip_handover`). While the
        read-ahead's slots hold layers handed over and the forward's next layer is one of them,
        it waits for the forward to take it (the update keeps at most ``depth`` layers ahead of
        the forward, and no layer is read back from SSD); it does not wait for a forward that is
        not running, nor after :meth:`end_handover_waits`."""
        slot = self._native.acquire_handover(int(layer))
        if slot < 0:
            return None
        return slot, list(self._native.handover_views(slot))

    def end_handover_waits(self) -> None:
        """No forward will take the layers handed over (the update is joined without one): an
        :meth:`acquire_handover` waiting returns None, as do those to come until the next :meth:`gate`."""
        self._native.end_handover_waits()

    def handover(self, layer: int, slot: int) -> None:
        """The slot holds layer ``layer``'s new weights: the next forward takes them from there
        (no SSD read). The views of the slot must not be used after this."""
        self._native.handover(int(layer), int(slot))

    def skip_handover(self, layer: int) -> None:
        """Layer ``layer`` is not handed over: the forward reads it from SSD once it is ready."""
        self._native.skip_handover(int(layer))

    def mark_ready(self, layer: int) -> None:
        """Layer ``layer`` holds its new weights (in host memory, or on SSD for region leaves)."""
        self._native.mark_ready(int(layer))

    def fail(self, message: str) -> None:
        """The optimizer step failed: fetches waiting for a layer fail with ``message``."""
        self._native.fail(str(message))

    def ready(self, layer: int) -> bool:
        return bool(self._native.ready(int(layer)))

    def take_events(self) -> list[tuple[int, float, float]]:
        """``(layer, asked, served)`` of every fetch since the last call, in ``time.perf_counter``
        seconds: when the layer scan asked for a layer and when it had it (the step's timeline)."""
        return [tuple(e) for e in self._native.take_events()]

    def stats(self) -> dict:
        """``fetches``, ``misses`` (asks the order did not foresee, read synchronously),
        ``bytes_read``, ``wait_seconds`` (time the step waited for the disk),
        ``optimizer_wait_seconds`` (time it waited for the previous step's optimizer to update
        a layer), ``bytes_copied`` (host leaves), ``handovers`` and ``handover_skips`` (layers the
        optimizer handed to the forward in memory, or could not for want of a slot),
        ``handover_wait_seconds`` (time the optimizer waited for the forward to free a slot), since creation."""
        return dict(self._native.stats())

    def close(self) -> None:
        if self._handle is not None:
            _native.unregister_param_source(self._handle)
            self._handle = None


