"""SSD-resident AdamW state with compressed moments (optimizer.state_dtype bfloat16 / int8): the
layout's records, the streamed step against the numpy reference on whole layers, bytes moved per
step, checkpoints readable by plain tensorstore, and restores of another state dtype refused."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from jaxascend.checkpoint import IncompatibleCheckpointError, SsdArrays
from jaxascend.checkpoint import restore_arrays, save_item
from jaxascend.offload import OffloadLayout, OffloadedAdamState, specs_for_offload_layout
from jaxascend.offload.layout import STATE_SLOT_CLASS
from jaxascend.optim import AdamHyperParams, StateFormat
from jaxascend.optim import state_codes as sc
from tests.offload.test_state import STACKED, offload_cfg, random_tree, spec

FORMATS = [StateFormat.of("bfloat16"), StateFormat.of("int8", 256), StateFormat.of("int8", 2048)]
IDS = ["bfloat16", "int8-256", "int8-2048"]
STOCHASTIC = [StateFormat.of("bfloat16", rounding="stochastic"), StateFormat.of("int8", 256, "stochastic")]
RUN_SEED = 7


def _chunk_bytes(fmt):
    # chunks of 4096 elements: int8 blocks of 2048 fit, and odd leaves end mid-block
    return "16KiB"


def _make(tmp_path, fmt, name="offload", dtype=jnp.bfloat16, **overrides):
    cfg = offload_cfg(tmp_path / name, chunk_bytes=_chunk_bytes(fmt), **overrides)
    return OffloadedAdamState.create(spec(dtype), cfg, stacked=STACKED, state=fmt, rounding_seed=RUN_SEED)


def _reference_step(fmt, ref, leaf, grad, hp):
    """One update of every layer of ``leaf`` with state_codes.adamw_reference (a layer's blocks
    start at its first element, as the chunks' do: a chunk is whole blocks; stochastic rounding
    draws by the element's index in the layer, whatever chunk it is in)."""
    g = np.asarray(grad, np.float32).reshape(leaf.layers, -1)
    scalars = np.asarray(hp.scalars())
    for layer in range(leaf.layers):
        r = ref[leaf.index][layer]
        seed = sc.chunk_seed(RUN_SEED, int(hp.count), leaf.index, layer)
        r[:] = sc.adamw_reference(r[0], r[1], r[2], g[layer], scalars, fmt, r[3], r[4], seed)


def _initial(fmt, master):
    n = master.size
    if fmt.dtype == "bfloat16":
        return [master, np.zeros(n, np.uint16), np.zeros(n, np.uint16), None, None]
    blocks = fmt.blocks(n)
    return [master, np.zeros(n, np.uint8), np.zeros(n, np.uint8), np.zeros(blocks, np.float32),
            np.zeros(blocks, np.float32)]


@pytest.mark.parametrize("fmt", FORMATS + STOCHASTIC, ids=IDS + ["bfloat16-stochastic", "int8-256-stochastic"])
def test_streamed_step_equals_the_reference_on_whole_layers(tmp_path, fmt):
    """Chunk records, block scales and streaming change nothing: master, params and the decoded
    moments are bit for bit the numpy reference's, for 3 steps (stochastic rounding included:
    its bits follow the element's place in its layer, not the chunking)."""
    with _make(tmp_path, fmt) as state:
        params = random_tree(2)
        state.init(params)
        ref = {leaf.index: [_initial(fmt, x.reshape(leaf.layers, -1)[layer].copy()) for layer in range(leaf.layers)]
               for leaf, x in zip(state.leaves, jax.tree.leaves(params))}
        for count in range(3):
            grads = random_tree(10 + count, ml_dtypes.bfloat16, scale=0.1)
            state.write_grads(grads)
            hp = AdamHyperParams(lr=1e-2, weight_decay=0.1, grad_scale=0.5, count=count)
            new = state.step(hp)
            for leaf, g, p in zip(state.leaves, jax.tree.leaves(grads), jax.tree.leaves(new)):
                _reference_step(fmt, ref, leaf, g, hp)
                want = np.concatenate([r[0] for r in ref[leaf.index]]).astype(ml_dtypes.bfloat16)
                np.testing.assert_array_equal(np.asarray(p).reshape(-1).view(np.uint16), want.view(np.uint16))
        for leaf in state.leaves:
            layers = ref[leaf.index]
            master = np.concatenate([r[0] for r in layers])
            if fmt.dtype == "bfloat16":
                m = np.concatenate([sc.bf16_widen(r[1]) for r in layers])
                v = np.concatenate([sc.bf16_widen(r[2]) for r in layers])
            else:
                m = np.concatenate([sc.dequantize_m(r[1], r[3], fmt.block) for r in layers])
                v = np.concatenate([sc.dequantize_v(r[2], r[4], fmt.block) for r in layers])
            for which, want in (("master", master), ("m", m), ("v", v)):
                got = state.read_state(leaf, which).reshape(-1)
                np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"{leaf.path} {which}")


