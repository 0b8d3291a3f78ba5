"""The gradients in RAM (``offload.gradients: host``): the store's gradient regions kept in host
memory, so a step's gradient makes no round trip to the SSD. The same sink, receipts and passes
as on SSD, so the same bits: on the tiny shapes, in combination (weights resident or on SSD,
overlap, micro-batches, a bfloat16 master with int8 moments, a job of two processes), with the
step's SSD traffic smaller by exactly the gradients' bytes written and read."""

import numpy as np
import pytest

from tests.offload.test_streamed_params import corpus  # noqa: F401  (the fixture)
from tests.offload.test_streamed_params import train

COMBINATIONS = {
    "resident": ["offload.params=resident", "offload.overlap=false"],
    "ssd-overlap-accum": ["offload.params=ssd", "offload.overlap=true", "train.grad_accum=2"],
    "resident-overlap-compact": ["offload.params=resident", "offload.overlap=true", "model.dtype=bfloat16",
                                 "optimizer.master_dtype=bfloat16", "optimizer.state_dtype=int8"],
}


@pytest.mark.parametrize("extra", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_gradients_in_ram_train_bit_identically_and_skip_the_ssd(tmp_path, corpus, extra):
    extra = [*extra, "offload.keep_files=true"]
    ssd, ssd_records, ssd_params = train(tmp_path / "ssd", corpus, *extra, "offload.gradients=ssd")
    host, host_records, host_params = train(tmp_path / "host", corpus, *extra, "offload.gradients=host")
    assert host.losses == ssd.losses  # floats compared exactly
    assert host_params == ssd_params  # byte for byte
    assert (ssd_records[-1]["gradients"], host_records[-1]["gradients"]) == ("ssd", "host")
    # The run's traffic: each step's backward wrote each gradient region once (a layer sums its
    # micro-batches before it sends) and its update read it once; regions are whole 4 KiB pages
    # on disk, so a little over the gradients' own bytes.
    grads, steps = host_records[-1]["grad_bytes"], len(host.losses)
    written = ssd.ssd_bytes_written_run - host.ssd_bytes_written_run
    assert written % steps == 0 and grads <= written // steps < grads + 4096 * 64
    # the last update's reads (of the state, and of the gradients from SSD, in its chunks' pages)
    read = ssd_records[-1]["ssd_read_bytes_step"] - host_records[-1]["ssd_read_bytes_step"]
    assert grads <= read < grads + 4096 * 64
    disk = {name: sum(f.stat().st_size for f in (tmp_path / name / "offload").glob("shard-*.bin"))
            for name in ("ssd", "host")}
    assert disk["ssd"] - disk["host"] >= grads  # nothing of them on disk

def test_a_job_of_two_processes_keeps_its_gradient_slices_in_ram(tmp_path):
    from tests.test_train_distributed import EVAL_TEXT, losses, trained
    (tmp_path / "eval.py").write_text(EVAL_TEXT)
    extra = ("model.remat=full", "offload.params=ssd", "train.grad_accum=2")
    ssd = trained(tmp_path / "ssd", 2, *extra, "offload.gradients=ssd")
    host = trained(tmp_path / "host", 2, *extra, "offload.gradients=host")
    assert losses(host) == losses(ssd)
    assert (host / "params.safetensors").read_bytes() == (ssd / "params.safetensors").read_bytes()
    np.testing.assert_array_less(0, losses(host))


SPLIT = {
    "resident-overlap": ["offload.params=resident", "offload.overlap=true"],
    "ssd-overlap-accum-compact": ["offload.params=ssd", "offload.overlap=true", "train.grad_accum=2",
                                  "model.dtype=bfloat16", "optimizer.master_dtype=bfloat16",
                                  "optimizer.state_dtype=int8"],
}


@pytest.mark.parametrize("extra", SPLIT.values(), ids=SPLIT.keys())
def test_the_first_layers_gradients_in_ram_the_rest_on_ssd_train_bit_identically(tmp_path, corpus, extra):
    extra = [*extra, "offload.keep_files=true"]
    ssd, ssd_records, ssd_params = train(tmp_path / "ssd", corpus, *extra, "offload.gradients=ssd")
    split, records, split_params = train(tmp_path / "split", corpus, *extra, "offload.gradients=host",
                                         "offload.host_gradient_layers=1")
    assert split.losses == ssd.losses and split_params == ssd_params  # the same bits
    grads, in_ram, steps = records[-1]["grad_bytes"], records[-1]["host_grad_bytes"], len(split.losses)
    # one of the stack's three layers: a third of the stack's gradients, less than all of them
    assert records[-1]["gradients"] == "host" and 0 < in_ram < grads / 3
    # the SSD skips exactly that layer's round trip: written by the backward, read by the update
    written = ssd.ssd_bytes_written_run - split.ssd_bytes_written_run
    assert written % steps == 0 and in_ram <= written // steps < in_ram + 4096 * 16
    read = ssd_records[-1]["ssd_read_bytes_step"] - records[-1]["ssd_read_bytes_step"]
    assert in_ram <= read < in_ram + 4096 * 16
