"""The SSD gradient sink: the backward pass writes each layer's gradient into its store region.

:func:`jaxascend.offload.grad_sink.offload_on_backward` hands every layer's cotangent to a sink found by
an integer handle; the sink made here (``ffi/offload_store_sink.cc``) copies it into the SSD store's
arena staging slots and queues the disk write, so the gradient never exists on the host as a
whole. Each tensor id is routed to one store region per layer, exactly one layer long::

    targets = [SinkTarget(tensor=0, regions=("w/L0/grad", "w/L1/grad"), layer_bytes=2 * 4096,
                          dtype=jnp.bfloat16)]
    with register_store_sink(store, targets) as sink:
        step = jax.jit(...offload_on_backward(w[i], probe, sink=sink.handle, tensor=0, layer=i)...)
        jax.block_until_ready(step(...))      # the sink is called while the step runs
        store.flush()                         # every queued write is on disk; raises I/O errors
        sink.received(0)                      # [1, 1]: each layer arrived once

Errors inside the jitted step (unknown tensor, wrong dtype or size, a failed write) come back
as exceptions from the step whose message names the tensor and layer; a write that fails after
the sink returned surfaces at the next sink call or at :meth:`SsdStore.flush`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from jaxascend.native import extension as _native
from jaxascend.offload.grad_sink import unregister_sink
from jaxascend.ssd import SsdStore

NO_MIRROR = -1  # a layer whose gradient has no mirror (ffi/offload_store_sink.cc's kNoMirror)
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}


def _dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return "bfloat16"
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"store sink: gradient dtype {dtype} is not supported (float32, float16, bfloat16)")
    return _DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class SinkTarget:
    """Where tensor id ``tensor`` goes: layer ``l`` into region ``regions[l]`` (``layer_bytes``)."""

    tensor: int
    regions: tuple[str, ...]
    layer_bytes: int
    dtype: object  # the gradient dtype the backward pass produces (the compute dtype)
    arrivals: int = 1  # gradients per layer that the sink sums (2: a tied table's lookup and head)
    # none, or per layer the region each whole gradient is written to as well (None: that layer's not)
    mirrors: tuple[Optional[str], ...] = ()


class _RegisteredSink:
    """What every sink registered in the native handle table shares: the handle that
    ``offload_on_backward(sink=...)`` takes, per-layer receipt counters, and unregistering."""

    _kind = "gradient sink"

    def _register(self, native, handle: int, tensors: list[int]) -> None:
        self._native, self._handle, self._tensors = native, handle, tensors

    @property
    def handle(self) -> int:
        """The ``sink=`` argument of :func:`jaxascend.offload.grad_sink.offload_on_backward`."""
        if self._handle is None:
            raise ValueError(f"{self._kind} is closed")
        return self._handle

    @property
    def tensors(self) -> list[int]:
        return list(self._tensors)

    def received(self, tensor: int) -> list[int]:
        """Per layer, how many times the sink received ``tensor`` since :meth:`reset`."""
        return list(self._native.received(int(tensor)))

    def reset(self) -> None:
        """Zeroes the receipt counters (the optimizer step does this after it used the gradients)."""
        self._native.reset()

    # Receipts for the overlapped step (see ffi/offload_store_sink.cc). A sink without them
    # (the fp32 host buffer's) never runs beside an optimizer step, so these do nothing there.
    def hold(self) -> None:
        """Every region is being read by the optimizer: an arrival before :meth:`release` fails."""
        if hasattr(self._native, "hold"):
            self._native.hold()

    def release(self, tensor: int, layer: int) -> None:
        """The optimizer has read layer ``layer`` of ``tensor``: the next gradient may land there."""
        if hasattr(self._native, "release"):
            self._native.release(int(tensor), int(layer))

    def release_all(self) -> None:
        if hasattr(self._native, "release_all"):
            self._native.release_all()

    @property
    def early_arrivals(self) -> int:
        """Gradients refused because the optimizer had not read their region yet (0 unless the
        overlapped step's ordering broke)."""
        return int(getattr(self._native, "early_arrivals", 0))

    def close(self) -> None:
        """Unregisters the sink; later calls with its handle fail with an error. Idempotent."""
        if self._handle is not None:
            unregister_sink(self._handle)
            self._handle = None

    @property
    def closed(self) -> bool:
        return self._handle is None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"handle={self._handle}"
        return f"{type(self).__name__}({state}, tensors={len(self._tensors)})"


class StoreGradientSink(_RegisteredSink):
    """A registered store sink: its ``handle`` goes to :func:`offload_on_backward`.

    Unregister with :meth:`close` (or leave the ``with`` block) only after the last step that
    uses the handle has finished (``jax.block_until_ready``): the step calls the sink late.
    """

    _kind = "store gradient sink"

    def __init__(self, store: SsdStore, targets: Sequence[SinkTarget]):
        self._native = _native.StoreSink(store.handle)
        self._tensors = []
        for t in targets:
            region_ids = [store.region(name).id for name in t.regions]
            self._native.add_tensor(int(t.tensor), region_ids, int(t.layer_bytes), _dtype_name(t.dtype),
                                    int(t.arrivals), [NO_MIRROR if name is None else store.region(name).id
                                                      for name in t.mirrors])
            self._tensors.append(int(t.tensor))
        self._register(self._native, _native.register_store_sink(self._native), self._tensors)


def register_store_sink(store: SsdStore, targets: Sequence[SinkTarget]) -> StoreGradientSink:
    """Creates a sink writing into ``store`` routed by ``targets`` and registers it for FFI calls.

    Raises ``ValueError`` naming the tensor when a region is unknown or is not exactly
    ``layer_bytes`` long, or when the dtype is not float32, float16 or bfloat16.
    """
    return StoreGradientSink(store, targets)


@dataclass(frozen=True)
class BufferTarget:
    """Where tensor id ``tensor`` goes in a float32 host buffer: ``layers`` layers of
    ``layer_elements`` each, from element ``offset``, arriving in ``dtype``."""

    tensor: int
    offset: int
    layers: int
    layer_elements: int
    dtype: object
    arrivals: int = 1  # as SinkTarget.arrivals


class Fp32BufferGradientSink(_RegisteredSink):
    """A registered sink widening every gradient into one float32 host buffer (``ffi/offload_fp32_grad_sink.cc``).

    The ``offload.fp32_grad_buffer`` ablation: ZeRO-Infinity's full fp32 host gradient copy
    (4 B/param), which the optimizer step then reads instead of the SSD store. Same interface
    as :class:`StoreGradientSink` (``handle``, ``received``, ``reset``, ``close``).
    """

    _kind = "fp32 buffer gradient sink"

    def __init__(self, buffer: np.ndarray, targets: Sequence[BufferTarget]):
        if buffer.dtype != np.float32 or buffer.ndim != 1 or not buffer.flags.c_contiguous:
            raise ValueError(f"fp32 gradient buffer: expected a 1-D C-contiguous float32 array, got "
                             f"{buffer.dtype} with shape {buffer.shape}")
        self._native = _native.Fp32BufferSink(buffer)
        self._tensors = []
        for t in targets:
            self._native.add_tensor(int(t.tensor), int(t.offset), int(t.layers), int(t.layer_elements),
                                    _dtype_name(t.dtype), int(t.arrivals))
            self._tensors.append(int(t.tensor))
        self._register(self._native, _native.register_fp32_buffer_sink(self._native), self._tensors)
