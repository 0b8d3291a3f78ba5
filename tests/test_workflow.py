"""The fine-tuning workflow as a new user meets it, through the two CLIs: master weights from the
checkpoint's own values, the model's tokenizer by default, exports from any run or checkpoint
with the source's metadata and dtype, nothing written for a refused run, every failure one line,
and resume bookkeeping (one metrics curve, keep_last, a way past a corrupt newest checkpoint)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

from jaxascend.hf import NO_TOKENIZER_NOTE, CheckpointFiles, make_hf_checkpoint
from tests._corpus import write_word_corpus

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
    "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32", "data.batch_size=2",
    "train.progress=false", "train.log_every=1", "offload.chunk_bytes=1MiB", "offload.staging_bytes=1MiB",
    "checkpoint.async_save=false", "optimizer.warmup_steps=0",
]
FINE_TUNE = [  # a tiny Hugging Face model: shape from its config.json
    "data.seq_len=32", "data.batch_size=2", "train.progress=false", "train.log_every=1",
    "offload.chunk_bytes=1MiB", "offload.staging_bytes=1MiB", "checkpoint.async_save=false",
    "optimizer.warmup_steps=0",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words_per_doc=300)


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory):
    """A random fp32 Qwen2 in Hugging Face layout with tokenizer files and a generation config."""
    folder = make_hf_checkpoint("qwen2", "tiny", tmp_path_factory.mktemp("hf") / "qwen-fp32", dtype="float32")
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 7, "eos_token_id": 9,
                                                               "temperature": 0.7, "top_p": 0.8}))
    config = json.loads((folder / "config.json").read_text())
    config.update(bos_token_id=7, eos_token_id=9, pad_token_id=3)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def train(out: Path, *overrides: str, config: str = "configs/tiny.yaml", env: dict | None = None,
          cwd: Path = REPO) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "jaxascend.train", "--config", str(REPO / config), "--set", f"train.out_dir={out}"]
    for o in overrides:
        args += ["--set", o]
    full_env = {k: v for k, v in os.environ.items() if k not in ("JAXASCEND_KILL_AT", "JAXASCEND_FAULT",
                                                                  "JAXASCEND_DEBUG")}
    full_env.update(env or {})
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=full_env, cwd=cwd)


def export(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxascend.export", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def scratch_run(out: Path, corpus: Path, *overrides: str, **kwargs) -> subprocess.CompletedProcess:
    return train(out, *SMALL, f"data.paths=[{corpus}]", "data.include=['*.txt']", *overrides, **kwargs)


def fine_tune(out: Path, corpus: Path, model: Path, *overrides: str, **kwargs) -> subprocess.CompletedProcess:
    return train(out, *FINE_TUNE, f"model.path={model}", f"data.paths=[{corpus}]", "data.include=['*.txt']",
                 *overrides, **kwargs)


def assert_one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """The CLI contract: exit 2 and exactly one line on stderr, ``error: ...``, the last; before
    it only the ``note:`` lines a run that started prints (its choices)."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), proc.stderr[-3000:]
    assert all(line.startswith("note: ") for line in lines[:-1]), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]


def tensors(folder: Path) -> dict[str, np.ndarray]:
    with CheckpointFiles(folder) as ckpt:
        return {name: ckpt.read(entry) for name, entry in ckpt.entries.items()}


