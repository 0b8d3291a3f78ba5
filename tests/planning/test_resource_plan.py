"""The run planner tells the truth: host memory against what the machine gives (no budget
needed), disk for the offload files and the checkpoints kept, per filesystem, offload.arena_bytes
checked before anything is allocated, activations by sequence length (attention's float32
scores), levers with figures, and a plan from config.json alone."""

import dataclasses
import json
import os
import subprocess
import sys
from collections import namedtuple

import jax
import pytest

from jaxascend.config import load_config
from jaxascend.devices import DEVICE_MEM_ENV
from jaxascend.hf import abstract_params, model_config_from_hf_dict, preset_config
from jaxascend.planning import disk_plan, machine_limits
from jaxascend.planning.resource_plan import PlanError, format_bytes, plan_run
from jaxascend.planning.step_memory import REMAT
from jaxascend.offload import job_state_layout
from jaxascend.preparation import resolve_model_config
from tests.test_workflow import assert_one_error_line

GiB = 2**30
SMALL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32", "data.batch_size=2",
         "offload.block_bytes=4096", "offload.chunk_bytes=16KiB", "offload.staging_bytes=64KiB",
         "offload.pin_memory=false", "train.progress=false"]


def _cfg(tmp_path, *overrides):
    return load_config("configs/tiny.yaml", SMALL + [f"train.out_dir={tmp_path / 'run'}", *overrides])


def _model(cfg, vocab=256):
    return dataclasses.replace(resolve_model_config(cfg), vocab_size=vocab)


@pytest.fixture
def roomy(monkeypatch):
    """A machine with memory and disk to spare, whatever this one has."""
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, "1TiB")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk_plan.shutil, "disk_usage", lambda path: usage(2**50, 0, 2**50))


def test_a_25_gib_plan_on_a_machine_with_23_gib_available_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, "23GiB")
    cfg = _cfg(tmp_path, "offload.gradients=ssd")  # auto would move them to SSD as the runtime grows
    model_cfg = _model(cfg)
    rest = plan_run(cfg, model_cfg, runtime_bytes=0).host_peak
    plan = plan_run(cfg, model_cfg, runtime_bytes=25 * GiB - rest)  # no host_memory_budget
    assert plan.host_peak == 25 * GiB and plan.budget is None and plan.host_limit == 23 * GiB
    with pytest.raises(PlanError) as err:
        plan.check()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("host memory: the plan needs 25.00 GiB, 2.00 GiB more than the 23.00 GiB available "
                              "(JAXASCEND_MEM_AVAILABLE_BYTES) (largest part: runtime, ")
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, "26GiB")
    assert plan_run(cfg, model_cfg, runtime_bytes=25 * GiB - rest).problems() == []


def test_host_levers_name_the_weights_on_ssd_and_remat_with_figures(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "model.remat=dots", "offload.params=resident", "model.dtype=bfloat16", "offload.gradients=ssd",
               "model.param_dtype=bfloat16", "model.hidden_size=512", "model.intermediate_size=1024",
               "model.num_hidden_layers=4", "model.num_attention_heads=8", "model.num_key_value_heads=4")
    model_cfg = _model(cfg)  # most of the weights in the layer stack
    plan = plan_run(cfg, model_cfg, runtime_bytes=0)
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, str(plan.host_peak - 2**20))
    plan = plan_run(cfg, model_cfg, runtime_bytes=0)
    streamed = plan_run(cfg, model_cfg, "ssd", runtime_bytes=0, levers=False)
    full = plan_run(cfg, dataclasses.replace(model_cfg, remat="full"), runtime_bytes=0, levers=False)
    levers = {lever.setting: lever for lever in plan.host_levers}
    assert levers["offload.params: ssd"].saves == plan.host_peak - streamed.host_peak > 0
    assert levers["model.remat: full"].saves == plan.host_peak - full.host_peak > 0
    assert levers["data.batch_size: 1"].saves > 0
    [problem] = plan.problems()
    assert problem.startswith("host memory: the plan needs ") and "\n" not in problem
    assert f"offload.params: ssd saves {format_bytes(plan.host_peak - streamed.host_peak)} (needs " in problem
    assert f"model.remat: full saves {format_bytes(plan.host_peak - full.host_peak)} (needs " in problem


