"""Checkpoints: bit-exact round trips of params, optax state, SSD-resident arrays and meta; plain
Orbax/tensorstore reading every array without jaxascend; refusals with messages (incompatible
config, missing step, corrupt files); half-written checkpoints (SIGKILL during a save) never
picked; host memory during an SSD save bounded by the arena."""

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from jaxascend.checkpoint import (ArraySpec, CheckpointError, Checkpointer, IncompatibleCheckpointError, Span,
                                  SsdArrays, checkpoint_arena_requests)
from jaxascend.checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError
from jaxascend.checkpoint.resume import check_compatible
from jaxascend.checkpoint.zarr_layout import chunk_grid, zarr_chunk_shape
from jaxascend.config import CheckpointConfig, Config, ModelConfig, OffloadConfig, TrainConfig
from jaxascend.ssd import ArenaPlan, HostArena, SsdStore

BLOCK = 16384


def offload_cfg(path, **kw):
    fields = dict(dir=str(path), block_bytes=BLOCK, staging_bytes=4 * BLOCK, chunk_bytes=4 * BLOCK,
                  shard_bytes=64 * BLOCK, io_threads=3, pin_memory=False)
    fields.update(kw)
    return OffloadConfig(**fields)


def run_config(**model):
    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100)
    fields.update(model)
    return Config(model=ModelConfig(**fields))


class Layout:
    """Stacked leaves whose master|m|v are interleaved by chunk, as the offloaded state's are, but
    with records of 12 * chunk bytes, at offsets that are not whole SSD blocks."""

    def __init__(self, leaves, chunk_elements):
        self.leaves, self.chunk_elements = leaves, chunk_elements


class Leaf:
    def __init__(self, path, shape, stacked):
        self.path, self.shape = path, shape
        layers = shape[0] if stacked else 1
        self.layer_elements = int(np.prod(shape)) // layers
        self.state_regions = tuple(f"{path}/L{i}/state" for i in range(layers))


def write_interleaved(store, layout, values):
    """Writes {tensor: {path: array}} into the leaves' state regions, master|m|v per chunk."""
    c = layout.chunk_elements
    for leaf in layout.leaves:
        per_layer = leaf.layer_elements
        for layer, region in enumerate(leaf.state_regions):
            buf = np.empty(3 * per_layer, np.float32)
            for start in range(0, per_layer, c):
                n = min(c, per_layer - start)
                for k, t in enumerate(("master", "m", "v")):
                    flat = values[t][leaf.path].reshape(-1)[layer * per_layer + start:][:n]
                    buf[3 * start + k * n:3 * start + (k + 1) * n] = flat
            store.write(region, buf)


def interleaved_specs(layout) -> list[ArraySpec]:
    """The arrays master, m and v of every leaf, gathered from the records write_interleaved wrote."""
    specs, c = [], layout.chunk_elements
    for leaf in layout.leaves:
        spans = {t: [] for t in ("master", "m", "v")}
        for region in leaf.state_regions:
            for start in range(0, leaf.layer_elements, c):
                n = min(c, leaf.layer_elements - start)
                for k, t in enumerate(spans):
                    spans[t].append(Span(region, 12 * start + 4 * k * n, 4 * n))
        specs += [ArraySpec(f"{t}/{leaf.path}", leaf.shape, np.float32, tuple(spans[t])) for t in spans]
    return specs


