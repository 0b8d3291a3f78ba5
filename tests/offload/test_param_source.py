"""The native parameter source against plain numpy: layers come back as written, in any order
(an unforeseen ask is read synchronously and counted), read errors become one-line errors, and
the sinks sum a tied table's two arrivals as XLA adds two 16-bit arrays."""

import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxascend.config import OffloadConfig
from jaxascend.offload import OffloadLayout, fetch_layer, sink_gradient
from jaxascend.offload.grad_sink import MemorySink, fetch_step_outputs, register_memory_sink, unregister_sink
from jaxascend.offload.layout import PARAM_SLOT_CLASS
from jaxascend.offload.param_source import ParamSource, ParamSourceError
from jaxascend.offload.grad_sink import step_errors
from jaxascend.offload.param_source import PARAM_SOURCE_ERRORS
from jaxascend.ssd import ArenaPlan, HostArena, SsdStore, clear_faults, inject_fault

LAYERS = 4
SHAPES = {"w": (48, 40), "b": (40,)}


@pytest.fixture
def store(tmp_path):
    cfg = OffloadConfig(dir=str(tmp_path / "off"), block_bytes=4096, staging_bytes=16384, chunk_bytes=16384,
                        pin_memory=False, lock_memory=False, stream_depth=2, param_prefetch=2)
    spec = {k: jax.ShapeDtypeStruct((LAYERS,) + s, jnp.bfloat16) for k, s in SHAPES.items()}
    layout = OffloadLayout.plan(spec, cfg, stacked=True, stream_params=True)
    arena = HostArena(ArenaPlan().extend(SsdStore.arena_requests(cfg)).extend(layout.arena_requests()), cfg)
    store = SsdStore(cfg, arena)
    rng = np.random.default_rng(0)
    values = {}
    for leaf in layout.leaves:
        values[leaf.path] = rng.standard_normal((LAYERS,) + leaf.layer_shape).astype(ml_dtypes.bfloat16)
        for layer, region in enumerate(leaf.param_regions):
            store.add_region(region, leaf.grad_layer_bytes)
            store.write(region, values[leaf.path][layer].reshape(-1))
    yield store, layout, values
    clear_faults()
    store.close()
    arena.close()


def _fetch(source, layer):
    return jax.jit(lambda i: fetch_layer(source.handle, i, source.specs))(jnp.int32(layer))


def _fetch_the_step(source, values):
    """Fetches every layer of the step's order, checks each against what was written, ends the
    step and returns the source's stats."""
    for layer in source.step_order():
        got = fetch_step_outputs(_fetch(source, layer))
        for leaf, x in zip(source.leaves, got):
            np.testing.assert_array_equal(np.asarray(x).view(np.uint16), values[leaf.path][layer].view(np.uint16))
    source.end_step()
    return source.stats()


def test_layers_come_back_as_written_in_the_foreseen_order(store):
    store, layout, values = store
    source = ParamSource(store, layout.streamed_leaves, depth=2)
    assert PARAM_SLOT_CLASS in {r.shape_class for r in layout.arena_requests()}
    source.begin_step()
    stats = _fetch_the_step(source, values)
    assert stats["fetches"] == 2 * LAYERS and stats["misses"] == 0
    assert stats["bytes_read"] == 2 * sum(leaf.size * 2 for leaf in layout.leaves)
    source.close()


def test_an_unforeseen_ask_is_read_now_and_counted(store):
    store, layout, values = store
    source = ParamSource(store, layout.streamed_leaves, depth=1)
    idle = store.arena.in_use_bytes  # the store's own staging slots
    source.begin_step()  # layer 0 is in flight; layer 3 is not
    assert store.arena.in_use_bytes > idle
    got = fetch_step_outputs(_fetch(source, 3))
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint16), values[source.leaves[0].path][3].view(np.uint16))
    assert source.stats()["misses"] == 1
    source.end_step()  # drains layer 0's read and frees its slot
    assert store.arena.in_use_bytes == idle
    source.close()


def test_a_slot_held_for_a_handover_is_not_asked_of_the_arena_again(store):
    """The optimizer holds slots for layers it is updating while a layer it could not hand over
    becomes ready: the read-ahead waits for a slot instead of failing the step (seen at 0.5B as
    "all 2 slots of shape class 'param_source' ... are in use")."""
    store, layout, values = store
    source = ParamSource(store, layout.streamed_leaves, depth=2)
    source.gate(handover=True)
    source.begin_step()
    source.skip_handover(0)  # no slot for layer 0: the forward reads it from SSD once it is written
    held = {layer: source.acquire_handover(layer) for layer in (1, 2)}  # both slots of the class
    assert all(held.values()) and source.acquire_handover(3) is None
    source.skip_handover(3)
    source.mark_ready(0)  # layer 0 is on SSD; the slots are the optimizer's: no read is started
    for layer, (slot, views) in held.items():
        for leaf, view in zip(source.leaves, views):
            view[:] = values[leaf.path][layer].reshape(-1).view(np.uint8)
        source.handover(layer, slot)
    for layer in (1, 2, 3):
        source.mark_ready(layer)
    stats = _fetch_the_step(source, values)
    assert stats["handovers"] == 2 and stats["handover_skips"] == 2 and stats["fetches"] == 2 * LAYERS
    source.close()


def _hand(source, values, layer, taken):
    slot, views = taken
    for leaf, view in zip(source.leaves, views):
        view[:] = values[leaf.path][layer].reshape(-1).view(np.uint8)
    source.handover(layer, slot)