def test_checkpoints_are_counted_and_named_when_they_do_not_fit(tmp_path, monkeypatch):
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, "1TiB")
    cfg = _cfg(tmp_path, "checkpoint.every_steps=10", "train.steps=100", "checkpoint.keep_last=2",
               "export.save_params=false")
    model_cfg = _model(cfg)
    fits = plan_run(cfg, model_cfg, runtime_bytes=0)
    [fs] = fits.disk
    assert [p.name for p in fs.parts] == ["offload files", "checkpoints (3 kept at once)"]
    assert fs.parts[1].nbytes == 3 * fits.checkpoint_bytes
    usage = namedtuple("usage", "total used free")
    free = fits.ssd_bytes + fits.checkpoint_bytes  # the offload files and one checkpoint, not three
    monkeypatch.setattr(disk_plan.shutil, "disk_usage", lambda path: usage(2**50, 0, free))
    plan = plan_run(cfg, model_cfg, runtime_bytes=0)
    [problem] = plan.problems()
    assert problem.startswith("disk: offload.dir, checkpoint.dir: offload files ")
    assert "checkpoints (3 kept at once)" in problem and "more than the" in problem
    assert "checkpoint.keep_last: 1 saves " in problem and "\n" not in problem
    with pytest.raises(PlanError, match=r"^disk: "):
        plan.check()
    # one save in the whole run: one checkpoint, and it fits
    once = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, every_steps=0))
    assert plan_run(once, model_cfg, runtime_bytes=0).problems() == []
    # saving by the clock may save at any step: keep_last plus the one being written again
    clock = dataclasses.replace(once, checkpoint=dataclasses.replace(once.checkpoint, every_minutes=30.0))
    assert disk_plan.checkpoints_kept(clock) == 3
    assert "checkpoints (3 kept at once)" in plan_run(clock, model_cfg, runtime_bytes=0).problems()[0]


def test_state_dtype_levers_say_what_they_save_on_that_filesystem(tmp_path, monkeypatch):
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, "1TiB")
    cfg = _cfg(tmp_path, "export.save_params=false")
    model_cfg = _model(cfg)
    need = plan_run(cfg, model_cfg, runtime_bytes=0).disk[0].need
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk_plan.shutil, "disk_usage", lambda path: usage(2**50, 0, need // 2))
    plan = plan_run(cfg, model_cfg, runtime_bytes=0)
    [(folder, levers)] = plan.disk_levers
    by = {lever.setting: lever for lever in levers}
    for dtype in ("int8", "bfloat16"):
        other = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, state_dtype=dtype))
        other_need = plan_run(other, model_cfg, runtime_bytes=0, levers=False).disk[0].need
        assert by[f"optimizer.state_dtype: {dtype}"].saves == need - other_need > 0
    assert by["optimizer.state_dtype: int8"].saves > by["optimizer.state_dtype: bfloat16"].saves
    problem = plan.problems()[0]
    assert "optimizer.state_dtype: int8 saves" in problem and "or put offload.dir (needs " in problem


def test_folders_on_other_filesystems_are_checked_apart(tmp_path, roomy):
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    cfg = _cfg(tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}", "offload.dir=/dev/shm/jaxascend-test-no-such/offload")
    plan = plan_run(cfg, _model(cfg), runtime_bytes=0)
    assert sorted(tuple(p.field for p in fs.parts) for fs in plan.disk) == [
        ("checkpoint.dir", "train.out_dir"), ("offload.dir",)]


def test_an_arena_too_small_for_the_chunks_is_refused_by_the_plan(tmp_path, roomy):
    cfg = _cfg(tmp_path, "offload.arena_bytes=64KiB")
    plan = plan_run(cfg, _model(cfg), runtime_bytes=0)
    [problem] = plan.problems()
    assert problem.startswith("offload.arena_bytes: the arena plan needs ")
    assert "but offload.arena_bytes is 65536 bytes" in problem and "largest slot" in problem
    big = _cfg(tmp_path, "offload.arena_bytes=64MiB")
    plan = plan_run(big, _model(big), runtime_bytes=0)
    assert plan.problems() == [] and plan.host["arena"] == 64 * 2**20


