"""What the field help (``python -m jaxascend.config``) says about modes is true: every claim that
a mode is on, off, chosen or refused under some condition is one row below, quoting the words of
the help that make it, and is checked against what the run decides: the config check, the run
planner (``offload.params: auto``, the host-memory limit) and :class:`StepPlan` (the step's modes,
notes and refusals), resolved in the order ``preparation.prepare_run`` resolves them.

A field whose help uses the words of such a claim is either in the table or named in
:data:`DECIDED_ELSEWHERE` with the test that holds it, so a new claim cannot go unchecked.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from jaxascend.config import ConfigError, load_config
from jaxascend.config.field_docs import config_fields
from jaxascend.config.sections import IO_ENGINES, OffloadConfig
from jaxascend.data import ByteTokenizer, load_tokenizer
from jaxascend.offload import JobShape, StepPlan
from jaxascend.planning import plan_resources

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32", "data.batch_size=4"]
SINGLE, JOB, DEVICES = JobShape(), JobShape(processes=2, index=1), JobShape(local_devices=2)
MEM_ENV = "JAXASCEND_MEM_AVAILABLE_BYTES"  # machine_limits: replaces MemAvailable and the cgroup's figure
PLENTY, SCARCE = "1TiB", "1MiB"
OVERLAP_OFF = "offload.overlap is off"


@dataclass(frozen=True)
class Claim:
    """One claim of one field's help, the config that puts it to the test, and what must follow."""

    field: str  # the field whose help makes the claim
    says: str  # the help's words that make it
    overrides: tuple[str, ...]  # on top of configs/tiny.yaml and SMALL
    job: JobShape = SINGLE
    mem_available: str = PLENTY  # what the machine gives (offload.params: auto without a budget)
    plan: dict = field(default_factory=dict)  # StepPlan attribute -> value
    note: Optional[str] = None  # in exactly one of the plan's notes
    no_note: Optional[str] = None  # in none of them
    refused: Optional[str] = None  # in the ConfigError's message (the config check or StepPlan)
    does_not_fit: Optional[str] = None  # in one of the run plan's problems


@dataclass(frozen=True)
class Outcome:
    plan: Optional[StepPlan]  # None: refused
    refusal: Optional[str]
    problems: tuple[str, ...] = ()


