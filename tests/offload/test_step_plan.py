"""The step's strategy is resolved once, from the config and the job: a matrix over the modes
(weights resident or on SSD, overlap, accumulation, processes and devices), with every refusal
and every silent choice where the plan says it is."""

import dataclasses

import pytest

from jaxascend.config import ConfigError, load_config
from jaxascend.offload import JobShape, StepPlan
from jaxascend.offload.partition import Partition

SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32", "data.batch_size=4"]
SINGLE, JOB, DEVICES = JobShape(), JobShape(processes=2, index=1), JobShape(local_devices=2)
JOB_DEVICES = JobShape(processes=2, index=1, local_devices=2)


def _plan(*overrides, job=SINGLE, vocab=259):
    cfg = load_config("configs/tiny.yaml", SMALL + list(overrides))
    return StepPlan.resolve(cfg, dataclasses.replace(cfg.model, vocab_size=vocab), job)


# (overrides, job) -> (overlap, refusal in the note, gradients, weight source, partition)
CASES = {
    "resident-overlap": (["model.remat=full"], SINGLE, (True, None, "instant", "host", None)),
    "resident-remat-none": (["model.remat=none"], SINGLE, (False, "model.remat: none", "instant", "arrays", None)),
    "resident-no-overlap": (["model.remat=full", "offload.overlap=false"], SINGLE,
                            (False, None, "instant", "arrays", None)),
    "resident-accum": (["model.remat=full", "train.grad_accum=2"], SINGLE, (True, None, "instant", "host", None)),
    "ssd-accum": (["model.remat=full", "offload.params=ssd", "train.grad_accum=4"], SINGLE,
                  (True, None, "instant", "ssd", None)),
    "ssd-overlap": (["model.remat=full", "offload.params=ssd"], SINGLE, (True, None, "instant", "ssd", None)),
    "ssd-no-overlap": (["model.remat=full", "offload.params=ssd", "offload.overlap=false"], SINGLE,
                       (False, None, "instant", "ssd", None)),
    "ablation": (["model.remat=full", "offload.post_backward_overflow_check=true"], SINGLE,
                 (False, "offload.post_backward_overflow_check", "post_backward", "arrays", None)),
    "job-resident": (["model.remat=full"], JOB, (True, None, "instant", "host", Partition(1, 2))),
    "job-resident-no-overlap": (["model.remat=full", "offload.overlap=false"], JOB,
                                (False, None, "instant", "arrays", Partition(1, 2))),
    "job-ssd": (["model.remat=full", "offload.params=ssd"], JOB, (True, None, "instant", "ssd", Partition(1, 2))),
    "job-accum": (["model.remat=full", "train.grad_accum=2"], JOB, (True, None, "instant", "host", Partition(1, 2))),
    "job-ssd-accum": (["model.remat=full", "offload.params=ssd", "train.grad_accum=2"], JOB,
                      (True, None, "instant", "ssd", Partition(1, 2))),
    "devices-resident": (["model.remat=full"], DEVICES, (True, None, "instant", "host", Partition(0, 1))),
    "devices-ssd": (["model.remat=full", "offload.params=ssd"], DEVICES,
                    (True, None, "instant", "ssd", Partition(0, 1))),
    "job-devices": (["model.remat=full"], JOB_DEVICES, (True, None, "instant", "host", Partition(1, 2))),
    "job-devices-ssd": (["model.remat=full", "offload.params=ssd"], JOB_DEVICES,
                        (True, None, "instant", "ssd", Partition(1, 2))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_plan_of_each_mode(name):
    overrides, job, (overlap, refusal, gradients, source, partition) = CASES[name]
    plan = _plan(*overrides, job=job)
    assert (plan.overlap, plan.gradients, plan.weight_source, plan.partition) == (overlap, gradients, source, partition)
    assert plan.local_devices == (2 if job.local_devices > 1 else 1)
    assert plan.partitioned == (job.processes > 1) and plan.processes == job.processes
    assert plan.table_per_use == (gradients == "instant")
    overlap_notes = [n for n in plan.notes if n.startswith("offload.overlap is off")]
    if refusal is None:
        assert plan.overlap_refused is None and not overlap_notes
    else:  # an asked-for overlap that is off is one note naming why
        assert refusal in plan.overlap_refused and len(overlap_notes) == 1 and refusal in overlap_notes[0]
    described = plan.describe()
    assert described["overlap"] == overlap and described["notes"] == list(plan.notes)


def test_devices_that_cannot_share_the_run_are_a_note_not_an_error():
    uneven = _plan("model.remat=full", "data.batch_size=3", job=DEVICES)
    assert uneven.partition is None and uneven.local_devices == 1
    assert [n for n in uneven.notes if "devices is off" in n] == [
        "data parallel over this process's 2 devices is off, the step runs on the first: data.batch_size: 3 rows "
        "do not split evenly over the 2 devices"]
    # A job of 2 processes x 2 devices whose 6 rows split over the processes, not over the 4 devices.
    job = _plan("model.remat=full", "data.batch_size=6", job=JOB_DEVICES)
    assert job.partition == Partition(1, 2) and job.local_devices == 1
    assert job.notes == ("data parallel over each process's 2 devices is off, each process runs on its first: "
                         "data.batch_size: 6 rows do not split evenly over the job's 2 x 2 devices",)
    in_memory = _plan("offload.enabled=false", job=DEVICES)
    assert in_memory.engine == "in-memory" and in_memory.partition is None and not in_memory.overlap
    assert any("the in-memory engine runs on one device" in n for n in in_memory.notes)


@pytest.mark.parametrize("overrides, vocab, message", [
    (["offload.enabled=false"], 259, "the in-memory engine runs one process"),
    (["data.batch_size=3"], 259, "data.batch_size: 3 rows do not split evenly over the job's 2 processes"),
    (["model.remat=full", "offload.fp32_grad_buffer=true"], 259, "the ablation switches"),
], ids=["in-memory", "uneven-rows", "ablation"])
def test_what_a_job_cannot_run_is_refused_by_name(overrides, vocab, message):
    with pytest.raises(ConfigError, match=message):
        _plan(*overrides, job=JOB, vocab=vocab)


def test_a_job_runs_a_token_table_in_blocks():
    plan = _plan("model.hidden_size=128", "model.remat=full", job=JOB, vocab=151936)  # 19.4M elements: 16 blocks
    assert plan.partition == Partition(1, 2) and not plan.notes


def test_choices_made_before_are_notes_too():
    cfg = load_config("configs/tiny.yaml", SMALL + ["model.remat=full"])
    plan = StepPlan.resolve(cfg, dataclasses.replace(cfg.model, vocab_size=259), choices=("offload.params: auto "
                                                                                          "chose resident",))
    assert plan.notes == ("offload.params: auto chose resident",) and plan.overlap


def test_the_plan_records_the_platform_path(monkeypatch):
    monkeypatch.delenv("JAXASCEND_HOST_CALLBACKS", raising=False)
    assert _plan().host_callbacks is False  # the FFI targets on the CPU
    monkeypatch.setenv("JAXASCEND_HOST_CALLBACKS", "1")
    assert _plan().host_callbacks is True and _plan().describe()["host_callbacks"] is True


def test_durable_steps_are_decided_once_with_a_note_where_they_are_off():
    assert _plan("model.remat=full", "offload.durable=true").durable
    assert not _plan("model.remat=full").durable  # off unless asked
    job = _plan("model.remat=full", "offload.durable=true", job=JOB)  # its processes agree on the step (a barrier)
    assert job.durable and not any("offload.durable" in n for n in job.notes)
    master16 = _plan("model.remat=full", "offload.params=ssd", "offload.durable=true", "optimizer.master_dtype=bfloat16")
    assert master16.durable and not any("offload.durable" in n for n in master16.notes)  # its layers rotate too
    with pytest.raises(ConfigError, match=r"^offload.durable: true needs offload.enabled: true \(the in-memory "):
        _plan("offload.enabled=false", "offload.durable=true")
    assert _plan("model.remat=full", "offload.durable=true", "offload.gradients=host").durable  # with their log
    with pytest.raises(ConfigError, match="offload.durable: an interrupted update is redone from the step's gradients"):
        _plan("model.remat=full", "offload.durable=true", "offload.fp32_grad_buffer=true")


def test_the_run_planner_counts_the_spare_records_and_the_gradients_log(tmp_path):
    from jaxascend.planning import plan_resources

    def planned(*extra):
        cfg = load_config("configs/tiny.yaml", SMALL + [f"train.out_dir={tmp_path}", *extra])
        return plan_resources(cfg, dataclasses.replace(cfg.model, vocab_size=259))

    _, plain = planned("offload.gradients=ssd")
    cfg, durable = planned("offload.durable=true", "offload.durable_spares=2", "offload.gradients=ssd")
    files = lambda plan: next(p.nbytes for fs in plan.disk for p in fs.parts if p.name == "offload files")  # noqa: E731
    assert files(durable) > files(plain) + 2 * (1 << 20)  # spares and the journal's two slots
    assert durable.ssd_write_step == plain.ssd_write_step and durable.ssd_read_step == plain.ssd_read_step
    # auto keeps them in RAM where they fit; durable steps write them to their log on SSD (not read)
    _, host = planned("offload.gradients=auto")
    cfg, logged = planned("offload.durable=true", "offload.durable_spares=2")
    grads = host.host["gradients"]
    assert cfg.offload.gradients == "host" and logged.host["gradients"] == grads
    assert any("offload.durable logs them on SSD" in c for c in logged.choices)
    assert logged.ssd_write_step == host.ssd_write_step + grads and logged.ssd_read_step == host.ssd_read_step
    assert files(logged) == files(durable)  # the log in place of the gradients' regions on SSD
    # a bfloat16 master of streamed weights: its spare layers (one a streamed leaf) on top
    master16 = ("offload.params=ssd", "optimizer.master_dtype=bfloat16", "model.remat=full", "offload.durable=true")
    by_spares = []
    for n in (1, 2, 3):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("jaxascend.offload.slot_rings.PARAM_SPARES", n)
            by_spares.append(files(planned(*master16)[1]))
    assert by_spares[1] - by_spares[0] > 0  # one more layer of every streamed leaf
    assert by_spares[2] == by_spares[1]  # at most the stack's 2 layers