def _acquire_in_thread(source, layer):
    """Starts ``acquire_handover(layer)`` on a thread; returns (thread, box of its result)."""
    box = []
    thread = threading.Thread(target=lambda: box.append(source.acquire_handover(layer)), daemon=True)
    thread.start()
    return thread, box


def _a_third_layer_waiting(source, values):
    """A step whose update has handed layers 0 and 1 over (both slots) and asks for layer 2's on a
    thread: (thread, box), the thread checked to be waiting, before the forward has begun (it will
    ask for layer 0 first) and after, while it has taken nothing yet."""
    source.begin_step()  # the step whose gradients the update applies
    source.end_step()
    source.gate(handover=True)
    for layer in (0, 1):
        _hand(source, values, layer, source.acquire_handover(layer))
    thread, box = _acquire_in_thread(source, 2)
    thread.join(0.2)
    assert thread.is_alive() and not box
    source.begin_step()
    thread.join(0.2)
    assert thread.is_alive() and not box
    return thread, box


def test_the_update_waits_for_the_forward_to_take_a_handed_layer_instead_of_skipping(store):
    """Back-pressure: with both slots holding layers handed over and not fetched, the update of the
    next layer waits until the forward takes layer 0 (not for the disk), then gets its slot: every
    layer goes over in memory and none is read from SSD for the forward."""
    store, layout, values = store
    source = ParamSource(store, layout.streamed_leaves, depth=2)
    thread, box = _a_third_layer_waiting(source, values)
    got = fetch_step_outputs(_fetch(source, 0))
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint16), values[source.leaves[0].path][0].view(np.uint16))
    thread.join(10)
    assert not thread.is_alive() and box[0] is not None
    _hand(source, values, 2, box[0])
    thread, box = _acquire_in_thread(source, 3)  # layers 1 and 2 hold the slots: waits for layer 1
    _fetch_then(source, 1, thread)
    _hand(source, values, 3, box[0])
    for layer in range(LAYERS):
        source.mark_ready(layer)
    for layer in source.step_order()[2:]:  # the rest of the forward, and the backward from SSD
        got = fetch_step_outputs(_fetch(source, layer))
        np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint16),
                                      values[source.leaves[0].path][layer].view(np.uint16))
    source.end_step()
    stats = source.stats()
    assert stats["handovers"] == LAYERS and stats["handover_skips"] == 0 and stats["misses"] == 0
    assert stats["bytes_read"] == sum(leaf.size * 2 for leaf in layout.leaves)  # the backward's only
    assert stats["handover_wait_seconds"] > 0.2
    source.close()


def _fetch_then(source, layer, thread):
    fetch_step_outputs(_fetch(source, layer))
    thread.join(10)
    assert not thread.is_alive()


def test_the_update_does_not_wait_where_the_forward_would_not_free_a_slot(store):
    """No wait where the forward's next layer is not handed over (it waits for a read from SSD,
    which needs the update to go on), nor once the update is joined without a forward
    (end_handover_waits): the layer is read from SSD instead."""
    store, layout, values = store
    source = ParamSource(store, layout.streamed_leaves, depth=2)
    source.gate(handover=True)
    source.begin_step()
    source.skip_handover(0)
    for layer in (1, 2):
        _hand(source, values, layer, source.acquire_handover(layer))
    assert source.acquire_handover(3) is None  # the forward's next, layer 0, comes from SSD
    source.end_step()
    thread, box = _a_third_layer_waiting(source, values)
    source.end_handover_waits()  # joined with no forward to come
    thread.join(10)
    assert not thread.is_alive() and box == [None]
    assert source.acquire_handover(3) is None
    source.end_step()
    source.close()


def test_a_read_error_is_one_line_naming_the_layer(store):
    store, layout, _ = store
    source = ParamSource(store, layout.streamed_leaves, depth=1)
    inject_fault("read:1:EIO")
    source.begin_step()
    with pytest.raises(ParamSourceError, match=r"^param_source: reading layer 0: .*EIO"):
        with step_errors(PARAM_SOURCE_ERRORS):  # XLA may raise at dispatch or at the fetch
            jax.device_get(_fetch(source, 0))
    source.end_step()
    with pytest.raises(ValueError, match="layer 9 is out of range"):
        source._native.begin([9], 1)
    source.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_memory_sink_sums_two_arrivals_as_xla_adds(dtype):
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((64, 8)) * 3, dtype)
    b = jnp.asarray(rng.standard_normal((64, 8)), dtype)
    buf = np.zeros(a.size * a.dtype.itemsize, np.uint8)
    sink = MemorySink()
    sink.add_tensor(0, buf, buf.size, arrivals=2)
    handle = register_memory_sink(sink)
    try:
        first, second = jax.jit(lambda x, y: (sink_gradient(x, 0, sink=handle, tensor=0),
                                              sink_gradient(y, 0, sink=handle, tensor=0)))(a, b)
        first, second = np.asarray(first), np.asarray(second)
    finally:
        unregister_sink(handle)
    want = np.asarray(jax.jit(jnp.add)(a, b))
    np.testing.assert_array_equal(buf.view(want.dtype).reshape(want.shape).view(np.uint8), want.view(np.uint8))
    stats = first + second  # one of them (whichever XLA ran first) reports zeros, the other the sum's
    np.testing.assert_allclose(stats[0], np.sum(want.astype(np.float64) ** 2), rtol=1e-5)
    assert 0.0 in (first[0], second[0])