@pytest.fixture
def ssd(tmp_path):
    """A store holding an interleaved layout (2 stacked leaves) and contiguous arrays (bf16, a
    0-d fp32, and two sharing one region at unaligned offsets); yields (SsdArrays, values)."""
    cfg = offload_cfg(tmp_path / "offload")
    plan = ArenaPlan().extend(SsdStore.arena_requests(cfg)).extend(checkpoint_arena_requests(cfg))
    arena = HostArena(plan, cfg)
    store = SsdStore(cfg, arena)
    rng = np.random.default_rng(0)
    layout = Layout([Leaf("layers/mlp/w", (2, 77, 131), True), Leaf("embed/w", (50, 33), False)], chunk_elements=3000)
    values = {t: {leaf.path: rng.standard_normal(leaf.shape).astype(np.float32) for leaf in layout.leaves}
              for t in ("master", "m", "v")}
    for leaf in layout.leaves:
        for region in leaf.state_regions:
            store.add_region(region, 12 * leaf.layer_elements)
    write_interleaved(store, layout, values)
    specs = interleaved_specs(layout)
    flat = {s.name: values[s.keys[0]]["/".join(s.keys[1:])] for s in specs}
    extra = {"scale/h": rng.standard_normal((300, 77)).astype(ml_dtypes.bfloat16),
             "packed/a": rng.standard_normal(1001).astype(np.float32),
             "packed/b": rng.standard_normal((3, 1111)).astype(np.float32)}
    store.add_region("h", extra["scale/h"].nbytes)
    store.write("h", extra["scale/h"])
    extra["scale/s"] = np.float32(rng.standard_normal())  # a 0-d array
    store.add_region("s", 4)
    store.write("s", np.asarray(extra["scale/s"]))
    store.add_region("packed", 4 * 1001 + 4 * 3333)
    store.write("packed", np.concatenate([extra["packed/a"], extra["packed/b"].ravel()]))
    specs += [("scale/h", "h", 0, (300, 77), "bfloat16"), ("scale/s", "s", 0, (), np.float32),
              ("packed/a", "packed", 0, (1001,), np.float32),
              ("packed/b", "packed", 4 * 1001, (3, 1111), np.float32)]
    flat.update(extra)
    with store:
        yield SsdArrays(store, specs), flat
    arena.close()


def region_bytes(arrays: SsdArrays) -> dict:
    return {r.name: arrays.store.read(r.name) for r in arrays.store.regions()}


def scramble(arrays: SsdArrays) -> None:
    for r in arrays.store.regions():
        arrays.store.write(r.name, np.full(r.nbytes, 0xAB, np.uint8))


def small_state():
    params = {"embed": jnp.asarray(np.random.default_rng(1).standard_normal((100, 32)), jnp.bfloat16),
              "layers": {"w": jnp.arange(2 * 32 * 64, dtype=jnp.float32).reshape(2, 32, 64) / 7}}
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    _, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    return params, opt_state


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.reshape(-1).view(np.uint8),
                                                                        b.reshape(-1).view(np.uint8))


