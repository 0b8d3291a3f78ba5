"""The ZeRO-Infinity-style ablation switches (``offload.*``): each runs a real offloaded training,
changes memory, and leaves the arithmetic alone.

Exactness: with clipping off, every switch (and all of them together) gives the all-off run's
losses exactly and the same fp32 master weights bit for bit (``params.safetensors`` is compared
byte for byte). With clipping active, ``post_backward_overflow_check`` computes the global norm
in another summation order (relative difference ~1e-7), so the clip factor and the state
differ in the last bits; the losses then agree to 1e-5 relative.
"""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxascend.native import extension as _native
from jaxascend.config import OffloadConfig, load_config
from jaxascend.models import build_model, next_token_loss
from jaxascend.offload import OffloadLayout, OffloadedAdamState, STATE_SLOT_CLASS, offload_on_backward
from jaxascend.offload.layout import GRAD_SLOT_CLASS
from jaxascend.offload.post_backward_check import make_full_gradient_step, post_backward_stats
from jaxascend.offload.step import total_stats
from jaxascend.ssd import ArenaPlan, HostArena, round_to_alignment
from jaxascend.trainer import run
from tests._corpus import write_word_corpus

TINY = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
    "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32", "data.batch_size=2",
    "train.progress=false", "train.steps=2", "train.log_every=1", "offload.enabled=true",
    "model.dtype=bfloat16", "optimizer.grad_clip_norm=null",
    # 4 KiB blocks keep the tiny model's arena slots several blocks long (checkpoints stream
    # through them) and the arena small enough that one switch's growth is plain to see.
    "offload.block_bytes=4096", "offload.chunk_bytes=16KiB", "offload.staging_bytes=64KiB",
    "offload.pin_memory=false", "optimizer.warmup_steps=1",
]
BUFFERED_CACHED = ["offload.direct_io=false", "offload.drop_page_cache=false"]
SWITCHES = {
    "pow2_buffers": ["offload.pow2_buffers=true"],
    "single_pool": ["offload.single_pool=true"],
    "fp32_grad_buffer": ["offload.fp32_grad_buffer=true"],
    "post_backward_overflow_check": ["offload.post_backward_overflow_check=true"],
    "buffered_io": BUFFERED_CACHED,
}
ALL_ON = sum(SWITCHES.values(), [])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words_per_doc=400)


def train(base, corpus, name, *extra):
    cfg = load_config("configs/tiny.yaml", TINY + [
        f"data.paths=[{corpus}]", "data.include=['*.txt']", f"offload.dir={base / name / 'offload'}",
        f"train.out_dir={base / name / 'run'}", *extra])
    result = run(cfg)
    metrics = [json.loads(line) for line in (base / name / "run" / "metrics.jsonl").read_text().splitlines()]
    return result, metrics, (base / name / "run" / "params.safetensors").read_bytes()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """Two offloaded steps per mode: all off, each switch alone, all on (bf16, no clipping)."""
    base = tmp_path_factory.mktemp("ablations")
    # "off" with the gradients on SSD, as the ablations have them (auto would keep them in RAM)
    out = {"off": train(base, corpus, "off", "offload.gradients=ssd"), "all": train(base, corpus, "all", *ALL_ON)}
    for name, overrides in SWITCHES.items():
        out[name] = train(base, corpus, name, *overrides)
    return out


@pytest.mark.parametrize("mode", [*SWITCHES, "all"])
def test_switch_changes_memory_not_math(runs, mode):
    ref, _, ref_params = runs["off"]
    result, metrics, params = runs[mode]
    assert len(result.losses) == 2 and result.skipped_steps == 0
    assert result.losses == ref.losses  # exact
    assert params == ref_params  # fp32 master weights, bit for bit


def test_pow2_buffers_grow_the_arena(runs):
    off, pow2 = runs["off"][0], runs["pow2_buffers"][0]
    assert off.arena_capacity_bytes < pow2.arena_capacity_bytes < 2 * off.arena_capacity_bytes


def test_single_pool_grows_the_arena(runs):
    assert runs["single_pool"][0].arena_capacity_bytes > runs["off"][0].arena_capacity_bytes