def test_the_trainer_refuses_it_in_one_line_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml"]
    for o in SMALL + ["data.paths=[@stdlib]", "data.max_documents=20", f"train.out_dir={out}",
                      "offload.arena_bytes=64KiB"]:
        args += ["--set", o]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert_one_error_line(proc, "offload.arena_bytes: the arena plan needs", "raise offload.arena_bytes")
    assert "Traceback" not in proc.stderr and not out.exists()
    env = {**os.environ, machine_limits.MEM_AVAILABLE_ENV: "64MiB"}
    proc = subprocess.run(args[:-2], capture_output=True, text=True, timeout=300, env=env)
    assert_one_error_line(proc, "host memory: the plan needs", "JAXASCEND_MEM_AVAILABLE_BYTES")
    assert not out.exists()


@pytest.mark.parametrize("remat", sorted(REMAT))
def test_activations_grow_with_seq_len_and_attention_scores_with_its_square(tmp_path, roomy, remat):
    def plan(seq):
        cfg = _cfg(tmp_path, f"data.seq_len={seq}", "data.batch_size=4", "model.max_position_embeddings=4096",
                   f"model.remat={remat}", "offload.params=resident", "model.attention=dense")
        return plan_run(cfg, _model(cfg), runtime_bytes=0), cfg

    def step(p):
        return p.host["activations"] + p.host["temporaries"]

    (short, _), (long, cfg) = plan(128), plan(2048)
    assert step(long) > 16 * step(short)  # more than linear in T: the scores grow with T squared
    assert long.phase == "attention"
    terms = REMAT[remat]
    scores = cfg.data.batch_size * cfg.model.num_attention_heads * 2048 ** 2
    # float32 scores, softmax and their gradients, kept or recomputed (and the executed step's extra copy)
    assert terms.saved.scores + terms.attention.scores >= 17
    assert long.host["temporaries"] >= terms.attention.scores * scores
    assert long.host["activations"] >= cfg.model.num_hidden_layers * terms.saved.scores * scores