OVERLAP = "offload.overlap"
PARAMS = "offload.params"
GRADS = "offload.gradients"
CLAIMS = [
    # offload.enabled
    Claim("offload.enabled", "false: the in-memory engine, everything in RAM (one process", ("offload.enabled=false",), job=JOB,
          refused="the in-memory engine runs one process"),
    Claim("offload.enabled", "one device", ("offload.enabled=false",), job=DEVICES,
          plan={"engine": "in-memory", "partition": None, "local_devices": 1},
          note="devices is off, the step runs on the first: the in-memory engine runs on one device"),
    Claim("offload.enabled", "no overlap", ("offload.enabled=false", "model.remat=full"),
          plan={"engine": "in-memory", "overlap": False, "overlap_refused": None}, no_note=OVERLAP_OFF),
    Claim("offload.enabled", "no offload.params: ssd", ("offload.enabled=false", "model.remat=full",
                                                        "offload.params=ssd"), refused="needs offload.enabled: true"),
    Claim("offload.enabled", "true (the default): the offloaded engine", ("model.remat=full",), plan={"engine": "offload"}),
    # offload.host_memory_budget
    Claim("offload.host_memory_budget", "the run's host memory (the plan's total, the arena included) must fit",
          ("model.remat=full", "offload.params=ssd", "offload.host_memory_budget=1MiB"),
          does_not_fit="offload.host_memory_budget: the plan needs"),
    Claim("offload.host_memory_budget", "offload.params: auto plans against it",
          ("model.remat=full", "offload.host_memory_budget=1MiB"), plan={"weights": "ssd"},
          note="offload.params: auto chose ssd (resident would need"),
    # offload.params
    Claim(PARAMS, '"resident" (device memory', ("model.remat=full", "offload.params=resident"),
          plan={"weights": "resident", "weight_source": "host"}),
    Claim(PARAMS, '"ssd" (shard store regions', ("model.remat=full", "offload.params=ssd"),
          plan={"weights": "ssd", "weight_source": "ssd"}),
    Claim(PARAMS, "needs offload.enabled", ("offload.enabled=false", "model.remat=full", "offload.params=ssd"),
          refused="offload.params: 'ssd' needs offload.enabled: true"),
    Claim(PARAMS, "and model.remat other than none", ("model.remat=none", "offload.params=ssd"),
          refused="offload.params: 'ssd' needs model.remat other than 'none'"),
    Claim(PARAMS, "refused with post_backward_overflow_check",
          ("model.remat=full", "offload.params=ssd", "offload.post_backward_overflow_check=true"),
          refused="offload.params: 'ssd' cannot be combined with offload.post_backward_overflow_check"),
    Claim(PARAMS, "resident if the run's plan fits host_memory_budget",
          ("model.remat=full", "offload.host_memory_budget=64GiB"), mem_available=SCARCE,
          plan={"weights": "resident"}, note="offload.params: auto chose resident"),
    Claim(PARAMS, "without one: what the machine can give, MemAvailable", ("model.remat=full",),
          mem_available=SCARCE, plan={"weights": "ssd"}, note="offload.params: auto chose ssd (resident would need"),
    Claim(PARAMS, "without one: what the machine can give", ("model.remat=full",), mem_available=PLENTY,
          plan={"weights": "resident"}, note="offload.params: auto chose resident"),
    Claim(PARAMS, "else resident over the limit", ("model.remat=none", "offload.host_memory_budget=1MiB"),
          plan={"weights": "resident"}, note="offload.params: auto stays resident over the budget"),
    # offload.gradients
    Claim(GRADS, '"ssd" (written by the backward', ("model.remat=full", "offload.gradients=ssd"),
          plan={"grad_store": "ssd"}, no_note="offload.gradients: auto"),
    Claim(GRADS, '"host" (the same regions kept in RAM', ("model.remat=full", "offload.gradients=host"),
          plan={"grad_store": "host"}, no_note="offload.gradients: auto"),
    Claim(GRADS, "host when the run's plan still fits with it, 10% free (after offload.params chose)", ("model.remat=full",),
          plan={"grad_store": "host", "weights": "resident"}, note="offload.gradients: auto chose host (the gradients"),
    Claim(GRADS, "else ssd; said in a note", ("model.remat=full",), mem_available=SCARCE,
          plan={"grad_store": "ssd", "weights": "ssd"}, note="offload.gradients: auto chose ssd (in RAM they would"),
    Claim(GRADS, "ssd and host need offload.enabled", ("offload.enabled=false", "offload.gradients=host"),
          refused="offload.gradients: 'host' needs offload.enabled: true"),
    Claim(GRADS, "refused with fp32_grad_buffer (leave it auto)",
          ("model.remat=full", "offload.fp32_grad_buffer=true", "offload.gradients=ssd"),
          refused="offload.gradients: 'ssd' cannot be combined with offload.fp32_grad_buffer"),
    Claim(GRADS, "refused with fp32_grad_buffer (leave it auto)", ("model.remat=full", "offload.fp32_grad_buffer=true"),
          plan={"grad_store": "host_fp32"}, no_note="offload.gradients: auto"),
    # offload.host_gradient_layers
    Claim("offload.host_gradient_layers", "Refused with ssd and auto",
          ("offload.gradients=ssd", "offload.host_gradient_layers=1"),
          refused="offload.host_gradient_layers: 1 needs offload.gradients: host, got 'ssd'"),
    Claim("offload.host_gradient_layers", "Refused with ssd and auto", ("offload.host_gradient_layers=1",),
          refused="offload.host_gradient_layers: 1 needs offload.gradients: host, got 'auto'"),
    Claim("offload.host_gradient_layers", "only the layer stack's first N layers",
          ("offload.gradients=host", "offload.host_gradient_layers=3"),
          refused="offload.host_gradient_layers: 3 is more than the model's 2 layers"),
    Claim("offload.host_gradient_layers", "only the layer stack's first N layers",
          ("offload.gradients=host", "offload.host_gradient_layers=1"), plan={"grad_store": "host"},
          no_note="offload.gradients: auto"),
    # offload.durable
    Claim("offload.durable", "with them in RAM (offload.gradients host) each update",
          ("model.remat=full", "offload.durable=true", "offload.gradients=host"), plan={"durable": True,
                                                                                       "grad_store": "host"}),
    Claim("offload.durable", "Needs offload.enabled", ("offload.enabled=false", "offload.durable=true"),
          refused="offload.durable: true needs offload.enabled: true"),
    Claim("offload.durable", "refused with offload.fp32_grad_buffer",
          ("model.remat=full", "offload.durable=true", "offload.fp32_grad_buffer=true"),
          refused="offload.durable: an interrupted update is redone from the step's gradients"),
    Claim("offload.durable", "In a job each process keeps its own", ("model.remat=full", "offload.durable=true"),
          job=JOB, plan={"durable": True}, no_note="offload.durable is off"),
    # offload.overlap
    Claim(OVERLAP, "The optimizer of step t runs on a thread while step t+1's forward/backward runs",
          ("model.remat=full",), plan={"overlap": True, "overlap_refused": None}, no_note=OVERLAP_OFF),
    Claim(OVERLAP, "in the offloaded engine, with train.grad_accum > 1 and", ("model.remat=full",
                                                                             "train.grad_accum=4"),
          plan={"overlap": True, "grad_accum": 4}, no_note=OVERLAP_OFF),
    Claim(OVERLAP, "in the offloaded engine, with train.grad_accum > 1 and",
          ("model.remat=full", "offload.params=ssd", "train.grad_accum=4"),
          plan={"overlap": True, "grad_accum": 4, "weight_source": "ssd"}, no_note=OVERLAP_OFF),
    Claim(OVERLAP, "with train.grad_accum > 1 and in a job too", ("model.remat=full",), job=JOB,
          plan={"overlap": True, "partitioned": True}, no_note=OVERLAP_OFF),
    Claim(OVERLAP, "Off (said once, in a note) with fp32_grad_buffer",
          ("model.remat=full", "offload.fp32_grad_buffer=true"), plan={"overlap": False},
          note=f"{OVERLAP_OFF}, the optimizer step runs after the forward/backward: offload.fp32_grad_buffer"),
    Claim(OVERLAP, "post_backward_overflow_check", ("model.remat=full", "offload.post_backward_overflow_check=true"),
          plan={"overlap": False}, note=f"{OVERLAP_OFF}, the optimizer step runs after the forward/backward: "
                                       "offload.post_backward_overflow_check"),
    Claim(OVERLAP, "resident weights (params resident", ("model.remat=none", "offload.params=resident"),
          plan={"overlap": False, "weights": "resident"}, note=f"{OVERLAP_OFF}, the optimizer step runs after the "
                                                                "forward/backward: model.remat: none"),
    Claim(OVERLAP, "or auto's choice) under model.remat: none", ("model.remat=none",),
          plan={"overlap": False, "weights": "resident"}, note="model.remat: none (the layer scan"),
    Claim(OVERLAP, "under model.remat: none", ("model.remat=full",), plan={"overlap": True}, no_note=OVERLAP_OFF),
    # the ablation switches
    Claim("offload.fp32_grad_buffer", "no overlap", ("model.remat=full", "offload.fp32_grad_buffer=true"),
          plan={"overlap": False, "overlap_refused": "offload.fp32_grad_buffer (the ablation's host buffer has no "
                                                     "receipts to order the arrivals)"}),
    Claim("offload.fp32_grad_buffer", "one device", ("model.remat=full", "offload.fp32_grad_buffer=true"), job=JOB,
          refused="the ablation switches (post_backward_overflow_check, fp32_grad_buffer) are single-process"),
    Claim("offload.fp32_grad_buffer", "one device", ("model.remat=full", "offload.fp32_grad_buffer=true"),
          job=DEVICES, plan={"partition": None, "local_devices": 1},
          note="devices is off, the step runs on the first: the ablation switches"),
    Claim("offload.post_backward_overflow_check", "The full gradient tree",
          ("model.remat=full", "offload.post_backward_overflow_check=true"),
          plan={"gradients": "post_backward", "table_per_use": False, "overlap": False}),
    Claim("offload.post_backward_overflow_check", "one device",
          ("model.remat=full", "offload.post_backward_overflow_check=true"), job=JOB,
          refused="the ablation switches (post_backward_overflow_check, fp32_grad_buffer) are single-process"),
    Claim("offload.post_backward_overflow_check", "no params: ssd",
          ("model.remat=full", "offload.params=ssd", "offload.post_backward_overflow_check=true"),
          refused="cannot be combined with offload.post_backward_overflow_check"),
    # optimizer, train, data, eval
    Claim("optimizer.state_dtype", "needs offload.enabled", ("offload.enabled=false", "optimizer.state_dtype=int8"),
          refused="optimizer.state_dtype: 'int8' needs offload.enabled: true"),
    Claim("optimizer.master_dtype", "needs offload.enabled", ("offload.enabled=false", "optimizer.master_dtype=bfloat16"),
          refused="optimizer.master_dtype: 'bfloat16' needs offload.enabled: true"),
    Claim("optimizer.master_dtype", "needs model.dtype: bfloat16", ("model.dtype=float32",
                                                                    "optimizer.master_dtype=bfloat16"),
          refused="optimizer.master_dtype: 'bfloat16' needs model.dtype: bfloat16"),
    Claim("train.grad_accum", "each layer running them in turn (overlap and jobs alike)",
          ("model.remat=full", "train.grad_accum=3"), job=JOB,
          plan={"grad_accum": 3, "overlap": True, "partitioned": True}),
    Claim("train.distributed", "Data parallel: needs offload.enabled", ("offload.enabled=false",), job=JOB,
          refused="data parallelism partitions the SSD state (offload.enabled: true)"),
    Claim("train.distributed", "each process holds its slice of the SSD state", ("model.remat=full",), job=JOB,
          plan={"partitioned": True, "processes": 2}),
    Claim("data.batch_size", "split evenly over its processes (refused", ("model.remat=full", "data.batch_size=3"),
          job=JOB, refused="data.batch_size: 3 rows do not split evenly over the job's 2 processes"),
    Claim("data.batch_size", "(else those devices go unused, said in a note)",
          ("model.remat=full", "data.batch_size=3"), job=DEVICES, plan={"partition": None, "local_devices": 1},
          note="data.batch_size: 3 rows do not split evenly over the 2 devices"),
    Claim("data.batch_size", "over each process's devices", ("model.remat=full", "data.batch_size=4"), job=DEVICES,
          plan={"local_devices": 2}, no_note="devices is off"),
    Claim("eval.batch_size", "split over a job's processes and devices as it is",
          ("model.remat=full", "eval.batch_size=3"), job=JOB,
          refused="eval.batch_size: 3 rows do not split evenly over the job's 2 processes"),
    Claim("eval.batch_size", "split over a job's processes and devices as it is",
          ("model.remat=full", "eval.batch_size=3"), job=DEVICES, plan={"local_devices": 1},
          note="eval.batch_size: 3 rows do not split evenly over the 2 devices"),
]