@pytest.mark.parametrize("fmt,bytes_per_param", [(StateFormat(), 12), (StateFormat.of("bfloat16"), 8),
                                                 (StateFormat.of("int8", 2048), 6 + 8 / 2048)],
                         ids=["float32", "bfloat16", "int8"])
def test_records_and_bytes_moved_per_step(tmp_path, fmt, bytes_per_param):
    """A step reads every record and the bf16 gradient and writes every record back: 12 + 2 and
    12 B/param with fp32 moments, 8 + 2 and 8 with bf16, 6 + 2 and 6 (+ scales) with int8; the
    records of consecutive chunks start on SSD blocks and the int8 scales are float32-aligned."""
    big = {"layers": jax.ShapeDtypeStruct((4, 3 * 65536 + 1000), jnp.bfloat16)}
    cfg = offload_cfg(tmp_path, chunk_bytes="256KiB", staging_bytes="1MiB", shard_bytes="64MiB")
    layout = OffloadLayout.plan(big, cfg, stacked=True, state=fmt)
    assert layout.state_stride % cfg.block_bytes == 0
    for chunk in layout.chunks():
        assert chunk.state_offset % cfg.block_bytes == 0 and chunk.record.scales_offset % 4 == 0
    n = layout.num_parameters
    assert bytes_per_param * n <= layout.state_bytes <= bytes_per_param * n * 1.01
    with OffloadedAdamState.create(big, cfg, stacked=True, state=fmt) as state:
        state.init({"layers": np.ones((4, 3 * 65536 + 1000), np.float32)})
        state.write_grads({"layers": np.full((4, 3 * 65536 + 1000), 0.01, ml_dtypes.bfloat16)})
        state.step(AdamHyperParams(lr=1e-3, count=0))
        stats = state.last_step
        # (within 2%: a chunk's record is padded to whole SSD blocks, a layer's last block is whole)
        assert stats.bytes_read / n == pytest.approx(bytes_per_param + 2, rel=0.02)
        assert stats.bytes_written / n == pytest.approx(bytes_per_param, rel=0.02)
        assert layout.step_bytes == (state.layout.state_bytes + state.layout.grad_bytes, state.layout.state_bytes)


