"""How a step's gradients reach the SSD-resident state: the sink, and the check that all arrived.

:func:`make_gradient_sink` builds the sink of an
:class:`~jaxascend.offload.state.OffloadedAdamState`'s layout (its gradient regions, or the
``offload.fp32_grad_buffer`` host buffer); :func:`arrival_problems` compares what the sink
received since the last step with the gradients each tensor and layer should have had.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from jaxascend.offload.layout import LeafLayout, OffloadLayout
from jaxascend.offload.store_sink import (BufferTarget, Fp32BufferGradientSink, SinkTarget, StoreGradientSink,
                                          register_store_sink)
from jaxascend.ssd import SsdStore

GradientSink = Union[StoreGradientSink, Fp32BufferGradientSink]


def make_gradient_sink(store: SsdStore, layout: OffloadLayout, grad_buffer: Optional[np.ndarray],
                       grad_offsets: list[int], arrivals: dict[int, int],
                       mirrors: Optional[dict[str, str]] = None) -> GradientSink:
    """A registered sink over ``layout``'s gradient regions, or over ``grad_buffer`` (each leaf's
    float32 gradient at its ``grad_offsets`` entry) when there is one. ``arrivals``: tensor id ->
    gradients per layer the sink sums (default 1). ``mirrors``: gradient region -> the region each
    whole gradient is written to as well (durable steps' log of gradients in RAM)."""
    n = arrivals.get
    if grad_buffer is not None:
        buffer_targets = [BufferTarget(leaf.index, offset, leaf.layers, leaf.layer_elements, leaf.dtype,
                                       n(leaf.index, 1))
                          for leaf, offset in zip(layout.leaves, grad_offsets)]
        return Fp32BufferGradientSink(grad_buffer, buffer_targets)
    twin = (mirrors or {}).get
    targets = [SinkTarget(leaf.index, leaf.grad_regions, leaf.grad_layer_bytes, leaf.dtype, n(leaf.index, 1),
                          tuple(twin(r) for r in leaf.grad_regions) if mirrors else ()) for leaf in layout.leaves]
    return register_store_sink(store, targets)


def arrival_problems(sink: GradientSink, leaves: tuple[LeafLayout, ...], arrivals: dict[int, int]) -> list[str]:
    """Every tensor whose gradient did not arrive exactly ``arrivals`` times (default 1) per layer
    since the sink's last reset, as one phrase each (none: all arrived)."""
    problems = []
    for leaf in leaves:
        counts = sink.received(leaf.index)
        want = arrivals.get(leaf.index, 1)
        missing = [layer for layer, c in enumerate(counts) if c < want]
        repeated = [layer for layer, c in enumerate(counts) if c > want]
        if missing:
            problems.append(f"{leaf.path!r} (tensor {leaf.index}) never arrived for layers {missing}" if want == 1
                            else f"{leaf.path!r} (tensor {leaf.index}) arrived fewer than {want} times (one per "
                                 f"use) for layers {missing}")
        if repeated:
            problems.append(f"{leaf.path!r} (tensor {leaf.index}) arrived more than {want}x for layers "
                            f"{repeated} (the sink overwrites; it does not accumulate)")
    return problems
