"""The training attention's GPU branch (jaxascend.models.fused_attention), run on the CPU by
``JAXASCEND_ATTENTION_BACKEND=gpu``: the dispatcher takes the branch a GPU takes and calls
``jax.nn.dot_product_attention`` with ``implementation="xla"`` instead of cuDNN. Checked here:
the argument mapping (layout, GQA, scale, causal, the static and the traced window) against the
dense attention in fp32, outputs and gradients, alone and in whole models; which path each
backend, switch, ``model.attention`` and call picks; one note per fallback reason. cuDNN itself
needs a GPU: ``scripts/gpu_verify.sh`` runs ``scripts/check_cudnn_attention.py``."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from jaxascend.models import fused_attention as fused
from jaxascend.models import layers
from tests.models.test_blockwise_attention import CASES, MODEL_CASES, assert_attends_like_dense, \
    assert_trains_like_dense, model_loss_and_grads, outputs_and_grads, random_qkv
from tests.models.test_models import sample_ids

pytestmark = pytest.mark.skipif(
    jax.default_backend() == "gpu",
    reason="runs the GPU branch with XLA's kernel on a CPU; on a GPU scripts/check_cudnn_attention.py checks cuDNN")

COVERED = sorted(name for name, (traced, _) in CASES.items() if "segment_ids" not in traced)


@pytest.fixture
def calls(monkeypatch):
    """The ``implementation`` of every jax.nn.dot_product_attention call traced; no note yet."""
    monkeypatch.setattr(fused, "_noted", set())
    seen = []
    real = jax.nn.dot_product_attention

    def counting(*args, implementation=None, **kwargs):
        out = real(*args, implementation=implementation, **kwargs)
        seen.append(implementation)  # after: a call jax refuses while tracing does not count
        return out

    monkeypatch.setattr(jax.nn, "dot_product_attention", counting)
    return seen


@pytest.fixture
def gpu_branch(monkeypatch, calls):
    """The GPU branch on this backend (``JAXASCEND_ATTENTION_BACKEND=gpu``), calls counted."""
    monkeypatch.setenv(fused.BACKEND_ENV, "gpu")
    return calls


def assert_fused_attends_like_dense(traced, static, shape=(2, 64, 4, 2), implementation="blockwise"):
    """(out, dq, dk, dv) of ``layers.attention`` against the dense attention, within float32
    sums in another order."""
    q, k, v, weights = random_qkv(*shape)
    dense = outputs_and_grads(lambda *a, **kw: layers.causal_attention(*a, **static, **kw), q, k, v, weights,
                              **traced)
    taken = outputs_and_grads(lambda *a, **kw: layers.attention(*a, implementation=implementation, **static, **kw),
                              q, k, v, weights, **traced)
    assert_attends_like_dense(dense, taken, shape)


@pytest.mark.parametrize("case", COVERED)
def test_the_gpu_branch_matches_dense_on_every_covered_mask(gpu_branch, case):
    traced, static = CASES[case]
    assert_fused_attends_like_dense(traced, static)
    assert gpu_branch and set(gpu_branch) == {"xla"}, gpu_branch  # the fused call was taken


@pytest.mark.parametrize("length, heads, kv_heads", [(50, 4, 4), (7, 3, 1), (17, 6, 2)])
def test_the_gpu_branch_maps_head_groups_and_lengths(gpu_branch, length, heads, kv_heads):
    assert_fused_attends_like_dense({"is_sliding": jnp.asarray(True)}, {"sliding_window": 9, "scale": 0.2},
                                    shape=(2, length, heads, kv_heads), implementation="auto")
    assert gpu_branch


def chosen_path(calls: list, implementation: str, dtype=jnp.float32, segment_ids=None, length: int = 16) -> str:
    """Which attention ``layers.attention`` traces for this call: fused (a call of
    jax.nn.dot_product_attention went through), blockwise (its custom_vjp) or dense."""
    q, k, v, _ = random_qkv(1, length, 4, 2)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    before = len(calls)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: layers.attention(
        q, k, v, implementation=implementation, segment_ids=segment_ids))(q, k, v))
    if len(calls) > before:
        return "fused"
    return "blockwise" if "custom_vjp_call" in jaxpr else "dense"


def test_which_path_each_backend_switch_and_setting_takes(monkeypatch, caplog, calls):
    segments = jnp.zeros((1, 16), jnp.int32)
    caplog.set_level(logging.WARNING, logger="jaxascend")
    for switch in ("auto", "jax"):  # a CPU: the pure-JAX paths, no note (nothing was given up)
        monkeypatch.setenv(fused.BACKEND_ENV, switch)
        assert [chosen_path(calls, i) for i in ("auto", "blockwise", "dense")] == ["dense", "blockwise", "dense"]
    assert chosen_path(calls, "auto", length=1024) == "blockwise" and not caplog.records
    monkeypatch.setenv(fused.BACKEND_ENV, "gpu")
    assert [chosen_path(calls, i) for i in ("auto", "blockwise", "dense")] == ["fused", "fused", "dense"]
    assert chosen_path(calls, "auto", length=1024) == "fused" and not caplog.records
    # packed rows: not covered; the pure-JAX path of the setting, one note however often traced
    assert [chosen_path(calls, i, segment_ids=segments) for i in ("auto", "blockwise", "auto")] == \
        ["dense", "blockwise", "dense"]
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith(
        "attention: xla attention has no mask for packed rows (segment_ids) short of a [T, S] one; "
        "using the pure-JAX attention of model.attention")
    # float16: jax's XLA kernel does not compile it on a CPU; bfloat16 goes through
    assert [chosen_path(calls, "blockwise", d) for d in (jnp.float16, jnp.bfloat16)] == ["blockwise", "fused"]
    assert caplog.records[1].getMessage().startswith("attention: xla attention takes float32 or bfloat16, "
                                                     "not float16;") and len(caplog.records) == 2


def test_on_a_gpu_cudnn_is_chosen_guarded_and_left_where_it_cannot_run(monkeypatch, caplog, calls):
    """A GPU backend (simulated): cuDNN for auto and blockwise; float32 is not covered (a note); a
    call that jax refuses while tracing (here: no cuDNN on this machine) falls back with a note."""
    monkeypatch.setattr(fused, "on_gpu", lambda: True)
    caplog.set_level(logging.WARNING, logger="jaxascend")
    for switch in ("auto", "gpu"):
        monkeypatch.setenv(fused.BACKEND_ENV, switch)
        assert fused.fused_kernel() == fused.CUDNN
    monkeypatch.setenv(fused.BACKEND_ENV, "jax")
    assert fused.fused_kernel() is None and chosen_path(calls, "blockwise") == "blockwise"
    monkeypatch.delenv(fused.BACKEND_ENV)
    assert chosen_path(calls, "blockwise", jnp.float32) == "blockwise"
    assert chosen_path(calls, "blockwise", jnp.bfloat16) == "blockwise"  # cuDNN is not detected on a CPU
    assert chosen_path(calls, "auto", jnp.bfloat16) == "dense"
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 2, notes
    assert notes[0].startswith("attention: cudnn attention takes float16 or bfloat16, not float32;")
    assert notes[1].startswith("attention: jax.nn.dot_product_attention(implementation='cudnn') refused the call: "
                               "cuDNN is not detected")


def test_a_bad_switch_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(fused.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=r"^JAXASCEND_ATTENTION_BACKEND='cuda': expected one of auto, gpu, jax$"):
        fused.fused_kernel()


@pytest.mark.parametrize("arch", sorted(MODEL_CASES))
def test_models_train_alike_through_the_gpu_branch_and_dense(gpu_branch, arch):
    """Gemma 3's traced window goes through a lax.cond inside the layer scan; Mistral's is static."""
    cfg, ids = MODEL_CASES[arch](), sample_ids(2, 17)
    dense = model_loss_and_grads(cfg, "dense", ids)
    assert not gpu_branch
    fused_path = model_loss_and_grads(cfg, "auto", ids)
    assert gpu_branch
    assert_trains_like_dense(cfg, 17, dense, fused_path)


def test_low_precision_through_the_gpu_branch_keeps_its_dtype(gpu_branch):
    q, k, v, _ = random_qkv(1, 40, 4, 2)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = layers.attention(*low, implementation="auto", sliding_window=12)
    assert out.dtype == jnp.bfloat16 and gpu_branch == ["xla"]
    ref = layers.causal_attention(*(x.astype(jnp.float32) for x in low), sliding_window=12)
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) < 0.05


def test_the_fused_note_is_one_line_under_the_cli(gpu_branch, capsys):
    from jaxascend import console
    with console.one_line_output():
        for _ in range(3):
            chosen_path(gpu_branch, "auto", segment_ids=jnp.zeros((1, 16), jnp.int32))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("note: attention: xla attention has no mask for packed rows")
