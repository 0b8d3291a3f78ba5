"""``offload.params: ssd``: the layer stack's compute weights on SSD, read layer by layer by the
parameter source. Streamed and resident runs are bit-identical (losses, fp32 master weights),
SIGKILL during a streamed step (of two vertical micro-batches) resumes bit-identically, and the
planner refuses what cannot fit."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxascend.config import ConfigError, load_config
from jaxascend.models import vocab
from jaxascend.offload import StepPlan
from jaxascend.planning import PlanError
from jaxascend.trainer import run
from tests._corpus import write_word_corpus
from tests.test_resume import _assert_bitwise_equal, _final_state

TINY = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=3",
    "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32", "data.batch_size=2",
    "train.progress=false", "train.steps=3", "train.log_every=1", "offload.enabled=true", "model.remat=full",
    "offload.block_bytes=4096", "offload.chunk_bytes=16KiB", "offload.staging_bytes=64KiB",
    "offload.pin_memory=false", "optimizer.warmup_steps=1",
]
DTYPES = {
    "bfloat16": ["model.dtype=bfloat16"],
    "float32": ["model.dtype=float32", "model.param_dtype=float32"],
    # loss scale 2**30: the first step's fp16 gradients overflow, it is skipped and the scale backs off
    "float16-overflow": ["model.dtype=float16", "optimizer.loss_scale_init=1073741824"],
}
GPT2 = ["model.arch=gpt2", "model.hidden_act=gelu_new", "model.num_key_value_heads=4"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words_per_doc=400)


def train(out, corpus, *extra):
    cfg = load_config("configs/tiny.yaml", TINY + [f"data.paths=[{corpus}]", "data.include=['*.txt']",
                                                   f"train.out_dir={out}", f"offload.dir={out}/offload", *extra])
    result = run(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    params = out / "params.safetensors"  # none at train.stop_at_step, a resume point
    return result, records, params.read_bytes() if params.exists() else None


def assert_same_run(tmp_path, corpus, *extra, exact=True):
    resident, _, resident_params = train(tmp_path / "resident", corpus, "offload.params=resident", *extra)
    streamed, records, streamed_params = train(tmp_path / "ssd", corpus, "offload.params=ssd", *extra)
    assert streamed.losses == resident.losses  # floats compared exactly
    if exact:
        assert streamed_params == resident_params  # the fp32 master weights, byte for byte
    else:
        from safetensors.numpy import load
        a, b = load(resident_params), load(streamed_params)
        for name in a:
            # atol: the key bias's gradient is zero but for rounding noise, which AdamW normalizes
            np.testing.assert_allclose(b[name], a[name], rtol=1e-6, atol=1e-5, err_msg=name)
    assert records[-1]["params"] == "ssd" and records[-1]["param_source_misses"] == 0
    # Every layer read twice per step (forward, and the backward's recomputation), in the order foreseen.
    assert records[-1]["param_source_fetches"] == 2 * 3 * len(records)
    return resident, streamed, records


@pytest.mark.parametrize("arch, dtype", [("llama", d) for d in DTYPES] + [("gpt2", "float32"), ("gpt2", "float16-overflow")])
def test_streamed_weights_match_resident_bit_for_bit(tmp_path, corpus, arch, dtype):
    # Known exception: GPT-2 in float32. XLA's CPU backend compiles its attention's fused
    # c_attn matmul (one [D, 3D] kernel, split into q, k, v) differently for a layer fetched by
    # the parameter source than for a slice of the resident stack, and the float32 sums come out
    # in another order (a few ulps in some gradients; the losses stay equal). In the 16-bit
    # dtypes, and for Llama in every dtype, the weights are bit-identical.
    exact = not (arch == "gpt2" and dtype == "float32")
    resident, streamed, records = assert_same_run(tmp_path, corpus, *DTYPES[dtype], *(GPT2 if arch == "gpt2" else []),
                                                  exact=exact)
    if dtype == "float16-overflow":
        assert streamed.skipped_steps >= 1 and streamed.skipped_steps == resident.skipped_steps
    # The streamed run reads the weights from SSD: its RAM holds only the embeddings, norms, head.
    assert records[-1]["streamed_param_bytes"] > 0
    assert records[-1]["resident_param_bytes"] < records[-1]["streamed_param_bytes"]


def test_large_table_in_blocks_matches_resident(tmp_path, corpus, monkeypatch):
    """A vocabulary table over the block threshold: its gradient leaves in blocks of rows (the
    tied head's and the lookup's summed by the sink), streamed and resident alike."""
    monkeypatch.setattr(vocab, "LARGE_TABLE_ELEMENTS", 1024)
    monkeypatch.setattr(vocab, "MAX_BLOCK_ROWS", 64)
    assert vocab.table_blocks(256, 32) == 4
    _, _, records = assert_same_run(tmp_path, corpus, "model.dtype=bfloat16", "optimizer.grad_clip_norm=0.5")
    assert all(np.isfinite(r["grad_norm"]) for r in records)


def test_what_streamed_weights_cannot_run_is_refused(tmp_path, corpus):
    base = TINY + [f"data.paths=[{corpus}]", "data.include=['*.txt']", f"train.out_dir={tmp_path}", "offload.params=ssd"]
    def step_plan(*overrides):  # the step's plan refuses what the weights streamed cannot run
        cfg = load_config("configs/tiny.yaml", base + list(overrides))
        return StepPlan.resolve(cfg, cfg.model)

    with pytest.raises(ConfigError, match="offload.params: 'ssd' needs model.remat"):
        step_plan("model.remat=none")
    assert step_plan("model.remat=full", "train.grad_accum=4").grad_accum == 4
    with pytest.raises(ConfigError, match="offload.params: 'ssd' needs offload.enabled"):
        step_plan("offload.enabled=false")
    with pytest.raises(ConfigError, match="offload.params: 'disk' is not one of"):
        load_config("configs/tiny.yaml", TINY + [f"data.paths=[{corpus}]", "data.include=['*.txt']", "offload.params=disk"])


def test_planner_refuses_an_impossible_budget_before_writing(tmp_path, corpus):
    out = tmp_path / "run"
    cfg = load_config("configs/tiny.yaml", TINY + [f"data.paths=[{corpus}]", "data.include=['*.txt']", f"train.out_dir={out}",
                                                   "offload.params=ssd", "offload.host_memory_budget=64MiB"])
    with pytest.raises(PlanError, match=r"^offload.host_memory_budget: the plan needs .* of host memory, .* more "
                                        r"than the budget of 64.00 MiB \(largest part: runtime"):
        run(cfg)
    assert not out.exists()  # nothing written


def test_auto_streams_when_resident_does_not_fit(tmp_path, corpus):
    from jaxascend.planning import plan_run
    from jaxascend.preparation import resolve_model_config

    cfg = load_config("configs/tiny.yaml", TINY + [f"data.paths=[{corpus}]", "data.include=['*.txt']", f"train.out_dir={tmp_path}",
                                                   "offload.gradients=ssd"])  # auto would trade them against the weights
    model_cfg = resolve_model_config(cfg)
    model_cfg = type(model_cfg)(**{**model_cfg.__dict__, "vocab_size": 256})
    resident = plan_run(cfg, model_cfg, "resident", runtime_bytes=0)
    streamed = plan_run(cfg, model_cfg, "ssd", runtime_bytes=0)
    assert streamed.host["resident params"] < resident.host["resident params"]
    # read once a step, by the backward's recomputation (the overlapped forward takes each from its update)
    assert streamed.ssd_read_step - resident.ssd_read_step == streamed.ssd_bytes - resident.ssd_bytes
    budget = (resident.host_peak + streamed.host_peak) // 2
    cfg.offload.host_memory_budget = budget
    assert plan_run(cfg, model_cfg, runtime_bytes=0).params == "ssd"  # auto
    cfg.offload.host_memory_budget = resident.host_peak
    assert plan_run(cfg, model_cfg, runtime_bytes=0).params == "resident"


def test_plan_cli_prints_every_part_and_exits_1_when_it_does_not_fit(tmp_path, corpus):
    args = [sys.executable, "-m", "jaxascend.plan", "--config", "configs/tiny.yaml", "--disk-gbps", "2"]
    for o in TINY + [f"data.paths=[{corpus}]", "data.include=['*.txt']", f"train.out_dir={tmp_path / 'run'}", "offload.params=ssd"]:
        args += ["--set", o]
    ok = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    for part in ("runtime", "arena", "resident params", "activations", "temporaries", "device memory",
                 "offload files", "SSD per step", "step-time floor", "at 2 GB/s", "estimate_zero3"):
        assert part in ok.stdout
    tight = subprocess.run(args + ["--set", "offload.host_memory_budget=1MiB"], capture_output=True, text=True,
                           timeout=300)
    assert tight.returncode == 1 and "does not fit: offload.host_memory_budget" in tight.stdout
    bad = subprocess.run(args + ["--set", "offload.params=cloud"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: offload.params: 'cloud'")
    assert not (tmp_path / "run").exists()


def _cli(out, corpus, kill_at=None):
    env = {k: v for k, v in os.environ.items() if k != "JAXASCEND_KILL_AT"}
    if kill_at:
        env["JAXASCEND_KILL_AT"] = kill_at
    args = [sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml"]
    # 2 vertical micro-batches of 1 row per step: each layer's weights read once per step for both
    sets = TINY + ["model.dtype=bfloat16", "offload.params=ssd", "train.steps=6", "checkpoint.every_steps=2",
                   "data.batch_size=1", "train.grad_accum=2",
                   "checkpoint.async_save=false", "export.save_params=false", f"data.paths=[{corpus}]",
                   "data.include=['*.txt']", f"train.out_dir={out}", f"offload.dir={out}/offload"]
    for o in sets:
        args += ["--set", o]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)


def test_sigkill_during_streamed_steps_then_resume_is_bit_identical(tmp_path, corpus):
    straight = _cli(tmp_path / "straight", corpus)
    assert straight.returncode == 0, straight.stderr
    out = tmp_path / "killed"
    # During a forward/backward that reads the weights, during the optimizer's writes of new
    # weights, during a checkpoint of them; each time the next run resumes from what is complete.
    for kill_at in ("backward:3", "optimizer_chunk:25", "checkpoint_chunk:4", "backward:2"):
        proc = _cli(out, corpus, kill_at)
        assert proc.returncode == -9, f"{kill_at}: expected SIGKILL, got {proc.returncode}: {proc.stderr[-2000:]}"
    final = _cli(out, corpus)
    assert final.returncode == 0, final.stderr
    state = _final_state(tmp_path / "straight")
    assert any(k.startswith("params") for k in state["offloaded"])  # the streamed weights are checkpointed
    _assert_bitwise_equal(state, _final_state(out))
    losses = json.loads((out / "summary.json").read_text())["losses"]
    assert losses == json.loads((tmp_path / "straight" / "summary.json").read_text())["losses"]