def metrics_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def flip_byte(path: Path, at: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- the weights


def test_master_weights_start_from_the_fp32_checkpoint_not_the_bf16_copy(tmp_path, corpus, fp32_model):
    # bf16 compute params (every shipped HF config), learning rate 0: the export must be the source.
    proc = fine_tune(tmp_path / "run", corpus, fp32_model, "model.param_dtype=bfloat16", "model.dtype=bfloat16",
                     "optimizer.learning_rate=0", "optimizer.warmup_steps=0", "train.steps=1", "export.enabled=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    source, exported = tensors(fp32_model), tensors(tmp_path / "run" / "hf")
    assert set(exported) <= set(source) and len(exported) >= 10
    changed = [name for name, x in exported.items() if x.dtype != source[name].dtype
               or x.tobytes() != source[name].tobytes()]
    assert not changed, f"{len(changed)}/{len(exported)} tensors changed, e.g. {changed[:3]}"
    # export.dtype: source (the default) kept float32; the generation config came along.
    assert all(x.dtype == np.float32 for x in exported.values())
    assert json.loads((tmp_path / "run" / "hf" / "generation_config.json").read_text())["top_p"] == 0.8


def test_export_dtype_source_follows_a_bf16_checkpoint(tmp_path, corpus):
    model = make_hf_checkpoint("llama", "tiny", tmp_path / "llama-bf16", dtype="bfloat16")
    proc = fine_tune(tmp_path / "run", corpus, model, "train.steps=1", "export.enabled=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    assert {x.dtype.name for x in tensors(tmp_path / "run" / "hf").values()} == {"bfloat16"}


# ----------------------------------------------------------------------------- tokenizers


def test_a_pretrained_model_trains_on_its_own_tokenizer_by_default(tmp_path, corpus, fp32_model):
    from jaxascend.data import HFTokenizer

    proc = fine_tune(tmp_path / "run", corpus, fp32_model, "train.steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["data_state"]["vocab_size"] == HFTokenizer(fp32_model).vocab_size != 259
    # The byte tokenizer only when asked for.
    proc = fine_tune(tmp_path / "bytes", corpus, fp32_model, "train.steps=1", "data.tokenizer=byte")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "bytes" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["data_state"]["vocab_size"] == 259


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, corpus):
    from jaxascend.data import HFTokenizer, write_hf_tokenizer

    model = make_hf_checkpoint("llama", "tiny", tmp_path / "llama")
    config = json.loads((model / "config.json").read_text())
    texts = [(corpus / p).read_text() for p in os.listdir(corpus)] + [f"word{i} token{i}" for i in range(3000)]
    big = write_hf_tokenizer(tmp_path / "big-tokenizer", texts, vocab_size=4096)
    assert HFTokenizer(big).vocab_size > config["vocab_size"]
    proc = fine_tune(tmp_path / "run", corpus, model, "train.steps=1", f"data.tokenizer={big}")
    assert_one_error_line(proc, "data.tokenizer", f"has {config['vocab_size']}", "config.json")
    assert not (tmp_path / "run").exists()


def test_byte_tokenizer_export_keeps_the_sources_generation_config_and_token_ids(tmp_path, corpus, fp32_model):
    proc = fine_tune(tmp_path / "run", corpus, fp32_model, "train.steps=1", "data.tokenizer=byte",
                     "export.enabled=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf = tmp_path / "run" / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (7, 9, 3)
    assert json.loads((hf / "generation_config.json").read_text())["temperature"] == 0.7
    assert not (hf / "tokenizer.json").exists()
    # A successful run's note is one clean line: no raw Python warning with a source line.
    assert "Warning" not in proc.stderr and "warn(" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert f"note: {NO_TOKENIZER_NOTE}" in lines and all(line.startswith("note: ") for line in lines), proc.stderr


# ----------------------------------------------------------------------------- exports


def _master(step_dir: Path, name: str) -> np.ndarray:
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(step_dir / "offloaded" / f"master.{name}.value")}}
    return ts.open(spec).result().read().result()


def test_a_killed_run_exports_from_its_checkpoint_and_from_its_folder(tmp_path, corpus):
    run = tmp_path / "run"
    proc = scratch_run(run, corpus, "train.steps=6", "checkpoint.every_steps=2", "model.dtype=bfloat16",
                       env={"JAXASCEND_KILL_AT": "backward:4"})
    assert proc.returncode != 0 and not (run / "params.safetensors").exists()
    step_dir = run / "checkpoints" / "2"
    proc = export("--checkpoint", str(step_dir), "--out", str(tmp_path / "from-step"), "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    proc = export("--checkpoint", str(run), "--out", str(tmp_path / "from-run"), "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert "checkpoints/2" in proc.stdout  # the run folder's newest complete checkpoint
    a, b = tensors(tmp_path / "from-step"), tensors(tmp_path / "from-run")
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    # The fp32 master weights, exactly: HF stores [out, in], we store [in, out].
    gate = _master(step_dir, "layers.mlp.gate_proj.kernel")
    np.testing.assert_array_equal(a["model.layers.1.mlp.gate_proj.weight"], gate[1].T)
    np.testing.assert_array_equal(a["model.norm.weight"], _master(step_dir, "norm.scale"))


def test_an_in_memory_runs_checkpoint_exports_its_params(tmp_path, corpus):
    import orbax.checkpoint as ocp

    run = tmp_path / "run"
    proc = scratch_run(run, corpus, "train.steps=2", "checkpoint.every_steps=2", "offload.enabled=false",
                       "model.dtype=float32", "model.param_dtype=float32", "export.save_params=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = export("--checkpoint", str(run), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    params = ocp.StandardCheckpointer().restore(run / "checkpoints" / "2" / "params")
    exported = tensors(tmp_path / "hf")
    assert {x.dtype.name for x in exported.values()} == {"float32"}  # source: param_dtype from scratch
    np.testing.assert_array_equal(exported["model.layers.0.self_attn.q_proj.weight"],
                                  np.asarray(params["layers"]["self_attn"]["q_proj"]["kernel"]["value"][0]).T)


def test_the_readmes_export_command_works_after_a_shipped_config(tmp_path, corpus, fp32_model):
    readme = (REPO / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("python -m jaxascend.export"))
    args = command.split("#")[0].split()[3:]
    run = tmp_path / args[args.index("--checkpoint") + 1]  # the run folder the README exports
    proc = fine_tune(run, corpus, fp32_model, "train.steps=1", "offload.arena_bytes=64MiB",
                     "offload.chunk_bytes=1MiB", f"offload.dir={run}/offload", config="configs/qwen2.5-0.5b.yaml",
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "hf" / "config.json").exists()  # export.enabled: true in the shipped config
    proc = export(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / args[args.index("--out") + 1] / "config.json").exists()


# ----------------------------------------------------------------------------- refused runs


@pytest.mark.parametrize("override, fragment", [
    ("data.paths=[/no/such/dir]", "data.paths: '/no/such/dir' does not exist"),
    ("data.seq_len=100000", "data.seq_len: 100000 exceeds"),
    ("train.resume=4", "train.resume=4: checkpoint directory"),
    ("data.tokenizer=/no/such/tokenizer", "/no/such/tokenizer"),
])
def test_a_refused_run_writes_nothing(tmp_path, corpus, fp32_model, override, fragment):
    out = tmp_path / "run"
    proc = fine_tune(out, corpus, fp32_model, "train.steps=1", override)
    assert_one_error_line(proc, fragment)
    assert not out.exists(), sorted(p.name for p in out.iterdir())


# ----------------------------------------------------------------------------- failures are one line


def _finished_run(tmp_path, corpus, *extra) -> Path:
    out = tmp_path / "run"
    proc = scratch_run(out, corpus, "train.steps=4", "checkpoint.every_steps=2", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus):
    """A finished run of 4 steps with checkpoints 2 and 4, trained once; tests that break it
    take a copy (``finished_copy``), the others only read it."""
    return _finished_run(tmp_path_factory.mktemp("finished"), corpus)


@pytest.fixture
def finished_copy(tmp_path, finished) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out, symlinks=True)
    return out


def test_a_corrupt_optimizer_state_chunk_is_one_line(finished_copy, corpus):
    out = finished_copy
    chunk = out / "checkpoints" / "4" / "offloaded" / "master.norm.scale.value" / "0"
    flip_byte(chunk)
    proc = scratch_run(out, corpus, "train.steps=6", "checkpoint.every_steps=2")
    assert_one_error_line(proc, str(chunk), "corrupt")


def test_a_corrupt_params_file_is_one_line_naming_the_file(finished_copy, corpus):
    out = finished_copy
    data_files = sorted((out / "checkpoints" / "4" / "params").rglob("d/*"))
    target = max(data_files, key=lambda p: p.stat().st_size)
    flip_byte(target, at=target.stat().st_size // 2)
    proc = scratch_run(out, corpus, "train.steps=6", "checkpoint.every_steps=2")
    assert_one_error_line(proc, str(target))


def test_a_missing_meta_file_is_one_line(finished_copy, corpus):
    out = finished_copy
    meta = out / "checkpoints" / "4" / "meta" / "metadata"
    meta.unlink()
    proc = scratch_run(out, corpus, "train.steps=6", "checkpoint.every_steps=2")
    line = assert_one_error_line(proc, str(meta), "missing")
    assert "train.resume=2" in line  # the way out: the newest earlier checkpoint


def test_a_fresh_start_over_another_runs_checkpoints_is_refused(finished_copy, corpus):
    out = finished_copy
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    proc = scratch_run(out, corpus, "train.steps=4", "checkpoint.every_steps=2", "train.resume=none")
    assert_one_error_line(proc, "train.resume=none", "[2, 4]")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_a_gradient_write_failing_in_the_backward_pass_is_one_line(tmp_path, corpus):
    # Find the write count that lands in a gradient region: the first writes initialise the state.
    for n in (20, 24, 28, 32, 40, 60):
        out = tmp_path / f"run{n}"
        proc = scratch_run(out, corpus, "train.steps=2", "offload.preallocate=false", "offload.gradients=ssd",
                           env={"JAXASCEND_FAULT": f"write:{n}:ENOSPC"})
        if "grad_sink" in proc.stderr:
            assert_one_error_line(proc, "grad_sink", "ENOSPC", "/grad")
            return
        assert proc.returncode in (0, 2), proc.stderr[-3000:]
    pytest.fail("no injected write failure landed in a gradient region")


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return proc.returncode == 0


def _fill(disk: Path) -> None:
    """Writes a file until ``disk`` has no space left (another process filling the disk)."""
    try:  # the run's own checkpoint may have taken the last block already
        with open(disk / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    except OSError:
        pass


def test_a_full_disk_during_a_checkpoint_save_is_one_line_and_keeps_the_earlier_one(tmp_path, corpus):
    # The plan checks the free space before the run, so the disk fills while it runs: once the
    # first checkpoint is there, another file takes what is left.
    disk = tmp_path / "small-disk"
    if not _mount_tmpfs(disk, "1200k"):
        pytest.skip("needs root to mount a small tmpfs as a full disk")
    try:
        args = [sys.executable, "-m", "jaxascend.train", "--config", str(REPO / "configs/tiny.yaml")]
        for o in (f"train.out_dir={tmp_path / 'run'}", *SMALL, f"data.paths=[{corpus}]", "data.include=['*.txt']",
                  "train.steps=400", "checkpoint.every_steps=1", "checkpoint.keep_last=1", f"checkpoint.dir={disk}/ckpt"):
            args += ["--set", o]
        env = {k: v for k, v in os.environ.items() if k not in ("JAXASCEND_KILL_AT", "JAXASCEND_FAULT")}
        child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        deadline = time.monotonic() + 300
        while child.poll() is None and time.monotonic() < deadline:
            if (disk / "ckpt").is_dir() and any(p.name.isdigit() for p in (disk / "ckpt").iterdir()):
                _fill(disk)
                break
            time.sleep(0.05)
        out, err = child.communicate(timeout=600)
        assert_one_error_line(subprocess.CompletedProcess(args, child.returncode, out, err),
                              "saving checkpoint step", "No space left on device")
        steps = sorted(int(p.name) for p in (disk / "ckpt").iterdir() if p.name.isdigit())
        assert steps, "the first checkpoint should have fit"
        from jaxascend.checkpoint import read_meta

        assert read_meta(disk / "ckpt" / str(steps[-1]))["step"] == steps[-1]  # intact
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# ----------------------------------------------------------------------------- resume bookkeeping


def test_resume_leaves_one_metrics_curve(tmp_path, corpus):
    out = tmp_path / "run"
    proc = scratch_run(out, corpus, "train.steps=6", "checkpoint.every_steps=2",
                       env={"JAXASCEND_KILL_AT": "backward:6"})  # killed after logging step 5
    assert proc.returncode != 0
    assert metrics_steps(out) == [1, 2, 3, 4, 5]
    proc = scratch_run(out, corpus, "train.steps=6", "checkpoint.every_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert metrics_steps(out) == [1, 2, 3, 4, 5, 6]
    assert [json.loads(line)["step"] for line in (out / "metrics.superseded.jsonl").read_text().splitlines()] == [5]


def test_resuming_a_finished_run_keeps_keep_last_checkpoints(tmp_path, corpus):
    out = _finished_run(tmp_path, corpus, "checkpoint.every_steps=1", "checkpoint.keep_last=2")
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [3, 4]
    for steps in (4, 6):  # right after its final checkpoint; then on to more steps
        proc = scratch_run(out, corpus, f"train.steps={steps}", "checkpoint.every_steps=1", "checkpoint.keep_last=2")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [steps - 1, steps]


def test_an_explicit_earlier_step_replaces_a_corrupt_newest_checkpoint(finished, finished_copy, corpus):
    straight, out = finished, finished_copy
    flip_byte(out / "checkpoints" / "4" / "meta" / "metadata", at=40)
    line = assert_one_error_line(scratch_run(out, corpus, "train.steps=4", "checkpoint.every_steps=2"),
                                 "train.resume=2")
    assert "corrupt" in line
    proc = scratch_run(out, corpus, "train.steps=4", "checkpoint.every_steps=2", "train.resume=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [2, 4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["losses"] == json.loads((straight / "summary.json").read_text())["losses"]
