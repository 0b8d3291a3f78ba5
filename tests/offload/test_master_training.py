"""Training with a bfloat16 master (``optimizer.master_dtype: bfloat16``), on the tiny shapes, in
combination: weights resident or on SSD (where the params region is the master), overlap,
micro-batches, int8 moments; a stop and resume bit-identical to a run never stopped; a resume
with another master refused in one line; the compensated master equal to a float32 one."""

import numpy as np
import pytest

from jaxascend.checkpoint import IncompatibleCheckpointError
from jaxascend.optim import master_codes
from tests.offload.test_streamed_params import corpus  # noqa: F401  (the fixture)
from tests.offload.test_streamed_params import train as streamed_train

SETTINGS = [  # beside test_streamed_params' TINY: bfloat16 compute, a checkpoint every 2 of 4 steps
    "train.steps=4", "model.dtype=bfloat16", "model.param_dtype=float32", "checkpoint.every_steps=2",
    "export.save_params=true",
]
BF16 = ["optimizer.master_dtype=bfloat16"]
STOCHASTIC = BF16 + ["optimizer.master_rounding=stochastic"]


def train(out, corpus, *extra):
    return streamed_train(out, corpus, *SETTINGS, *extra)


@pytest.mark.parametrize("master", [BF16, STOCHASTIC], ids=["compensated", "stochastic"])
def test_the_master_is_the_same_resident_streamed_and_overlapped(tmp_path, corpus, master):
    runs = {name: train(tmp_path / name, corpus, *master, *extra) for name, extra in {
        "resident": ["offload.params=resident", "offload.overlap=false"],
        "ssd": ["offload.params=ssd", "offload.overlap=false"],
        "ssd-overlap": ["offload.params=ssd", "offload.overlap=true"],
        "resident-overlap": ["offload.params=resident", "offload.overlap=true"],
    }.items()}
    (base, records, params) = runs["resident"]
    for name, (result, other_records, other_params) in runs.items():
        assert result.losses == base.losses, name  # floats compared exactly
        assert other_params == params, name  # the master's values, byte for byte
    ssd = runs["ssd"][1][-1]
    # The streamed leaves' master is their params region: the update reads it too.
    assert ssd["params"] == "ssd" and ssd["param_source_misses"] == 0


def test_a_compensated_master_is_the_float32_master(tmp_path, corpus):
    f32, _, _ = train(tmp_path / "f32", corpus, "offload.params=ssd")
    comp, _, _ = train(tmp_path / "comp", corpus, *BF16, "offload.params=ssd")
    # The same float32 master arithmetic and compute weights (to nearest, ties to even): the
    # same losses, bit for bit, unless a tie that rounded down (held one float32 ulp toward zero)
    # later rounds the compute weights apart, which this run's few thousand weights do not meet.
    assert comp.losses == f32.losses
    assert master_codes.MasterFormat("bfloat16", "compensated").companion_itemsize == 2


@pytest.mark.parametrize("extra", [[*STOCHASTIC, "optimizer.state_dtype=int8", "offload.params=ssd"],
                                   [*BF16, "train.grad_accum=2", "offload.params=ssd", "offload.overlap=true"]],
                         ids=["stochastic-int8-ssd", "compensated-accum-overlap"])
def test_a_stop_and_resume_is_bit_identical(tmp_path, corpus, extra):
    straight, _, straight_params = train(tmp_path / "straight", corpus, *extra)
    train(tmp_path / "halves", corpus, *extra, "train.stop_at_step=2")
    resumed, records, resumed_params = train(tmp_path / "halves", corpus, *extra)
    assert resumed.losses == straight.losses
    assert resumed_params == straight_params


def test_a_resume_with_another_master_is_refused_in_one_line(tmp_path, corpus):
    train(tmp_path / "run", corpus, *STOCHASTIC, "train.stop_at_step=2")
    with pytest.raises(IncompatibleCheckpointError) as err:
        train(tmp_path / "run", corpus)  # float32 master
    message = str(err.value)
    assert "\n" not in message
    assert "optimizer.master_dtype: checkpoint has 'bfloat16', this run has 'float32'" in message
    with pytest.raises(IncompatibleCheckpointError, match="optimizer.master_rounding: checkpoint has 'stochastic', "
                                                           "this run has 'compensated'"):
        train(tmp_path / "run", corpus, *BF16)


def test_a_job_of_two_processes_trains_a_bfloat16_master_like_one(tmp_path):
    # Each process updates its slice of every layer; the stochastic bits are drawn by the
    # element's index in the whole layer, so the job rounds as one process does.
    from tests.test_train_distributed import EVAL_TEXT, losses, trained
    (tmp_path / "eval.py").write_text(EVAL_TEXT)
    extra = ("model.dtype=bfloat16", *STOCHASTIC, "optimizer.state_dtype=int8", "offload.params=ssd",
             "model.remat=full")
    one = trained(tmp_path / "one", 1, *extra)
    two = trained(tmp_path / "two", 2, *extra)
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-4)
    from safetensors.numpy import load_file
    a, b = load_file(str(one / "params.safetensors")), load_file(str(two / "params.safetensors"))
    for name in a:  # the loss's sum over two halves differs in the last bits: a rounding may flip, by an ulp
        np.testing.assert_allclose(b[name].astype(np.float32), a[name].astype(np.float32), rtol=0, atol=2e-3,
                                   err_msg=name)


@pytest.mark.parametrize("dtype, rounding, noted", [("float32", "stochastic", True), ("float32", "compensated", False),
                                                     ("bfloat16", "stochastic", False)])
def test_a_wider_checkpoint_rounded_once_is_one_note(tmp_path, corpus, dtype, rounding, noted):
    # A compensated master holds a float32 checkpoint's values exactly; a stochastic one starts
    # from their bfloat16 rounding, which one note says; a bfloat16 checkpoint is the master as it is.
    from jaxascend.config import load_config
    from jaxascend.hf import make_hf_checkpoint
    from jaxascend.preparation import read_inputs
    folder = make_hf_checkpoint("llama", "tiny", tmp_path / "model", dtype=dtype)
    cfg = load_config("configs/tiny.yaml", [f"model.path={folder}", f"data.paths=[{corpus}]", "data.include=['*.txt']",
                                            f"train.out_dir={tmp_path / 'run'}", *BF16,
                                            f"optimizer.master_rounding={rounding}"])
    notes = [n for n in read_inputs(cfg).notes if n.startswith("optimizer.master_dtype")]
    assert notes == ([f"optimizer.master_dtype: bfloat16 (stochastic): the float32 weights of {folder} are rounded "
                      "once to bfloat16 (to nearest) where the master starts from them"] if noted else [])