def trees_same_bits(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(same_bits(x, y) for x, y in zip(la, lb))


def save_one(directory, ssd_arrays, step=3, cfg=None, **kw):
    params, opt_state = small_state()
    cfg = cfg or run_config()
    with Checkpointer(CheckpointConfig(dir=str(directory), **kw), run_config=cfg) as ckpt:
        ckpt.save(step, params=params, opt_state=opt_state, ssd=ssd_arrays,
                  rng=jax.random.key_data(jax.random.key(7)),
                  meta={"data_state": {"epoch": 1, "document": 5, "token": 17},
                        "loss_scale": {"scale": np.float32(32768.0), "good_steps": np.int32(12)}})
    return params, opt_state


# ----------------------------------------------------------------------------- layout helpers
def test_zarr_chunks_are_contiguous_runs_of_rows_within_the_budget():
    for shape, isz, budget in [((100, 30), 4, 1000), ((4, 5, 1001), 4, 4000), ((10,), 2, 6), ((3, 7), 4, 4)]:
        chunks = zarr_chunk_shape(shape, isz, budget)
        assert int(np.prod(chunks)) * isz <= max(budget, isz)
        grid = chunk_grid(shape, chunks)
        assert [fs for _, _, fs, _ in grid] == [0] + [fe for _, _, _, fe in grid[:-1]]  # tiles the flat range
        ref = np.arange(int(np.prod(shape))).reshape(shape)
        for _, box, fs, fe in grid:
            np.testing.assert_array_equal(ref[box].reshape(-1), np.arange(fs, fe))


def test_array_specs_are_validated(tmp_path):
    with pytest.raises(ValueError, match=r"spans of 'm/w' hold 8 bytes; float32\(3,\) is 12 bytes"):
        ArraySpec("m/w", (3,), np.float32, [Span("r", 0, 8)])
    with pytest.raises(ValueError, match="ArraySpec.name"):
        ArraySpec("m//w", (3,), np.float32, [Span("r", 0, 12)])
    with pytest.raises(ValueError, match=r"array 'm' is a prefix of 'm/w'"):
        SsdArrays(None, [("m", "r", 0, (3,), np.float32), ("m/w", "r", 12, (3,), np.float32)])
    with pytest.raises(ValueError, match="map to the same directory 'a.b'"):
        SsdArrays(None, [("a/b", "r", 0, (3,), np.float32), ("a.b", "r", 12, (3,), np.float32)])


def test_too_few_checkpoint_slots_is_a_clear_error(tmp_path, ssd):
    arrays, _ = ssd
    with pytest.raises(ValueError, match=r"0 slot\(s\) of class 'nope'.*checkpoint_arena_requests"):
        Checkpointer(CheckpointConfig(dir=str(tmp_path / "c"))).save(
            1, params={"x": np.ones(3)}, ssd=SsdArrays(arrays.store, arrays.specs, slot_class="nope"))


# ----------------------------------------------------------------------------- round trip
def test_round_trip_is_bit_identical(tmp_path, ssd):
    arrays, _ = ssd
    before = region_bytes(arrays)
    params, opt_state = save_one(tmp_path / "ckpt", arrays, async_save=True)
    scramble(arrays)
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")), run_config=run_config()) as ckpt:
        assert ckpt.all_steps() == [3] and ckpt.latest_step() == 3 and ckpt.resume_step("auto") == 3
        r = ckpt.restore(3, params_like=abstract(params), opt_state_like=abstract(opt_state), ssd=arrays)
    assert r.step == 3
    assert trees_same_bits(r.params, params)
    assert trees_same_bits(r.opt_state, opt_state)
    assert same_bits(r.rng, jax.random.key_data(jax.random.key(7)))
    assert r.meta == {"data_state": {"epoch": 1, "document": 5, "token": 17},
                      "loss_scale": {"scale": 32768.0, "good_steps": 12}}
    assert r.config["model"]["hidden_size"] == 32
    after = region_bytes(arrays)
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)