@pytest.mark.parametrize("remat", ["full", "none"])
def test_with_blockwise_attention_the_step_grows_linearly_in_seq_len(tmp_path, roomy, remat):
    def step(seq, attention):
        cfg = _cfg(tmp_path, f"data.seq_len={seq}", "data.batch_size=1", "model.max_position_embeddings=16384",
                   f"model.remat={remat}", "offload.params=resident", f"model.attention={attention}")
        p = plan_run(cfg, _model(cfg), runtime_bytes=0)
        return p.host["activations"] + p.host["temporaries"]

    blockwise = {seq: step(seq, "blockwise") for seq in (2048, 4096, 8192, 16384)}
    for seq in (4096, 8192, 16384):  # doubling T at most doubles the step (the block's scores are fixed)
        assert blockwise[seq] <= 2.05 * blockwise[seq // 2]
    assert step(4096, "dense") > 2 * blockwise[4096]
    assert step(8192, "auto") == blockwise[8192] and step(512, "auto") == step(512, "dense")


@pytest.mark.parametrize("tied", [True, False])
def test_with_the_blocked_loss_the_head_holds_no_logits(tmp_path, roomy, tied):
    def plan(seq, loss):
        cfg = _cfg(tmp_path, f"data.seq_len={seq}", "data.batch_size=1", "model.max_position_embeddings=32768",
                   "model.remat=full", "offload.params=resident", "model.attention=blockwise", f"model.loss={loss}",
                   f"model.tie_word_embeddings={str(tied).lower()}")
        return plan_run(cfg, _model(cfg, vocab=151936), runtime_bytes=0)

    dense, blocked = plan(8192, "dense"), plan(8192, "blocked")
    assert dense.phase == "head"  # 8192 x 151936 float32 logits: 4.6 GiB
    assert dense.host["temporaries"] > 4 * 8192 * 151936 > 3 * blocked.host["temporaries"]
    short, long = (plan(seq, "blocked").host["temporaries"] for seq in (4096, 16384))
    assert short < long <= 4.1 * short  # linear in T, nothing of T x V
    assert plan(8192, "auto").host == blocked.host and plan(128, "auto").host == plan(128, "dense").host


def test_micro_batches_keep_every_row_s_boundary_but_one_micro_batch_s_layer(tmp_path, roomy):
    """Vertical micro-batches: no accumulator; what the backward keeps grows with A x B rows, a
    layer's working set with one micro-batch (plus its weights widened and their float32 sum)."""
    def plan(*overrides):
        cfg = _cfg(tmp_path, "offload.params=resident", "model.remat=full", *overrides)
        return plan_run(cfg, _model(cfg), runtime_bytes=0)

    one, four, wide = plan("data.batch_size=1"), plan("data.batch_size=1", "train.grad_accum=4"), plan("data.batch_size=4")
    assert "gradient accumulator" not in four.host
    assert four.host["activations"] == wide.host["activations"] == 4 * one.host["activations"]
    assert one.host["temporaries"] <= four.host["temporaries"] < wide.host["temporaries"]


def test_the_cgroup_headroom_is_read_from_v2_and_v1_hierarchies(tmp_path):
    v2 = tmp_path / "unified" / "job"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("8589934592\n")
    (v2 / "memory.current").write_text("2147483648\n")
    (v2 / "memory.stat").write_text("anon 1\ninactive_file 1073741824\n")
    (tmp_path / "unified" / "memory.max").write_text("max\n")
    v1 = tmp_path / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("4294967296\n")
    (v1 / "memory.usage_in_bytes").write_text("1073741824\n")
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("4:memory:/job\n0::/job\n")
    (proc / "mountinfo").write_text(
        f"35 31 0:32 / {tmp_path / 'memory'} rw,relatime - cgroup cgroup rw,memory\n"
        f"41 31 0:38 / {tmp_path / 'unified'} rw,relatime - cgroup2 cgroup2 rw\n")
    headroom = {h.source.split(" (")[0]: h.available for h in machine_limits.cgroup_headroom(str(proc))}
    assert headroom == {"cgroup memory.max": 7 * GiB, "cgroup memory.limit_in_bytes": 3 * GiB}


def test_the_memory_override_is_checked(monkeypatch):
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, "23GiB")
    assert machine_limits.available_host_memory().available == 23 * GiB
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, "lots")
    with pytest.raises(ValueError, match="JAXASCEND_MEM_AVAILABLE_BYTES"):
        machine_limits.available_host_memory()


def _plan_cli(tmp_path, config, *overrides, available="1TiB", device_memory=None):
    args = [sys.executable, "-m", "jaxascend.plan", "--config", config, "--disk-gbps", "2"]
    for o in (f"train.out_dir={tmp_path / 'run'}", f"offload.dir={tmp_path / 'run' / 'offload'}", *overrides):
        args += ["--set", o]
    env = {**os.environ, machine_limits.MEM_AVAILABLE_ENV: available}
    env.pop(DEVICE_MEM_ENV, None)
    if device_memory is not None:  # each device's capacity (JAX's CPU backend reports none)
        env[DEVICE_MEM_ENV] = device_memory
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def test_plan_from_config_json_alone(tmp_path):
    folder = tmp_path / "Qwen2.5-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(preset_config("qwen2", "tiny")))
    proc = _plan_cli(tmp_path, "configs/qwen2.5-7b.yaml", f"model.path={folder}", "train.grad_accum=1",
                     "data.seq_len=256")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (f"note: no tokenizer in {folder}: vocabulary from config.json (512); no data read: runtime part "
            "estimated") in proc.stdout
    assert "does not fit" not in proc.stdout and not (tmp_path / "run").exists()


def test_plan_of_qwen_7b_from_config_json_names_what_does_not_fit(tmp_path):
    folder = tmp_path / "Qwen2.5-7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(preset_config("qwen2", "7B")))
    proc = _plan_cli(tmp_path, "configs/qwen2.5-7b.yaml", f"model.path={folder}", available="12GiB")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "plan: 7,615,616,512 parameters, params ssd" in proc.stdout  # as shipped: streamed, 16 micro-batches
    [host] = [line for line in proc.stdout.splitlines() if line.startswith("does not fit: host memory")]
    assert "(largest part: activations" in host  # the 16 micro-batches' layer boundaries
    assert "train.grad_accum: 8 saves " in host


