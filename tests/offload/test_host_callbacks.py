"""The host-callback path, the one a GPU runs, on the CPU (``JAXASCEND_HOST_CALLBACKS=1``): the
gradient sink through ``io_callback``, the parameter source through ``pure_callback`` (streamed
weights, and resident ones served from host buffers under ``offload.overlap``), the overlapped
step, the held-out evaluation and the end-of-run samples. Each run is bit-identical to the run
down the FFI path: losses, held-out loss, samples and the final fp32 master weights (so the sink
received the same bytes, a tied table's two uses summed alike)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import pytest

from jaxascend import native, trainer
from jaxascend.config import load_config
from jaxascend.native import extension
from tests.test_sft import SMALL

# A tied table (the sft-tiny default), 2 layers, 2 steps (step 2's forward beside step 1's
# update), one held-out batch at the end.
LAYERS, STEPS, EVAL_BATCHES = 2, 2, 1
RUN = SMALL + [f"model.num_hidden_layers={LAYERS}", f"train.steps={STEPS}", "model.remat=full", "eval.every_steps=0",
               f"eval.batches={EVAL_BATCHES}", "export.save_params=true", "checkpoint.async_save=false"]
# One short sample at the end. It reads the compute weights the run left (host buffers, SSD
# regions) without a callback, so the runs that leave them by the overlapped update take it,
# and the reference; the compilation of the sampler is a quarter of a run.
SAMPLE = ["eval.sample_prompts=['What is the capital of Japan?']", "eval.sample_max_tokens=4"]
HOST_ENTRIES = ("consume_gradient", "fetch_params_to_host")  # what the host callbacks call


@dataclass
class Outcome:
    losses: list[float]
    eval_loss: float
    samples: list[dict]  # [] without SAMPLE
    params: bytes  # params.safetensors: the fp32 master weights
    records: list[dict]
    host_calls: dict[str, int]


def _train(out: Path, placement: str, overlap: bool, host: bool, *extra: str) -> Outcome:
    calls = dict.fromkeys(HOST_ENTRIES, 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native.HOST_CALLBACKS_ENV, "1" if host else "0")
        mp.setattr(trainer, "write_timeline_png", lambda data, path: True)  # matplotlib: seconds, not tested here
        for name in HOST_ENTRIES:
            mp.setattr(extension, name, _counting(getattr(extension, name), name, calls))
        result = trainer.run(load_config("configs/sft-tiny.yaml", RUN + [
            f"train.out_dir={out}", f"offload.params={placement}", f"offload.overlap={str(overlap).lower()}", *extra]))
    samples = out / "samples.json"
    return Outcome(result.losses, result.eval_loss, json.loads(samples.read_text()) if samples.exists() else [],
                   (out / "params.safetensors").read_bytes(),
                   [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], calls)


def _counting(fn, name: str, calls: dict[str, int]):
    def counted(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return counted


@pytest.fixture(scope="module")
def ffi_run(tmp_path_factory) -> Outcome:
    """The reference of every host-callback run: one run down the FFI path, resident and
    sequential. On that path streamed weights and the overlapped step are bit-identical to it
    (tests/offload/test_streamed_params.py, tests/offload/test_overlap.py)."""
    outcome = _train(tmp_path_factory.mktemp("ffi"), "resident", False, False, *SAMPLE)
    assert outcome.host_calls == dict.fromkeys(HOST_ENTRIES, 0)  # the default calls no host entry
    return outcome


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the reference is the FFI path, which only the CPU runs")
# The reference's mode with the host entries alone, then every mode at once (streamed and overlapped).
@pytest.mark.parametrize("placement, overlap", [("resident", False), ("ssd", True)], ids=["resident-sequential", "ssd-overlap"])
def test_host_callbacks_match_the_ffi_path(tmp_path, ffi_run, placement, overlap):
    want, got = ffi_run, _train(tmp_path, placement, overlap, True, *(SAMPLE if overlap else []))
    assert got.losses == want.losses  # floats compared exactly
    assert got.eval_loss == want.eval_loss
    if overlap:
        assert got.samples == want.samples and got.samples[0]["new_tokens"] > 0
    assert got.params == want.params  # byte for byte
    last = got.records[-1]
    assert last["overlap"] is overlap and last["early_gradient_arrivals"] == 0
    # The run went through the host entries: the gradients, and every layer the source served,
    # each once in a forward and again in the backward's recomputation (remat), in the order
    # foreseen; the evaluation's forward once more.
    assert got.host_calls["consume_gradient"] > 0
    if placement == "ssd" or overlap:
        assert last["param_source_fetches"] == STEPS * 2 * LAYERS and last["param_source_misses"] == 0
        assert got.host_calls["fetch_params_to_host"] == STEPS * 2 * LAYERS + EVAL_BATCHES * LAYERS
    else:
        assert got.host_calls["fetch_params_to_host"] == 0  # resident, sequential: no source