# Fields whose help uses a claim's words for what no StepPlan decides, and the tests that hold it.
DECIDED_ELSEWHERE = {
    "offload.io_engine": "the store at open: tests/ssd/test_io_engines.py (the fallback to threads)",
    "offload.direct_io": "the store at open: tests/ssd/test_store.py (the buffered fallback)",
    "offload.lock_memory": "the arena: tests/ssd/test_arena.py (mlock refused: a warning)",
    "offload.drop_page_cache": "the buffered path: tests/ssd/test_io_engines.py, tests/offload/test_ablations.py",
    "offload.arena_bytes": "a size, not a mode (what the arena plan needs): tests/ssd/test_arena.py",
    "data.tokenizer": "the tokenizer, not a step mode: test_the_tokenizer_auto_of_a_model_from_scratch_is_bytes",
    "data.format": "the data's first records, not a step mode: tests/data/test_format_auto.py",
    "checkpoint.every_minutes": "a schedule, not a mode (0: off): tests/test_run_bookkeeping.py",
    "train.epochs": "the run's length, counted from the data: tests/test_epochs.py (the note of a --set over the file's other)",
}
# The words of a claim about a mode: on, off, chosen, refused, needed, a fallback.
CLAIM_WORDS = re.compile(r"\b(needs|refused|off|overlap|one process|one device|auto's|chooses|chose|falls back|"
                         r'else "?\w+|fallback|unused|in a note|said once)\b', re.I)