@pytest.mark.parametrize("params", ["resident", "ssd"])
def test_a_job_is_planned_one_process_at_a_time(tmp_path, roomy, params):
    # Qwen2.5-0.5B's shape, its 151936-row table in blocks: each of 2 processes holds half the
    # optimizer state (each layer and each block split on its own) and computes half the rows.
    cfg = _cfg(tmp_path, "model.remat=full", "data.batch_size=4", "data.seq_len=128", "offload.chunk_bytes=8MiB")
    model_cfg = model_config_from_hf_dict(preset_config("qwen2", "0.5B"), base=cfg.model)
    one = plan_run(cfg, model_cfg, params, runtime_bytes=0, levers=False)
    two = plan_run(cfg, model_cfg, params, runtime_bytes=0, levers=False, processes=2)
    assert two.num_params == one.num_params  # the model's
    # (one process's overlapped forward takes the streamed layers from its update, not from SSD;
    # the plan counts a job's forward reading its slices)
    forward = job_state_layout(cfg, model_cfg, True).streamed_param_bytes if params == "ssd" else 0
    for figure in ("ssd_bytes", "ssd_read_step", "ssd_write_step"):
        whole = getattr(one, figure) + (forward if figure == "ssd_read_step" else 0)
        assert getattr(two, figure) / whole == pytest.approx(0.5, abs=0.005), figure
    assert two.host["activations"] * 2 == pytest.approx(one.host["activations"], rel=0.01)
    assert two.checkpoint_bytes == one.checkpoint_bytes  # one directory: every process's slices
    # Every process holds the compute weights whole, but an overlapped resident stack: its slice.
    stack = 2 * sum(x.size for x in jax.tree.leaves(abstract_params(model_cfg)[1]["layers"]))  # bfloat16
    saved = one.host["resident params"] - two.host["resident params"]
    assert saved == (pytest.approx(stack / 2, rel=1e-4) if params == "resident" else 0)
    assert any(n.startswith("a job of 2 processes: host memory, the offload files and the SSD traffic are one "
                            "process's (2 of each batch's 4 rows") for n in two.notes)