def test_plain_orbax_and_tensorstore_read_every_array_without_jaxascend(tmp_path, ssd):
    arrays, values = ssd
    params, opt_state = save_one(tmp_path / "ckpt", arrays)
    out = tmp_path / "read.npz"
    reader = textwrap.dedent(f"""
        import json, sys
        import numpy as np, orbax.checkpoint as ocp, tensorstore as ts
        step = "{tmp_path / 'ckpt' / '3'}"
        got = {{}}
        for item in ("params", "offloaded", "rng"):
            for i, tree in enumerate((ocp.StandardCheckpointer().restore(f"{{step}}/{{item}}"),
                                      ocp.PyTreeCheckpointer().restore(f"{{step}}/{{item}}"))):
                def walk(prefix, node):
                    if isinstance(node, dict):
                        for k, v in node.items():
                            walk(prefix + "/" + k, v)
                    else:
                        got[f"{{i}}:{{item}}{{prefix}}"] = np.asarray(node)
                walk("", tree)
        got["ts:m/layers/mlp/w"] = ts.open({{"driver": "zarr", "kvstore": {{"driver": "file",
            "path": f"{{step}}/offloaded/m.layers.mlp.w"}}}}).result().read().result()
        got["ts:params/embed"] = ts.open({{"driver": "zarr", "kvstore": {{"driver": "ocdbt",
            "base": f"file://{{step}}/params", "path": "embed"}}}}).result().read().result()
        meta = json.load(open(f"{{step}}/meta/metadata"))
        assert "jaxascend" not in sys.modules
        dtypes = {{k: v.dtype.name for k, v in got.items()}}  # npz has no bfloat16: keep bytes + names
        np.savez("{out}", meta=json.dumps(meta["meta"]), dtypes=json.dumps(dtypes),
                 **{{k.replace("/", "|"): v.reshape(-1).view(np.uint8) for k, v in got.items()}})
    """)
    proc = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = dict(np.load(out, allow_pickle=False))
    dtypes = json.loads(str(saved.pop("dtypes")))
    meta = json.loads(str(saved.pop("meta")))
    got = {k.replace("|", "/"): v for k, v in saved.items()}

    def same_bits(raw, value):  # the bytes and dtype name the reader got, against the saved value
        value = np.asarray(value)
        return (raw.tobytes() == value.tobytes()) and dtypes[name_of[id(raw)]] == value.dtype.name

    name_of = {id(v): k for k, v in got.items()}
    for i in (0, 1):
        for name, value in values.items():
            assert same_bits(got[f"{i}:offloaded/{name}"], value), name
        assert same_bits(got[f"{i}:params/embed"], params["embed"])
        assert same_bits(got[f"{i}:params/layers/w"], params["layers"]["w"])
        assert same_bits(got[f"{i}:rng/key"], jax.random.key_data(jax.random.key(7)))
    assert same_bits(got["ts:m/layers/mlp/w"], values["m/layers/mlp/w"])
    assert same_bits(got["ts:params/embed"], params["embed"])
    assert meta["data_state"]["token"] == 17


# ----------------------------------------------------------------------------- refusals
def test_incompatible_config_is_refused_naming_fields_and_values(tmp_path, ssd):
    arrays, _ = ssd
    save_one(tmp_path / "ckpt", arrays)
    cfg = run_config(hidden_size=64, dtype="float16")
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")), run_config=cfg) as ckpt:
        with pytest.raises(IncompatibleCheckpointError) as err:
            ckpt.restore(3, ssd=arrays)
    msg = str(err.value)
    assert "model.hidden_size: checkpoint has 32, this run has 64" in msg
    assert "model.dtype: checkpoint has 'bfloat16', this run has 'float16'" in msg
    assert str(tmp_path / "ckpt" / "3") in msg
    check_compatible({"model": {"lr": 1}}, {"model": {"lr": 2}}, "x")  # other fields may change


def test_params_of_another_shape_or_dtype_are_refused_naming_the_leaf(tmp_path, ssd):
    arrays, _ = ssd
    params, _ = save_one(tmp_path / "ckpt", arrays)
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")), run_config=run_config()) as ckpt:
        other = dict(params, embed=jax.ShapeDtypeStruct((120, 32), jnp.bfloat16))
        with pytest.raises(IncompatibleCheckpointError, match=r"params leaf 'embed' is bfloat16\(100, 32\) in the "
                                                              r"checkpoint, bfloat16\(120, 32\) in this run"):
            ckpt.restore(3, params_like=other, ssd=arrays)
        other = dict(params, embed=jax.ShapeDtypeStruct((100, 32), jnp.float32))
        with pytest.raises(IncompatibleCheckpointError, match=r"'embed' is bfloat16\(100, 32\) in the checkpoint, "
                                                              r"float32\(100, 32\)"):
            ckpt.restore(3, params_like=other, ssd=arrays)


