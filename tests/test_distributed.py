"""The process group on JAX's runtime: the train.distributed section, what the environment asks
for, two real processes on 127.0.0.1 joining one job (gloo collectives), and what the trainer
does with a job of more than one process today."""

from __future__ import annotations

import textwrap

import pytest

from jaxascend.config import ConfigError, load_config
from jaxascend.distributed import ProcessGroup, initialize, process_dir, requested
from tests._jobs import local_job


@pytest.mark.parametrize("value, message", [
    ("{num_processes: 2}", "give coordinator, num_processes and process_id together"),
    ("{coordinator: x, num_processes: 2, process_id: 0}", "train.distributed.coordinator: expected host:port"),
    ("{coordinator: 'h:1', num_processes: 2, process_id: 2}", "process_id: 2 is not below num_processes=2"),
    ("{heartbeat_timeout_seconds: 0}", "train.distributed.heartbeat_timeout_seconds"),
    ("{bogus: 1}", "train.distributed.bogus: unknown key"),
])
def test_bad_distributed_sections_are_one_line_naming_the_field(value, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config("configs/tiny.yaml", [f"train.distributed={value}"])
    assert "\n" not in str(err.value)


def test_what_asks_for_a_job():
    assert not requested(None, {})
    assert not requested(None, {"SLURM_NTASKS": "1", "OMPI_COMM_WORLD_SIZE": "1"})
    assert requested(None, {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    assert requested(None, {"SLURM_NTASKS": "4"}) and requested(None, {"OMPI_COMM_WORLD_SIZE": "2"})
    cfg = load_config("configs/tiny.yaml", ["train.distributed={coordinator: 'h:1', num_processes: 1, process_id: 0}"])
    assert requested(cfg.train.distributed, {})
    # Timeouts alone tune the job the environment describes; without one, a single process.
    timeouts = load_config("configs/tiny.yaml", ["train.distributed={heartbeat_timeout_seconds: 5}"]).train.distributed
    assert not requested(timeouts, {})
    assert requested(timeouts, {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})


def test_a_single_process_joins_nothing(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    group = initialize(None)
    assert group == ProcessGroup(0, 1) and group.is_main
    assert process_dir("/nvme/run/offload-{process}", ProcessGroup(3, 4)) == "/nvme/run/offload-3"
    assert process_dir("/nvme/run/offload/", ProcessGroup(3, 4)) == "/nvme/run/offload/process3"
    assert process_dir("/nvme/run/offload", ProcessGroup()) == "/nvme/run/offload"


CHILD = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxascend.distributed import initialize
    group = initialize(None)
    mesh = Mesh(np.array(jax.devices()), ("p",))
    local = np.full((1, 4), group.index + 1, np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("p")), local)
    total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "p"), mesh=mesh, in_specs=P("p"), out_specs=P("p")))(x)
    print("group", group.index, group.count, "sum", float(np.asarray(total.addressable_shards[0].data)[0, 0]))
""")


def test_two_processes_on_localhost_form_one_job_with_gloo_collectives():
    results = local_job(CHILD, 2)
    for i, (code, out, err) in enumerate(results):
        assert code == 0, err[-2000:]
        assert f"group {i} 2 sum 3.0" in out


@pytest.mark.parametrize("setting,message", [
    ("offload.enabled=false", "train.distributed: this job has 2 processes; data parallelism partitions the SSD "
                              "state (offload.enabled: true), the in-memory engine runs one process"),
    ("data.batch_size=3", "data.batch_size: 3 rows do not split evenly over the job's 2 processes"),
    ("offload.fp32_grad_buffer=true", "train.distributed: this job has 2 processes; the ablation switches "
                                      "(post_backward_overflow_check, fp32_grad_buffer) are single-process"),
])
def test_the_trainer_refuses_what_a_job_cannot_run_before_writing(tmp_path, setting, message):
    code = textwrap.dedent("""
        import sys
        from jaxascend.train import main
        sets = [a for s in sys.argv[2:] for a in ("--set", s)]
        sys.exit(main(["--config", "configs/tiny.yaml", "--set", "train.out_dir=" + sys.argv[1], *sets]))
    """)
    results = local_job(code, 2, args=(tmp_path / "never", *setting.split()))
    for code_, out, err in results:
        assert code_ == 2
        assert err.strip().splitlines() == ["error: " + message]
    assert not (tmp_path / "never").exists()


def test_the_jax_variables_describe_the_job():
    from jaxascend.distributed import from_environment

    cfg = from_environment({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"})
    assert (cfg.coordinator, cfg.num_processes, cfg.process_id) == ("10.0.0.1:1234", 4, 3)
    assert from_environment({}).coordinator is None  # SLURM / Open MPI: jax detects them itself
    with pytest.raises(ValueError, match="JAX_PROCESS_ID: expected a number beside JAX_COORDINATOR_ADDRESS"):
        from_environment({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="the JAX_\\* variables: train.distributed.process_id: 5 is not below"):
        from_environment({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "5"})