def test_fp32_grad_buffer_holds_four_bytes_per_param(runs):
    result, metrics, _ = runs["fp32_grad_buffer"]
    assert metrics[-1]["host_grad_buffer_bytes"] == 4 * result.num_params
    assert runs["off"][1][-1]["host_grad_buffer_bytes"] == 0
    # The step reads gradients from RAM, so it reads less from SSD than it writes back.
    assert metrics[-1]["ssd_read_bytes_step"] == metrics[-1]["ssd_write_bytes_step"]
    off = runs["off"][1][-1]
    assert off["ssd_read_bytes_step"] > off["ssd_write_bytes_step"]


def test_buffered_io_without_drop_fills_the_page_cache(runs, tmp_path, corpus):
    state_bytes = 12 * runs["off"][0].num_params
    assert runs["off"][0].peak_page_cache_bytes == 0  # O_DIRECT
    assert runs["buffered_io"][0].peak_page_cache_bytes >= state_bytes
    assert runs["all"][0].peak_page_cache_bytes >= state_bytes
    dropped = train(tmp_path, corpus, "dropped", "offload.direct_io=false")[0]
    assert dropped.peak_page_cache_bytes < state_bytes // 4


def test_post_backward_check_with_fp16_accumulation_and_clipping(tmp_path, corpus):
    """Loss scaling, two micro-batches and an active clip through the ablated path."""
    extra = ["model.dtype=float16", "train.grad_accum=2", "optimizer.grad_clip_norm=0.5"]
    off, off_metrics, _ = train(tmp_path, corpus, "off16", *extra)
    on, on_metrics, _ = train(tmp_path, corpus, "on16", *extra, *ALL_ON)
    assert off_metrics[0]["grad_norm"] > 0.5  # the clip is active
    np.testing.assert_allclose(on.losses, off.losses, rtol=1e-5)
    # Both run the micro-batches vertically, but the ablation differentiates the whole tree in one
    # program and the sink path per leaf: XLA fuses (and rounds) float16 work differently in each.
    np.testing.assert_allclose([m["grad_norm"] for m in on_metrics], [m["grad_norm"] for m in off_metrics],
                               rtol=1e-4)
    assert [m["loss_scale"] for m in on_metrics] == [m["loss_scale"] for m in off_metrics]


# ----------------------------------------------------------------------------- direct checks

def offload_cfg(tmp_path, **fields):
    base = dict(dir=str(tmp_path / "offload"), block_bytes=4096, chunk_bytes=8192, staging_bytes=16384,
                shard_bytes=1 << 20, io_threads=2, pin_memory=False)
    return OffloadConfig(**{**base, **fields})


SPEC = {"emb": jax.ShapeDtypeStruct((300, 16), jnp.bfloat16),
        "layers": {"w": jax.ShapeDtypeStruct((2, 16, 40), jnp.bfloat16)}}
STACKED = {"emb": False, "layers": {"w": True}}


def test_pow2_plan_rounds_every_buffer(tmp_path):
    cfg = offload_cfg(tmp_path, pow2_buffers=True)
    plan = ArenaPlan().add("a", 12_288, 3).add("b", 5000, 2)
    with HostArena(plan, cfg) as arena:
        assert sorted(s.nbytes for s in arena.slots()) == [8192] * 2 + [16384] * 3
        assert arena.capacity == 3 * 16384 + 2 * 8192
    with HostArena(plan, offload_cfg(tmp_path)) as exact:
        assert exact.capacity == 3 * 12_288 + 2 * round_to_alignment(5000)


def test_single_pool_sizes_every_step_slot_for_the_largest_tensor(tmp_path):
    lean = OffloadLayout.plan(SPEC, offload_cfg(tmp_path), STACKED)
    pooled = OffloadLayout.plan(SPEC, offload_cfg(tmp_path, single_pool=True), STACKED)
    largest = 300 * 16  # the embedding, one whole tensor
    assert lean.chunk_elements == 2048 and pooled.chunk_elements >= largest
    assert {r.shape_class: r.nbytes for r in lean.arena_requests()} == {
        STATE_SLOT_CLASS: 12 * 2048, GRAD_SLOT_CLASS: 2 * 2048}
    assert {r.shape_class: r.nbytes for r in pooled.arena_requests()} == {
        STATE_SLOT_CLASS: 12 * largest, GRAD_SLOT_CLASS: 12 * largest}
    assert len(pooled.chunks()) == 1 + 2  # one chunk per tensor layer