def test_ssd_arrays_of_another_shape_are_refused(tmp_path, ssd):
    arrays, _ = ssd
    save_one(tmp_path / "ckpt", arrays)
    specs = list(arrays.specs)
    specs[-1] = ("packed/b", "packed", 4 * 1001, (1111, 3), np.float32)
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")), run_config=run_config()) as ckpt:
        with pytest.raises(IncompatibleCheckpointError, match=r"array 'packed/b' is float32\(3, 1111\) in the "
                                                              r"checkpoint, float32\(1111, 3\) in this run"):
            ckpt.restore(3, ssd=SsdArrays(arrays.store, specs))
        with pytest.raises(IncompatibleCheckpointError, match=r"holds SSD-resident optimizer state"):
            ckpt.restore(3)


def test_resume_step_missing_or_directory_missing_is_reported(tmp_path, ssd):
    arrays, _ = ssd
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "nothing"))) as ckpt:
        with pytest.raises(CheckpointNotFoundError, match=f"train.resume=4: checkpoint directory "
                                                          f"{tmp_path / 'nothing'} does not exist"):
            ckpt.resume_step(4)
        assert ckpt.resume_step("auto") is None and ckpt.resume_step("none") is None
    params, _ = small_state()
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt"), async_save=False)) as ckpt:
        for step in (2, 4):
            ckpt.save(step, params=params, ssd=arrays)
        with pytest.raises(CheckpointError, match=r"checkpoint for step 4 already exists"):
            ckpt.save(4, params=params)
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt"))) as ckpt:
        assert ckpt.resume_step("auto") == 4 and ckpt.resume_step(2) == 2 and ckpt.resume_step("none") is None
        with pytest.raises(CheckpointNotFoundError, match=rf"no complete checkpoint for step 3 in "
                                                          rf"{tmp_path / 'ckpt'} \(available steps: \[2, 4\]\)"):
            ckpt.resume_step(3)
        assert ckpt.should_save(10, 25) is False and ckpt.should_save(25, 25) is True


def test_default_directory_is_under_the_run_output(tmp_path):
    cfg = Config(train=TrainConfig(out_dir=str(tmp_path / "run")))
    with Checkpointer(cfg.checkpoint, run_config=cfg) as ckpt:
        assert ckpt.directory == tmp_path / "run" / "checkpoints" and ckpt.all_steps() == []
    with pytest.raises(ValueError, match="checkpoint.dir is unset"):
        Checkpointer(CheckpointConfig())


def test_keep_last_and_every_steps(tmp_path):
    params, _ = small_state()
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "c"), keep_last=2, every_steps=5)) as ckpt:
        for step in range(1, 13):
            if ckpt.should_save(step, 12):
                ckpt.save(step, params=params)
        ckpt.wait()
        assert ckpt.all_steps() == [10, 12]


def corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[:len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


# Orbax leaves coroutines of a failed OCDBT read un-awaited; collected here, not in a later test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("target, how, message", [
    ("offloaded/m.layers.mlp.w/1.0.0", "garble", "checkpoint file {path} is corrupt: its data has crc32c"),
    ("offloaded/m.layers.mlp.w/0.0.0", "truncate", "checkpoint file {path} cannot be read"),
    ("offloaded/jaxascend_arrays.json", "truncate", "checkpoint file {path} is corrupt"),
    ("meta/metadata", "garble", "checkpoint file {path} is corrupt"),
    # The Orbax items' files are named through the crc32c recorded when the step was complete.
    ("params/_METADATA", "truncate", "checkpoint file {path} is corrupt: its data has crc32c"),
    ("params/<largest>", "garble", "checkpoint file {path} is corrupt: its data has crc32c"),
    ("params/<largest>", "truncate", "checkpoint file {path} is corrupt: its data has crc32c"),
])
def test_corrupt_checkpoint_file_is_reported_with_its_path(tmp_path, ssd, target, how, message):
    arrays, _ = ssd
    save_one(tmp_path / "ckpt", arrays)
    step_dir = tmp_path / "ckpt" / "3"
    if target.endswith("<largest>"):
        item = step_dir / target.split("/")[0]
        path = max((p for p in item.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    else:
        path = step_dir / target
    corrupt(path, how)
    params, opt_state = small_state()
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")), run_config=run_config()) as ckpt:
        with pytest.raises(CorruptCheckpointError) as err:
            ckpt.restore(3, params_like=abstract(params), opt_state_like=abstract(opt_state), ssd=arrays)
    expected = message.format(path=path, item=step_dir / "params")
    assert expected in str(err.value)
    gc.collect()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_params_without_file_checksums_still_names_the_leaf(tmp_path, ssd):
    # A step killed between its commit and its file-checksum record: the leaf checksums remain.
    arrays, _ = ssd
    save_one(tmp_path / "ckpt", arrays)
    step_dir = tmp_path / "ckpt" / "3"
    (step_dir / "jaxascend_files.json").unlink()
    item = step_dir / "params"
    corrupt(max((p for p in item.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size), "garble")
    params, opt_state = small_state()
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")), run_config=run_config()) as ckpt:
        with pytest.raises(CorruptCheckpointError, match=f"checkpoint item {item} is corrupt: leaf 'layers.w'"):
            ckpt.restore(3, params_like=abstract(params), opt_state_like=abstract(opt_state), ssd=arrays)
    gc.collect()


# ----------------------------------------------------------------------------- crash safety
def test_an_unfinalized_save_is_never_picked(tmp_path):
    params, _ = small_state()
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "c"))) as ckpt:
        ckpt.save(2, params=params)
    partial = tmp_path / "c" / "5.orbax-checkpoint-tmp-1234567"  # what a killed save leaves behind
    (partial / "params").mkdir(parents=True)
    (partial / "params" / "_METADATA").write_text("{")
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "c"), cleanup_partial=False)) as ckpt:
        assert ckpt.all_steps() == [2] and ckpt.resume_step("auto") == 2
        with pytest.raises(CheckpointNotFoundError, match=r"available steps: \[2\]"):
            ckpt.resume_step(5)
    assert partial.exists()
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "c"))) as ckpt:  # cleanup_partial (default)
        assert ckpt.all_steps() == [2]
    assert not partial.exists()


SAVE_LOOP = textwrap.dedent("""
    import sys, numpy as np
    from jaxascend.ssd.arena import ArenaPlan, HostArena
    from jaxascend.checkpoint.manager import Checkpointer
    from jaxascend.config import CheckpointConfig, OffloadConfig
    from jaxascend.checkpoint import SsdArrays, checkpoint_arena_requests
    from jaxascend.ssd.store import SsdStore
    root = sys.argv[1]
    cfg = OffloadConfig(dir=root + "/offload", block_bytes=65536, chunk_bytes=1 << 20, staging_bytes=1 << 20,
                        shard_bytes=1 << 30, pin_memory=False)
    arena = HostArena(ArenaPlan().extend(SsdStore.arena_requests(cfg)).extend(checkpoint_arena_requests(cfg)), cfg)
    store = SsdStore(cfg, arena)
    n = 6 << 20  # 24 MiB per region, 3 regions
    specs = []
    for name in ("master", "m", "v"):
        store.add_region(name, 4 * n)
        specs.append((name + "/w", name, 0, (n // 1024, 1024), np.float32))
    ssd = SsdArrays(store, specs)
    with Checkpointer(CheckpointConfig(dir=root + "/ckpt", keep_last=2, cleanup_partial=False)) as ckpt:
        for step in range(1, 10000):
            for name in ("master", "m", "v"):
                store.write(name, np.full(n, step, np.float32))
            ckpt.save(step, params={"w": np.full(1000, step, np.float32)}, ssd=ssd, meta={"step": step})
            print(step, flush=True)
""")