def _arrays(state, fmt):
    return SsdArrays(state.store, specs_for_offload_layout(state.layout), slot_class=STATE_SLOT_CLASS,
                     attributes={"state": fmt.describe()})


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_checkpoint_round_trip_and_plain_tensorstore(tmp_path, fmt):
    """Save, then restore into a fresh store: every record byte equal, so the next step is too;
    the item holds master (float32), m and v in the state dtype, and for int8 the scales as
    separate float32 arrays, each readable with plain tensorstore; the manifest records the format."""
    item = tmp_path / "ckpt" / "offloaded"
    with _make(tmp_path, fmt, "a") as a, _make(tmp_path, fmt, "b") as b:
        a.init(random_tree(1))
        a.write_grads(random_tree(2, ml_dtypes.bfloat16, scale=0.1))
        a.step(AdamHyperParams(lr=1e-2, count=0))
        manifest = save_item(item, _arrays(a, fmt))
        assert manifest["attributes"]["state"]["state_dtype"] == fmt.dtype
        restore_arrays(item, _arrays(b, fmt))
        b.restored(1)
        for leaf in a.leaves:
            for region in leaf.state_regions:
                assert a.store.read(region).tobytes() == b.store.read(region).tobytes()
        big = next(leaf for leaf in a.leaves if leaf.path == "big")
        names = {"master": np.float32, "m": fmt.moment_dtype("m"), "v": fmt.moment_dtype("v")}
        if fmt.dtype == "int8":
            names.update(m_scale=np.float32, v_scale=np.float32)
        for name, dtype in names.items():
            stored = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(item / f"{name}.big")}}
                             ).result().read().result()
            assert stored.dtype == np.dtype(dtype), name
            if name == "master":
                np.testing.assert_array_equal(stored, a.read_state(big, "master"))
        if fmt.dtype == "int8":
            codes = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(item / "m.big")}}
                            ).result().read().result()
            scales = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(item / "m_scale.big")}}
                             ).result().read().result()
            assert scales.shape == (fmt.blocks(big.size),)
            np.testing.assert_array_equal(sc.dequantize_m(codes, scales, fmt.block), a.read_state(big, "m"))
        grads = random_tree(3, ml_dtypes.bfloat16, scale=0.1)
        a.write_grads(grads)
        b.write_grads(grads)
        pa, pb = a.step(AdamHyperParams(lr=1e-2, count=1)), b.step(AdamHyperParams(lr=1e-2, count=1))
        for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_restore_into_another_state_dtype_is_refused_before_writing(tmp_path):
    item = tmp_path / "ckpt" / "offloaded"
    bf16, int8 = StateFormat.of("bfloat16"), StateFormat.of("int8", 2048)
    with _make(tmp_path, bf16, "a") as a, _make(tmp_path, int8, "b") as b:
        a.init(random_tree(1))
        save_item(item, _arrays(a, bf16))
        b.init(random_tree(5))
        before = [b.store.read(r).tobytes() for leaf in b.leaves for r in leaf.state_regions]
        with pytest.raises(IncompatibleCheckpointError,
                           match=r"holds bfloat16 optimizer state; this run keeps int8 \(blocks of 2048\)"):
            restore_arrays(item, _arrays(b, int8))
        assert before == [b.store.read(r).tobytes() for leaf in b.leaves for r in leaf.state_regions]


def test_a_slice_rounds_as_the_whole_layer_does(tmp_path):
    """Data parallel: process p of P holds elements [p*s, (p+1)*s) of every layer. Its stochastic
    rounding draws by the element's index in the whole layer, so two processes' halves, updated
    apart, are bit for bit the one-process update of the whole (bfloat16 state; int8's blocks are
    each process's own, so it resumes with the same P only)."""
    fmt = StateFormat.of("bfloat16", rounding="stochastic")
    layers, width = 2, 8192
    full = {"w": jax.ShapeDtypeStruct((layers, width), jnp.bfloat16)}
    half = {"w": jax.ShapeDtypeStruct((layers, width // 2), jnp.bfloat16)}
    rng = np.random.default_rng(0)
    start = rng.standard_normal((layers, width)).astype(np.float32)
    grads = [(rng.standard_normal((layers, width)) * 1e-3).astype(ml_dtypes.bfloat16) for _ in range(3)]

    def run(name, shape_spec, part, cols):
        cfg = offload_cfg(tmp_path / name, chunk_bytes="8KiB")
        with OffloadedAdamState.create(shape_spec, cfg, stacked={"w": True}, state=fmt, rounding_seed=RUN_SEED,
                                       partition_index=part) as state:
            state.init({"w": start[:, cols]})
            for count, g in enumerate(grads):
                state.write_grads({"w": np.ascontiguousarray(g[:, cols])})
                state.step(AdamHyperParams(lr=1e-2, count=count))
            return state.read_state(state.leaves[0], "v"), state.read_state(state.leaves[0], "master")

    whole = run("whole", full, 0, slice(None))
    halves = [run(f"half{p}", half, p, slice(p * width // 2, (p + 1) * width // 2)) for p in range(2)]
    for k, which in enumerate(("v", "master")):
        joined = np.concatenate([h[k].reshape(layers, -1) for h in halves], axis=1)
        np.testing.assert_array_equal(joined.view(np.uint32), whole[k].reshape(layers, -1).view(np.uint32),
                                      err_msg=which)
    # and the halves did not draw the same bits as each other (rounding_index moved them)
    shifted = run("shifted", half, 0, slice(width // 2, width))
    assert not np.array_equal(shifted[0], halves[1][0])