def test_fp32_grad_buffer_is_resident_and_receives_widened_gradients(tmp_path):
    with OffloadedAdamState.create(SPEC, offload_cfg(tmp_path), stacked=STACKED, grad_store="host_fp32") as state:
        assert state.grad_buffer.dtype == np.float32 and state.grad_buffer.nbytes == 4 * state.layout.num_parameters
        assert [r.shape_class for r in state.layout.arena_requests()] == [STATE_SLOT_CLASS]
        assert not any(r.name.endswith("/grad") for r in state.store.regions())  # nothing on SSD
        rng = np.random.default_rng(0)
        w = jnp.zeros((2, 16, 40), jnp.bfloat16)
        coef = jnp.asarray(rng.standard_normal((2, 16, 40)), jnp.bfloat16)  # d loss / d w, exactly
        sink = state.gradient_sink()
        ids = state.tensor_ids()

        def loss(probe):
            layers = [offload_on_backward(w[i], probe[i], sink=sink.handle, tensor=ids["layers"]["w"], layer=i)
                      for i in range(2)]
            return sum(jnp.sum(x * coef[i]).astype(jnp.float32) for i, x in enumerate(layers))

        jax.block_until_ready(jax.grad(loss)(jnp.zeros((2, 2), jnp.float32)))
        start = state._grad_offsets[state.leaf("layers/w").index]
        np.testing.assert_array_equal(state.grad_buffer[start:start + coef.size],
                                      np.asarray(coef, np.float32).reshape(-1))  # widened exactly
        expected = coef
        got = state.read_grad(state.leaf("layers/w"))
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(expected).view(np.uint16))
        assert sink.received(ids["layers"]["w"]) == [1, 1]


def test_fp32_buffer_sink_rejects_a_wrong_size(tmp_path):
    buffer = np.zeros(100, np.float32)
    sink = _native.Fp32BufferSink(buffer)
    sink.add_tensor(7, 10, 2, 20, "bfloat16")
    handle = _native.register_fp32_buffer_sink(sink)
    try:
        with pytest.raises(RuntimeError, match="tensor 7 expects 40 bytes per layer, got 38"):
            _native.consume_gradient(handle, 7, 0, np.zeros(38, np.uint8), "bfloat16")
        with pytest.raises(RuntimeError, match="layer 2 is out of range for tensor 7"):
            _native.consume_gradient(handle, 7, 2, np.zeros(40, np.uint8), "bfloat16")
        one = np.full(20, 1.5, ml_dtypes.bfloat16)
        _native.consume_gradient(handle, 7, 1, one.view(np.uint8), "bfloat16")
        assert (buffer[30:50] == 1.5).all() and not buffer[:30].any() and not buffer[50:].any()
        assert sink.received(7) == [0, 1]
    finally:
        _native.unregister_sink(handle)
    with pytest.raises(ValueError, match=r"elements \[90, 130\) do not fit the buffer of 100"):
        sink.add_tensor(8, 90, 2, 20, "float32")


def test_post_backward_stats_match_the_sinks(tmp_path):
    model = build_model(load_config("configs/tiny.yaml", TINY).model, 64, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 17)), jnp.int32)

    def loss_fn(m, t, hook):
        return next_token_loss(m(t[:, :-1], layer_hook=hook), t)

    loss, grads = make_full_gradient_step(graphdef, rest, loss_fn)(params, tokens, jnp.float32(8.0))
    # The memory the ablation brings back: the whole tree, 2 B/param in the compute dtype.
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert sum(g.nbytes for g in jax.tree.leaves(grads)) == 2 * sum(p.size for p in jax.tree.leaves(params))
    sumsq, nonfinite = post_backward_stats(grads)
    want = sum(float(jnp.sum(jnp.square(g.astype(jnp.float32)))) for g in jax.tree.leaves(grads))
    assert nonfinite == 0 and sumsq == pytest.approx(want, rel=1e-6)
    leaves = jax.tree.leaves(grads)
    leaves[0] = leaves[0].reshape(-1).at[3].set(jnp.inf).at[5].set(jnp.nan)
    sumsq_bad, nonfinite_bad = post_backward_stats(leaves)
    assert nonfinite_bad == 2 and np.isfinite(sumsq_bad)
    total = total_stats({"all": jnp.asarray([sumsq, nonfinite], jnp.float32)})
    assert float(total[0]) == pytest.approx(sumsq, rel=1e-6) and int(total[1]) == 0