def test_sigkill_during_save_leaves_only_complete_checkpoints(tmp_path):
    for attempt in range(3):  # a save may finish between noticing it and the kill: try again
        root = tmp_path / f"try{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", SAVE_LOOP, str(root)], stdout=subprocess.PIPE, text=True)
        try:
            assert int(proc.stdout.readline()) == 1 and int(proc.stdout.readline()) == 2
            deadline = time.monotonic() + 60
            while not list((root / "ckpt").glob("*.orbax-checkpoint-tmp*/offloaded/*")):  # mid-stream
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.002)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        if list((root / "ckpt").glob("*.orbax-checkpoint-tmp*")):
            break
    partial = list((root / "ckpt").glob("*.orbax-checkpoint-tmp*"))
    assert partial, "the kill never landed during a save"
    cfg = offload_cfg(root / "offload2", chunk_bytes=1 << 20, block_bytes=65536, staging_bytes=1 << 20,
                      shard_bytes=1 << 30)
    plan = ArenaPlan().extend(SsdStore.arena_requests(cfg)).extend(checkpoint_arena_requests(cfg))
    n = 6 << 20
    with HostArena(plan, cfg) as arena, SsdStore(cfg, arena) as store:
        specs = []
        for name in ("master", "m", "v"):
            store.add_region(name, 4 * n)
            specs.append((name + "/w", name, 0, (n // 1024, 1024), np.float32))
        with Checkpointer(CheckpointConfig(dir=str(root / "ckpt"), cleanup_partial=False)) as ckpt:
            steps = ckpt.all_steps()
            latest = ckpt.resume_step("auto")
            assert steps and latest == max(steps)
            assert all(int(p.name.split(".")[0]) > latest for p in partial)  # the killed save is newer
            r = ckpt.restore(latest, params_like={"w": np.zeros(1000, np.float32)}, ssd=SsdArrays(store, specs))
        assert r.meta == {"step": latest} and np.all(r.params["w"] == latest)
        for name in ("master", "m", "v"):
            assert np.all(store.read(name, dtype=np.float32) == latest)


MEMORY_PROBE = textwrap.dedent("""
    import json, sys, numpy as np
    from jaxascend.ssd.arena import ArenaPlan, HostArena
    from jaxascend.checkpoint.manager import Checkpointer
    from jaxascend.config import CheckpointConfig, OffloadConfig
    from jaxascend.checkpoint import SsdArrays, checkpoint_arena_requests
    from jaxascend.ssd.store import SsdStore
    from jaxascend.ssd.store import Segment
    root = sys.argv[1]
    def hwm():
        return int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) * 1024
    def rss():
        return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) * 1024
    cfg = OffloadConfig(dir=root + "/offload", block_bytes=1 << 20, chunk_bytes=4 << 20, staging_bytes=1 << 20,
                        shard_bytes=1 << 30, pin_memory=False)
    arena = HostArena(ArenaPlan().extend(SsdStore.arena_requests(cfg)).extend(checkpoint_arena_requests(cfg)), cfg)
    store = SsdStore(cfg, arena)
    specs = []
    for i in range(12):  # 12 x 24 MiB = 288 MiB of state
        store.add_region(f"r{i}", 24 << 20)
        with store.stream([[Segment(f"r{i}", a, 4 << 20, read=False, write=True)] for a in range(0, 24 << 20, 4 << 20)],
                          "checkpoint") as s:
            for chunk in s:
                chunk.arrays[0][:] = i
        specs.append((f"state/r{i}", f"r{i}", 0, (6 << 10, 1024), np.float32))
    params = {"w": np.ones(1000, np.float32)}
    with Checkpointer(CheckpointConfig(dir=root + "/ckpt")) as ckpt:
        before = rss()
        open("/proc/self/clear_refs", "w").write("5")
        ckpt.save(1, params=params, ssd=SsdArrays(store, specs))
        ckpt.wait()
        peak = hwm()
    print(json.dumps({"increase": peak - before, "arena": arena.capacity}))
""")


def test_peak_rss_increase_during_an_ssd_save_stays_within_the_arena(tmp_path):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["arena"] < 32 << 20  # small next to the 288 MiB streamed
    assert result["increase"] <= result["arena"], result


# ----------------------------------------------------------------------------- with the AdamW owner
def test_offloaded_adam_state_resumes_bit_exactly_from_a_checkpoint(tmp_path):
    from jaxascend.offload import STATE_SLOT_CLASS, OffloadedAdamState, specs_for_offload_layout
    from jaxascend.optim import AdamHyperParams

    shapes = {"emb": (37, 13), "layers": {"w": (3, 129, 31)}, "norm": (5,)}
    stacked = {"emb": False, "layers": {"w": True}, "norm": False}
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    spec = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), shapes, is_leaf=is_shape)

    def tree(seed):
        rng = np.random.default_rng(seed)
        return jax.tree.map(lambda s: rng.standard_normal(s).astype(ml_dtypes.bfloat16), shapes, is_leaf=is_shape)

    def make(name):
        cfg = offload_cfg(tmp_path / name, block_bytes=4096, chunk_bytes=8192, staging_bytes=16384,
                          shard_bytes=64 * 4096)
        return OffloadedAdamState.create(spec, cfg, stacked=stacked, extra_requests=checkpoint_arena_requests(cfg))

    def hp(count):
        return AdamHyperParams(lr=1e-2, weight_decay=0.1, count=count)

    with make("a") as a, make("b") as b:
        a.init(jax.tree.map(lambda x: x.astype(np.float32), tree(0)))
        for count in range(2):
            a.write_grads(tree(count + 1))
            params = a.step(hp(count))
        with Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")), run_config=run_config()) as ckpt:
            ckpt.save(2, params=params, ssd=SsdArrays(a.store, specs_for_offload_layout(a.layout)),
                      meta={"updates_applied": a.updates_applied})
        a.write_grads(tree(3))
        expected = a.step(hp(2))
        # The resumed owner streams through its own (idle) step slots: no checkpoint slots needed.
        with Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")), run_config=run_config()) as ckpt:
            r = ckpt.restore(ckpt.resume_step("auto"), params_like=params,
                             ssd=SsdArrays(b.store, specs_for_offload_layout(b.layout), slot_class=STATE_SLOT_CLASS))
        b.restored(r.meta["updates_applied"])
        assert trees_same_bits(r.params, params)
        b.write_grads(tree(3))
        assert trees_same_bits(b.step(hp(2)), expected)
        for leaf in a.layout.leaves:
            for which in ("master", "m", "v"):
                assert same_bits(b.read_state(leaf.index, which), a.read_state(leaf.index, which)), (leaf.path, which)


def test_in_memory_trainer_state_round_trip(tmp_path):
    """nnx.State params and the in-memory trainer's optax state, restored into their own types."""
    from flax import nnx

    from jaxascend.optim import adamw_in_memory

    class Tiny(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(100, 8, rngs=rngs)
            self.proj = nnx.Linear(8, 16, rngs=rngs)

    cfg = run_config()
    _, params, _ = nnx.split(Tiny(nnx.Rngs(0)), nnx.Param, ...)
    tx = adamw_in_memory(cfg.optimizer, total_steps=10)
    opt_state = tx.init(params)
    _, opt_state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), opt_state, params)
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "c")), run_config=cfg) as ckpt:
        ckpt.save(1, params=params, opt_state=opt_state, meta={"data_state": {"epoch": 0}})
    _, fresh, _ = nnx.split(Tiny(nnx.Rngs(1)), nnx.Param, ...)
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "c")), run_config=cfg) as ckpt:
        r = ckpt.restore(ckpt.resume_step("auto"), params_like=fresh, opt_state_like=tx.init(fresh))
    assert isinstance(r.params, nnx.State) and trees_same_bits(r.params, params)
    assert trees_same_bits(r.opt_state, opt_state)