def _outcome(claim: Claim, out_dir: Path, monkeypatch) -> Outcome:
    """The run's decisions for the claim's config, in prepare_run's order: the config check, the
    run planner (offload.params resolved), then the step plan with the planner's choices."""
    monkeypatch.setenv(MEM_ENV, claim.mem_available)
    try:
        cfg = load_config("configs/tiny.yaml", SMALL + [f"train.out_dir={out_dir}", *claim.overrides])
        model_cfg = dataclasses.replace(cfg.model, vocab_size=259)
        cfg, resources = plan_resources(cfg, model_cfg, processes=claim.job.processes)
        plan = StepPlan.resolve(cfg, model_cfg, claim.job, choices=resources.choices)
    except ConfigError as err:
        return Outcome(None, str(err))
    return Outcome(plan, None, tuple(resources.problems()))


def _meanings() -> dict[str, str]:
    return {doc.name: doc.meaning for doc in config_fields()}


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: f"{c.field}: {c.says}: {' '.join(c.overrides)}")
def test_each_claim_of_the_help_holds(claim, tmp_path, monkeypatch):
    assert claim.says in _meanings()[claim.field], f"{claim.field}'s help no longer says {claim.says!r}"
    got = _outcome(claim, tmp_path, monkeypatch)
    if claim.refused is not None:
        assert got.refusal is not None and claim.refused in got.refusal, got
        return
    assert got.refusal is None, got.refusal
    assert {name: getattr(got.plan, name) for name in claim.plan} == claim.plan
    if claim.note is not None:
        assert len([n for n in got.plan.notes if claim.note in n]) == 1, got.plan.notes
    if claim.no_note is not None:
        assert not [n for n in got.plan.notes if claim.no_note in n], got.plan.notes
    if claim.does_not_fit is not None:
        assert any(claim.does_not_fit in p for p in got.problems), got.problems