def test_device_memory_over_its_capacity_names_remat_the_weights_on_ssd_and_micro_batches(tmp_path, roomy,
                                                                                            monkeypatch):
    cfg = _cfg(tmp_path, "model.remat=dots", "offload.params=resident", "data.batch_size=4")
    model_cfg = _model(cfg)
    monkeypatch.delenv(DEVICE_MEM_ENV, raising=False)
    plan = plan_run(cfg, model_cfg, runtime_bytes=0)
    assert plan.device_limit is None and plan.problems() == []  # the CPU backend: device memory is host RAM
    monkeypatch.setenv(DEVICE_MEM_ENV, str(plan.device_peak // 4))
    plan = plan_run(cfg, model_cfg, runtime_bytes=0)
    assert (plan.device_limit.nbytes, plan.device_limit.source) == (plan.device_peak // 4, DEVICE_MEM_ENV)
    [problem] = plan.problems()
    assert problem.startswith(f"device memory: the plan needs {format_bytes(plan.device_peak)} per device, ")
    assert "it has (JAXASCEND_DEVICE_MEM_BYTES) (largest part: activations + temps, " in problem
    # Each lever's figure is the plan made again with it (the step's estimator for each remat policy).
    full = plan_run(cfg, dataclasses.replace(model_cfg, remat="full"), runtime_bytes=0, levers=False)
    halves = plan_run(_cfg(tmp_path, "model.remat=dots", "offload.params=resident", "data.batch_size=2",
                           "train.grad_accum=2"), model_cfg, runtime_bytes=0, levers=False)
    levers = {lever.setting: lever for lever in plan.device_levers}
    assert levers["model.remat: full"].needs == full.device_peak < plan.device_peak
    assert levers["data.batch_size: 2 with train.grad_accum: 2"].needs == halves.device_peak < plan.device_peak
    assert levers["offload.params: ssd"].saves > 0 and "model.remat: none" not in levers  # none keeps more
    assert f"model.remat: full saves {format_bytes(plan.device_peak - full.device_peak)} (needs " in problem
    assert "\n" not in problem


def test_auto_streams_the_weights_when_resident_would_overfill_the_device(tmp_path, roomy, monkeypatch):
    cfg = _cfg(tmp_path, "model.remat=dots", "offload.params=auto", "data.batch_size=4")
    model_cfg = _model(cfg)
    monkeypatch.delenv(DEVICE_MEM_ENV, raising=False)
    resident = plan_run(cfg, model_cfg, params="resident", runtime_bytes=0, levers=False)
    ssd = plan_run(cfg, model_cfg, params="ssd", runtime_bytes=0, levers=False)
    assert ssd.device_peak < resident.device_peak
    monkeypatch.setenv(DEVICE_MEM_ENV, str((ssd.device_peak + resident.device_peak) // 2))
    plan = plan_run(cfg, model_cfg, runtime_bytes=0)
    assert plan.params == "ssd" and plan.problems() == []
    choice, gradients = plan.choices
    assert gradients.startswith("offload.gradients: auto chose host (the gradients wait in RAM: ")
    assert choice.startswith(f"offload.params: auto chose ssd (resident would need "
                             f"{format_bytes(resident.device_peak)}, over the device's ")
    assert choice.endswith("(JAXASCEND_DEVICE_MEM_BYTES))")
    monkeypatch.setenv(DEVICE_MEM_ENV, str(resident.device_peak))  # resident fits: it stays
    assert plan_run(cfg, model_cfg, runtime_bytes=0).params == "resident"


def test_the_plan_cli_refuses_a_device_too_small_and_carries_its_capacity(tmp_path):
    overrides = SMALL + ["model.remat=dots", "offload.params=resident", "data.batch_size=4", "data.paths=[@stdlib]",
                         "data.max_documents=20"]
    proc = _plan_cli(tmp_path, "configs/tiny.yaml", *overrides, device_memory="1MiB")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [device] = [line for line in proc.stdout.splitlines() if line.startswith("does not fit: device memory: ")]
    assert "more than the 1.00 MiB it has (JAXASCEND_DEVICE_MEM_BYTES)" in device
    for lever in ("model.remat: full saves ", "offload.params: ssd saves ",
                  "data.batch_size: 2 with train.grad_accum: 2 saves "):
        assert lever in device, lever
    assert "device memory: (per device; 1.00 MiB, JAXASCEND_DEVICE_MEM_BYTES)" in proc.stdout

def test_a_device_that_fits_and_its_capacity_in_the_plans_json(tmp_path, monkeypatch, capsys):
    from jaxascend.plan import main

    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, "1TiB")
    monkeypatch.setenv(DEVICE_MEM_ENV, "64GiB")
    args = ["--config", "configs/tiny.yaml", "--disk-gbps", "2", "--json"]
    for o in SMALL + ["data.paths=[@stdlib]", "data.max_documents=20", f"train.out_dir={tmp_path / 'run'}"]:
        args += ["--set", o]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["device_limit"] == {"nbytes": 64 * GiB, "source": DEVICE_MEM_ENV} and plan["problems"] == []
    assert 0 < plan["device_peak"] == sum(plan["device"].values())


def test_an_in_memory_run_over_the_device_names_the_offloaded_engine(tmp_path, roomy, monkeypatch):
    cfg = _cfg(tmp_path, "offload.enabled=false", "model.remat=full")
    monkeypatch.setenv(DEVICE_MEM_ENV, "64KiB")
    plan = plan_run(cfg, _model(cfg), runtime_bytes=0)
    offloaded = plan_run(_cfg(tmp_path, "model.remat=full"), _model(cfg), "resident", runtime_bytes=0, levers=False)
    assert set(plan.device) == {"params + state", "activations + temps"}  # the state and gradients on the device
    levers = {lever.setting: lever for lever in plan.device_levers}
    assert levers["offload.enabled: true"].needs == offloaded.device_peak < plan.device_peak
    assert plan.problems()[0].startswith("device memory: the plan needs ")


WIDE = ("model.remat=full", "offload.params=ssd", "model.dtype=bfloat16", "model.num_hidden_layers=8",
        "model.hidden_size=256", "model.intermediate_size=1024")


def test_auto_keeps_the_gradients_in_ram_where_they_fit_and_says_so(tmp_path, roomy, monkeypatch):
    """offload.gradients: host takes the gradient regions off the disk and out of the step's SSD
    traffic (2 + 2 B/param here, bfloat16) into host memory; auto picks it where the plan fits, else
    the most layers of the stack that fit (8 layers wide enough that some do), else ssd."""
    cfg = _cfg(tmp_path, *WIDE)
    model_cfg = _model(cfg)
    ssd = plan_run(_cfg(tmp_path, *WIDE,
                        "offload.gradients=ssd"), model_cfg, runtime_bytes=0)
    host = plan_run(_cfg(tmp_path, *WIDE,
                         "offload.gradients=host"), model_cfg, runtime_bytes=0)
    grads = 2 * host.num_params
    assert (ssd.gradients, host.gradients) == ("ssd", "host") and "gradients" not in ssd.host
    assert host.host["gradients"] == grads and host.host_peak == ssd.host_peak + grads
    assert (ssd.ssd_read_step - host.ssd_read_step, ssd.ssd_write_step - host.ssd_write_step) == (grads, grads)
    assert ssd.ssd_bytes - host.ssd_bytes == grads
    auto = plan_run(cfg, model_cfg, runtime_bytes=0)
    assert auto.gradients == "host" and auto.host == host.host
    assert auto.choices == (f"offload.gradients: auto chose host (the gradients wait in RAM: {format_bytes(grads)} of "
                            f"host memory for {format_bytes(2 * grads)} less SSD traffic a step)",)
    # all of them, with 10% of the memory left free (a run's peak comes out a little over its plan)
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, str(-(-host.host_peak * 10 // 9)))
    assert plan_run(cfg, model_cfg, runtime_bytes=0).host_gradient_layers is None
    # just enough for all, but not 10% free: as many of the stack's layers as fit so
    layers = model_cfg.num_hidden_layers
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, str(host.host_peak))
    auto = plan_run(cfg, model_cfg, runtime_bytes=0)
    kept = auto.host_gradient_layers
    assert auto.gradients == "host" and 1 <= kept < layers and auto.problems() == []
    assert auto.host_peak <= 0.9 * host.host_peak < auto.host_peak + auto.host["gradients"] / kept
    in_ram = auto.host["gradients"]  # the first `kept` layers' (the embeddings' and norms' are on SSD)
    assert in_ram < grads * kept / layers and auto.host_peak == ssd.host_peak + in_ram
    assert (ssd.ssd_read_step - auto.ssd_read_step, ssd.ssd_write_step - auto.ssd_write_step) == (in_ram, in_ram)
    [choice] = auto.choices
    assert choice.startswith(f"offload.gradients: auto keeps the first {kept} of the {layers} layers' gradients in "
                             f"RAM, the rest on SSD (all of them: {format_bytes(grads)} in all, "
                             f"{format_bytes(host.host_peak)} at the peak, over 90% of the ")
    same = plan_run(_cfg(tmp_path, *WIDE,
                         "offload.gradients=host", f"offload.host_gradient_layers={kept}"), model_cfg, runtime_bytes=0)
    assert same.host == auto.host and same.ssd_read_step == auto.ssd_read_step
    # not one layer's: ssd
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, str(ssd.host_peak + in_ram // kept // 2))
    auto = plan_run(cfg, model_cfg, runtime_bytes=0)
    assert auto.gradients == "ssd" and auto.host_gradient_layers is None and auto.host == ssd.host
    [choice] = auto.choices
    assert choice.startswith(f"offload.gradients: auto chose ssd (in RAM they would need {format_bytes(grads)} in all, "
                             f"{format_bytes(host.host_peak)} at the peak, over 90% of the ")
    # resolved into the run's config, for the step plan
    from jaxascend.planning import plan_resources

    resolved, _ = plan_resources(cfg, model_cfg)
    assert resolved.offload.gradients in ("ssd", "host") and cfg.offload.gradients == "auto"


def test_the_gradients_are_a_lever_for_host_memory_and_for_disk(tmp_path, roomy, monkeypatch):
    overrides = ("model.remat=full", "offload.params=resident", "model.dtype=bfloat16")
    model_cfg = _model(_cfg(tmp_path, *overrides))
    host = plan_run(_cfg(tmp_path, *overrides, "offload.gradients=host"), model_cfg, runtime_bytes=0)
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, str(host.host_peak - 1))
    short = plan_run(_cfg(tmp_path, *overrides, "offload.gradients=host"), model_cfg, runtime_bytes=0)
    levers = {lever.setting: lever.saves for lever in short.host_levers}
    assert levers["offload.gradients: ssd"] == 2 * host.num_params
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, "1TiB")
    usage = namedtuple("usage", "total used free")
    # no outputs at the end: they would reuse the gradients' space (host gradients would then save less)
    quiet = ("export.save_params=false", "export.enabled=false")
    ssd = plan_run(_cfg(tmp_path, *overrides, *quiet, "offload.gradients=ssd"), model_cfg, runtime_bytes=0)
    [fs] = ssd.disk
    monkeypatch.setattr(disk_plan.shutil, "disk_usage", lambda path: usage(2**40, 0, fs.need - 1))
    full = plan_run(_cfg(tmp_path, *overrides, *quiet, "offload.gradients=ssd"), model_cfg, runtime_bytes=0)
    [(_, disk)] = full.disk_levers
    assert {lever.setting: lever.saves for lever in disk}["offload.gradients: host"] == 2 * host.num_params


def test_no_final_checkpoint_and_outputs_in_the_gradients_space(tmp_path, monkeypatch):
    """checkpoint.final: false counts only the checkpoints every_steps makes; the end-of-run
    outputs land in the offloaded gradients' space (freed once the last step is done), so the
    high-water mark is the larger of the two, not their sum; offload.keep_files frees nothing."""
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, "1TiB")
    cfg = _cfg(tmp_path, "train.steps=10", "checkpoint.final=false", "offload.gradients=ssd", "export.enabled=true")
    model_cfg = _model(cfg)
    assert disk_plan.checkpoints_kept(cfg) == 0
    every = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, every_steps=4))
    assert disk_plan.checkpoints_kept(every) == 2  # steps 4 and 8, not 10
    plan = plan_run(cfg, model_cfg, runtime_bytes=0)
    [fs] = plan.disk
    assert [p.name for p in fs.parts] == ["offload files", "params.safetensors", "export"]
    outputs = fs.parts[1].nbytes + fs.parts[2].nbytes
    grads = fs.parts[0].frees_at_end
    assert grads > 0 and fs.shared_at_end == min(grads, outputs)
    assert fs.need == sum(p.nbytes for p in fs.parts) - fs.shared_at_end
    assert "reuse the offloaded gradients' space" in plan.format()
    kept = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, keep_files=True))
    [fs_kept] = plan_run(kept, model_cfg, runtime_bytes=0).disk
    assert fs_kept.shared_at_end == 0 and fs_kept.need == sum(p.nbytes for p in fs_kept.parts)


