"""The run's devices: a record per local device, JAXASCEND_DEVICE_MEM_BYTES (its parsing, its one
error line, the live arrays measured under it on CPU), the run's first line, and a GPU's
memory_stats read as a GPU reports them (a stand-in device)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxascend.config import ConfigError
from jaxascend.devices import (DEVICE_MEM_ENV, DeviceMonitor, backend_line, device_capacity, injected_capacity,
                               memory_fields, read_devices)
from jaxascend.metrics import device_postfix

GiB = 2**30


class FakeGpu:
    """What a CUDA device answers (the figures of an H200 with 3 GiB in use)."""

    platform, device_kind = "gpu", "NVIDIA H200"

    def memory_stats(self):
        return {"bytes_limit": 150_000_000_000, "bytes_in_use": 3 * GiB, "peak_bytes_in_use": 5 * GiB}


def test_a_cpu_device_without_the_variable_reports_no_device_memory(monkeypatch):
    monkeypatch.delenv(DEVICE_MEM_ENV, raising=False)
    [device] = read_devices()
    assert (device.platform, device.kind) == ("cpu", "cpu")
    assert device.capacity is device.in_use is device.peak is None and device.source == ""
    assert device_capacity() is None  # the CPU backend's device memory is host RAM
    assert memory_fields(read_devices()) == {} and DeviceMonitor().record() == {}
    assert backend_line() == "backend: cpu, 1 device: cpu (memory: host RAM)"


@pytest.mark.parametrize("value, nbytes", [("4GiB", 4 * GiB), (" 123 ", 123), ("1.5MiB", 3 * 2**19)])
def test_the_variable_sets_each_devices_capacity(monkeypatch, value, nbytes):
    monkeypatch.setenv(DEVICE_MEM_ENV, value)
    assert injected_capacity() == nbytes
    assert [d.capacity for d in read_devices()] == [nbytes] * jax.local_device_count()
    capacity = device_capacity()
    assert (capacity.nbytes, capacity.source) == (nbytes, DEVICE_MEM_ENV)


@pytest.mark.parametrize("value, message", [
    ("lots", "JAXASCEND_DEVICE_MEM_BYTES: expected a byte size like 4096 or '512MiB', got 'lots' "
             "(environment variable)"),
    ("0", "JAXASCEND_DEVICE_MEM_BYTES: must be > 0, got '0' (environment variable)"),
])
def test_a_bad_value_is_one_error_naming_the_variable(monkeypatch, value, message):
    monkeypatch.setenv(DEVICE_MEM_ENV, value)
    with pytest.raises(ConfigError) as err:
        read_devices()
    assert str(err.value) == message


def test_under_the_variable_the_live_arrays_on_cpu_are_the_bytes_in_use(monkeypatch):
    monkeypatch.setenv(DEVICE_MEM_ENV, "1GiB")
    monitor = DeviceMonitor()
    before = monitor.record()["device_mem_bytes"]
    held = jnp.ones((1 << 20,), jnp.float32)  # 4 MiB on the device
    pinned = jax.device_put(held, held.sharding.with_memory_kind("pinned_host"))  # not device memory
    during = monitor.record()
    assert during["device_mem_bytes"] - before == 4 * 2**20
    assert during["device_mem_capacity_bytes"] == GiB
    del held, pinned
    after = monitor.record()
    assert after["device_mem_bytes"] == before  # freed
    assert after["device_mem_peak_bytes"] >= before + 4 * 2**20 == monitor.peak()  # the readings' largest
    assert backend_line() == "backend: cpu, 1 device: cpu (1.0 GiB: JAXASCEND_DEVICE_MEM_BYTES)"


def test_a_gpus_memory_stats_are_its_figures(monkeypatch):
    monkeypatch.delenv(DEVICE_MEM_ENV, raising=False)
    devices = read_devices([FakeGpu(), FakeGpu()])
    assert devices[0].capacity == 150_000_000_000 and devices[0].source == "memory_stats"
    assert (devices[0].in_use, devices[0].peak) == (3 * GiB, 5 * GiB)
    assert memory_fields(devices) == {"device_mem_bytes": 3 * GiB, "device_mem_peak_bytes": 5 * GiB,
                                      "device_mem_capacity_bytes": 150_000_000_000}
    capacity = device_capacity(devices)
    assert (capacity.nbytes, capacity.source) == (150_000_000_000, "memory_stats (NVIDIA H200)")
    assert backend_line(devices).endswith(", 2 devices: NVIDIA H200 (139.7 GiB each)")
    monkeypatch.setenv(DEVICE_MEM_ENV, "4GiB")  # the variable replaces the capacity, not the readings
    [device] = read_devices([FakeGpu()])
    assert (device.capacity, device.source, device.in_use) == (4 * GiB, DEVICE_MEM_ENV, 3 * GiB)


def test_a_run_names_its_devices_first_and_records_their_memory(tmp_path):
    # The tiny shapes of test_train, 2 steps: under the variable the CPU run takes the GPU's path.
    from tests.test_train import SMALL

    out = tmp_path / "run"
    args = [sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml"]
    for o in SMALL + ["data.max_documents=20", "train.steps=2", "train.log_every=1", f"train.out_dir={out}"]:
        args += ["--set", o]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env={**os.environ, DEVICE_MEM_ENV: "1GiB"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = "backend: cpu, 1 device: cpu (1.0 GiB: JAXASCEND_DEVICE_MEM_BYTES)"
    assert proc.stdout.splitlines()[0] == first
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:  # the compute params at least are live on the device
        assert 0 < r["device_mem_bytes"] <= r["device_mem_peak_bytes"] < r["device_mem_capacity_bytes"] == GiB
    summary = json.loads((out / "summary.json").read_text())
    assert summary["devices"] == first and summary["peak_device_mem_bytes"] >= records[-1]["device_mem_peak_bytes"]
    assert any(line.startswith("peak device memory ") for line in proc.stdout.splitlines())


def test_the_progress_bar_shows_the_device_peak_against_its_capacity():
    record = {"device_mem_peak_bytes": int(3.1 * GiB), "device_mem_capacity_bytes": 4 * GiB}
    assert device_postfix(record) == " dev=3.1/4.0 GiB"
    assert device_postfix({"device_mem_peak_bytes": 3 * 2**20}) == " dev=3.00 MiB"
    assert device_postfix({}) == ""  # not reported: not shown


def test_the_trainer_refuses_a_device_too_small_in_one_line_before_anything_is_written(tmp_path, monkeypatch,
                                                                                       capsys):
    from jaxascend.train import main
    from tests.test_train import SMALL
    from tests.test_workflow import assert_one_error_line

    out = tmp_path / "run"
    args = ["--config", "configs/tiny.yaml"]
    for o in SMALL + ["data.max_documents=20", f"train.out_dir={out}"]:
        args += ["--set", o]
    for value, fragments in (("64KiB", ("device memory: the plan needs ", "it has (JAXASCEND_DEVICE_MEM_BYTES)",
                                        "levers: model.remat: full saves ")),
                             ("lots", ("JAXASCEND_DEVICE_MEM_BYTES: expected a byte size",))):
        monkeypatch.setenv(DEVICE_MEM_ENV, value)
        status = main(args)
        printed = capsys.readouterr()
        assert_one_error_line(subprocess.CompletedProcess(args, status, printed.out, printed.err), *fragments)
        assert printed.out == "" and not out.exists()  # refused before the run's first line
