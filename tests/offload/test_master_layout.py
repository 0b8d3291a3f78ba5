"""A bfloat16 master (``optimizer.master_dtype``): where it sits, what a step moves, what the
plan says. A resident leaf's records hold it (``master[n] | comp[n] | m | v``, the companion with
``compensated`` rounding); a streamed leaf's records hold none: its params region, the weights
the forward streams, is the master, read and written by the update. A float32 master's records
are as they always were."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxascend.config import ConfigError, load_config
from jaxascend.hf import model_config_from_hf_dict, preset_config
from jaxascend.offload import OffloadLayout, specs_for_offload_layout
from jaxascend.optim import StateFormat, StateRecord
from jaxascend.planning import plan_run
from tests.offload.test_state import offload_cfg

SPEC = {"emb": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16),
        "layers": {"w": jax.ShapeDtypeStruct((3, 32, 48), jnp.bfloat16)}}


def _stacked(path, shape):
    return path.startswith("layers")


@pytest.mark.parametrize("fmt, master, comp, m_offset", [
    (StateFormat(), 4, 0, 400),
    (StateFormat.of("float32", master="bfloat16", master_rounding="compensated"), 2, 2, 400),
    (StateFormat.of("float32", master="bfloat16", master_rounding="stochastic"), 2, 0, 200),
    (StateFormat.of("int8", 256, master="bfloat16", master_rounding="stochastic"), 2, 0, 200),
    (StateFormat("float32", master="bfloat16", master_elsewhere=True), 0, 2, 200),
])
def test_a_record_holds_its_master_and_companion_first(fmt, master, comp, m_offset):
    record = StateRecord(fmt, 100)
    assert (fmt.master_itemsize, fmt.companion_itemsize, record.m_offset) == (master, comp, m_offset)
    raw = bytearray(record.nbytes)
    views = record.views(np.frombuffer(raw, np.uint8))
    assert views[0].nbytes == master * 100
    assert (record.companion(np.frombuffer(raw, np.uint8)) is None) == (comp == 0)
    assert fmt.bytes_per_element == pytest.approx(master + comp + 2 * fmt.moment_itemsize + (8 / fmt.block if fmt.block
                                                                                             else 0))


def test_the_format_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match="master dtype 'float16' is not one of float32, bfloat16"):
        StateFormat.of(master="float16")
    with pytest.raises(ValueError, match="master rounding 'up' is not one of compensated, stochastic, nearest"):
        StateFormat.of(master="bfloat16", master_rounding="up")
    assert StateFormat.of(master="bfloat16", master_rounding="nearest").companion_itemsize == 0  # the ablation
    assert StateFormat.of(master_rounding="stochastic").master_rounding == "compensated"  # float32: not rounded
    assert "master_dtype" not in StateFormat().describe()  # a float32 master's checkpoints are as before
    assert StateFormat.of(master="bfloat16", master_rounding="stochastic").describe()["master_rounding"] == "stochastic"


@pytest.mark.parametrize("rounding", ["compensated", "stochastic"])
def test_a_streamed_leafs_master_is_its_params_region(tmp_path, rounding):
    cfg = offload_cfg(tmp_path, chunk_bytes="8KiB")
    fp32 = OffloadLayout.plan(SPEC, cfg, _stacked, stream_params=True)
    fmt = StateFormat.of("float32", master="bfloat16", master_rounding=rounding)
    bf16 = OffloadLayout.plan(SPEC, cfg, _stacked, stream_params=True, state=fmt)
    emb, w = (leaf for leaf in bf16.leaves)
    assert not emb.streamed and w.streamed and bf16.masters_in_params
    assert bf16.record_format(emb) is fmt and bf16.record_format(w).master_elsewhere
    companion = 2 if rounding == "compensated" else 0
    # the stack's records: no master; the table's: a 2-byte one
    assert bf16.state_layer_bytes(w) < fp32.state_layer_bytes(w)
    assert {ref.record.state.master_itemsize for ref in bf16.chunks() if ref.leaf is w} == {0}
    records = lambda layout: sum(ref.record.nbytes for ref in layout.chunks())  # noqa: E731  (unpadded)
    assert records(bf16) - records(fp32) == -(4 - companion) * w.size - (2 - companion) * emb.size
    read, write = bf16.step_bytes
    assert read == bf16.state_bytes + bf16.grad_bytes + bf16.streamed_param_bytes  # the update reads the master
    assert write == bf16.state_bytes + bf16.streamed_param_bytes
    names = {spec.name.split("/")[0] for spec in specs_for_offload_layout(bf16)}
    assert names == {"master", "m", "v"} | ({"master_comp"} if companion else set())  # no "params/": the master
    [master_w] = [s for s in specs_for_offload_layout(bf16) if s.name == "master/layers/w"]
    assert master_w.dtype == jnp.bfloat16 and {span.region for span in master_w.spans} == set(w.param_regions)


@pytest.mark.parametrize("master, rounding, state, most", [
    ("float32", "compensated", "float32", 31.5),  # (the overlapped forward takes every layer in memory)
    ("bfloat16", "compensated", "int8", 17.8),
    ("bfloat16", "stochastic", "int8", 13.8),  # the target: at most 16 B/param a step
])
def test_the_7b_plan_moves_fewer_bytes_with_a_bfloat16_master(tmp_path, master, rounding, state, most):
    hf = preset_config("qwen2", "7B")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = load_config("configs/qwen2.5-7b.yaml", [f"train.out_dir={tmp_path / 'run'}", f"model.path={tmp_path}",
                                                    f"optimizer.master_dtype={master}",
                                                    f"optimizer.master_rounding={rounding}",
                                                    f"optimizer.state_dtype={state}",
                                                    "offload.gradients=ssd",  # (auto: as this machine's RAM allows)
                                                    # the README table's chunks (a chunk's int8 record is padded
                                                    # to whole 1 MiB blocks: 16 MiB chunks move 0.4 B/param more)
                                                    "offload.chunk_bytes=256MiB"], inputs=False)
    model_cfg = model_config_from_hf_dict(hf, base=cfg.model)
    plan = plan_run(cfg, model_cfg, "ssd", runtime_bytes=0, levers=False)
    moved = (plan.ssd_read_step + plan.ssd_write_step) / plan.num_params
    assert most - 1.5 < moved <= most


@pytest.mark.parametrize("overrides, message", [
    (["offload.enabled=false", "model.dtype=bfloat16"],
     "optimizer.master_dtype: 'bfloat16' needs offload.enabled: true (the in-memory engine keeps optax's float32 "
     "weights)"),
    (["model.dtype=float32"], "optimizer.master_dtype: 'bfloat16' needs model.dtype: bfloat16 (the compute weights "
                              "are the master), got 'float32'"),
])
def test_a_bfloat16_master_refuses_what_it_cannot_run(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", ["optimizer.master_dtype=bfloat16", *overrides], inputs=False)
    assert str(err.value) == message


@pytest.mark.parametrize("rounding", ["compensated", "stochastic"])
def test_master_weights_block_by_block_are_the_masters_high_half(rounding):
    """The compute copy of a bfloat16 master, built a block at a time (a whole leaf's temporaries
    would take 12 B/param at init), equals the master's bits, NaNs and ties included."""
    from jaxascend.offload.initial_state import master_parts, master_weights
    fmt = StateFormat(dtype="float32", master="bfloat16", master_rounding=rounding)
    x = np.random.default_rng(3).standard_normal((5, 7, 3)).astype(np.float32)
    x.reshape(-1)[:4] = [np.nan, 1.0 + 2.0 ** -8, -(1.0 + 2.0 ** -8), np.inf]
    out = master_weights(x, fmt, block=16)
    assert out.shape == x.shape and out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out.reshape(-1).view(np.uint16), master_parts(x.reshape(-1), fmt)[0])