def test_auto_without_a_budget_plans_against_what_the_machine_gives(tmp_path, monkeypatch):
    claim = Claim(PARAMS, "without one: what the machine can give", ("model.remat=full",), mem_available=SCARCE)
    notes = _outcome(claim, tmp_path, monkeypatch).plan.notes
    assert [n for n in notes if n.startswith("offload.params: auto chose ssd") and MEM_ENV in n], notes


def test_every_field_whose_help_claims_a_mode_is_checked():
    claimed = {c.field for c in CLAIMS}
    unchecked = sorted(name for name, meaning in _meanings().items()
                       if CLAIM_WORDS.search(meaning) and name not in claimed and name not in DECIDED_ELSEWHERE)
    assert not unchecked, f"field help that claims a mode without a row in CLAIMS: {unchecked}"
    stale = sorted(set(DECIDED_ELSEWHERE) - {name for name, m in _meanings().items() if CLAIM_WORDS.search(m)})
    assert not stale, f"DECIDED_ELSEWHERE names fields whose help claims no mode: {stale}"


def test_the_claim_words_find_a_claim():
    assert CLAIM_WORDS.search("Runs without overlap (said once) with train.grad_accum > 1")
    assert CLAIM_WORDS.search("ssd needs model.remat other than none")
    assert not CLAIM_WORDS.search("peak learning rate (after the warmup)")


def test_the_readme_names_only_the_io_engines_the_config_takes():
    readme = (REPO / "README.md").read_text()
    values = re.search(r"`io_engine` \(([^)]*)\)", readme).group(1)
    named = set(re.findall(r"`(\w+)`", values))
    fields = {f.name for f in dataclasses.fields(OffloadConfig)}
    assert set(IO_ENGINES) <= named and named - set(IO_ENGINES) <= fields, named
    for engine in named - fields:
        load_config("configs/tiny.yaml", [f"offload.io_engine={engine}"])  # the CLI takes each
    with pytest.raises(ConfigError, match="offload.io_engine: 'io_threads' is not one of auto, io_uring, threads"):
        load_config("configs/tiny.yaml", ["offload.io_engine=io_threads"])


def test_the_tokenizer_auto_of_a_model_from_scratch_is_bytes():
    assert 'else "byte"' in _meanings()["data.tokenizer"]
    assert isinstance(load_tokenizer("auto", None), ByteTokenizer)