def test_the_overlapped_forward_reads_no_streamed_layer_and_the_plan_counts_none(tmp_path, roomy):
    # Streamed weights: the backward's recomputation reads them, and the forward too unless an
    # overlapped update hands each new layer over in memory (it waits for the forward rather than
    # skip one).
    plans = {}
    for overlap in (True, False):
        cfg = _cfg(tmp_path, "model.remat=full", f"offload.overlap={str(overlap).lower()}")
        plans[overlap] = plan_run(cfg, _model(cfg), "ssd", runtime_bytes=0, levers=False)
    streamed = job_state_layout(cfg, _model(cfg), True).streamed_param_bytes
    assert streamed > 0 and plans[False].ssd_read_step - plans[True].ssd_read_step == streamed
    assert plans[False].ssd_write_step == plans[True].ssd_write_step
    handed = [n for n in plans[True].notes if n.startswith("the overlapped forward takes each layer")]
    assert handed == [f"the overlapped forward takes each layer from its update in memory (handover; the update "
                      f"waits for the forward rather than let it read a layer back): none of the "
                      f"{format_bytes(streamed)} ({streamed / plans[True].num_params:.2f} B/param) of streamed "
                      f"weights is read for it (the first step's forward reads them)"]
    assert not [n for n in plans[False].notes if n.startswith("the overlapped forward")]
