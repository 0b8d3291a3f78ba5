"""The order in which pytest-xdist hands the test files to its workers, each file's time, and
one XLA compilation cache for the session (:func:`_share_compilations`).

With ``--dist loadfile`` each worker runs whole files (a module fixture is built once), taken
one at a time from a single queue. xdist sorts that queue by each file's number of tests unless
``--no-loadscope-reorder`` is given (pyproject.toml gives it): that put the files of a few
minutes-long jobs last, and one worker idled for minutes at the end while the other ran them.
Here the queue is the longest files first (the longest-processing-time rule), then the rest by
their number of tests, fewest first (a file of a few tests is an end-to-end run more often than
a file of many, which are parametrized unit tests): the last file either worker takes is a short
one, so the two finish together. The terminal summary lists the slowest files, to keep
:data:`SLOW_FIRST` up to date as files grow.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections import defaultdict

# Files that take half a minute or more, longest first. Seconds alone (-n 0) on a 2-core AMD
# EPYC at load 1-2 where measured (they double and triple under load); the others are ordered by
# the runs they make (trainings through the CLI or an engine, jobs of processes: seconds to tens
# of seconds each, mostly compiling), to be replaced by the figures of the summary below.
SLOW_FIRST = (
    "tests/test_durable_resume.py",  # about 300 s: 27 CLI trainings of the small shape, chains of kills
    "tests/test_train_distributed.py",  # 184 s: 20 trainings, jobs of 1-2 processes through jaxascend.launch
    "tests/test_durable_job.py",  # 112 s: 9 jobs of 2 processes through jaxascend.launch, chains of kills
    "tests/test_workflow.py",  # 178 s: 18 trainings through the CLI, exports
    "tests/offload/test_streamed_params.py",  # 83 s: a SIGKILL test of 6 CLI runs is half
    "tests/offload/test_overlap.py",  # 72 s
    "tests/offload/test_durable_steps.py",  # 70 s: 24 killed children of the state's owner
    "tests/test_signals.py",
    "tests/models/test_models.py",  # with test_gemma3: 130 s under load
    "tests/test_run_end.py",
    "tests/offload/test_vertical_micro_batches.py",
    "tests/offload/test_masked_loss_and_eval.py",
    "tests/test_resume.py",
    "tests/test_compressed_state_training.py",
    "tests/offload/test_blocked_loss_runs.py",
    "tests/offload/test_offloaded_training.py",
    "tests/offload/test_master_training.py",  # 113 s under CI's load: trainings of every master, resident and on SSD
    "tests/offload/test_step.py",  # 89 s under CI's load
    "tests/test_sft.py",
    "tests/data/test_format_auto.py",  # 70 s: 3 trainings of a tiny Qwen2 by configs/qwen2.5-0.5b.yaml
    "tests/hf/test_hub.py",  # 43 s: 2 CLI trainings from a hub id in a temporary cache (a resume), a refusal, a plan
    "tests/test_train.py",
    "tests/test_model_init.py",  # 38 s: 6 CLI trainings of the small shape (model.init: random, from scratch)
    "tests/offload/test_host_callbacks.py",
    "tests/models/test_decode.py",  # 81 s under load
    "tests/models/test_blocked_loss.py",  # 79 s
    "tests/test_blocked_prefill.py",  # 59 s
    "tests/models/test_blockwise_attention.py",  # 55 s
    "tests/test_generate.py",
    "tests/offload/test_data_parallel.py",  # 35 s: 4 jobs
    "tests/offload/test_data_parallel_table_job.py",  # 35 s: the 151936-row table, 2 jobs of 2-3 cases
    "tests/offload/test_finetune_flax_example.py",
    "tests/test_throughput.py",
    "tests/offload/test_grad_scatter.py",
    "tests/offload/test_collective_order.py",
    "tests/offload/test_ablations.py",
    "tests/data/test_sft_tiny.py",
)

_durations: dict[str, float] = defaultdict(float)


def _share_compilations() -> str | None:
    """One persistent XLA compilation cache for the session, unless one is set: the xdist workers
    and every process a test starts (the CLI runs, the jobs' processes) inherit it, and load an
    executable that another process compiled from the same program, flags and versions (JAX's
    cache key) instead of compiling it again. JAX keeps only what took a second or more to
    compile (the step functions: two entries for a tiny training), so writing costs little; a
    CLI training of the test model then takes ~5 s instead of ~7-10 s (CPU 4.6 s instead of
    8.7 s), with the same bits: the cache holds what the same compile gave. A size limit turns on
    the cache's file lock, so no process reads an entry another is still writing. Returns the
    folder this process made (the controller removes it at the end)."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return None
    folder = tempfile.mkdtemp(prefix="jaxascend-tests-xla-cache-")
    settings = {"jax_compilation_cache_dir": folder, "jax_compilation_cache_max_size": 8 << 30}
    os.environ.update({name.upper(): str(value) for name, value in settings.items()})
    if "jax" in sys.modules:  # imported before this file: set its options too
        import jax

        for name, value in settings.items():
            jax.config.update(name, value)
    return folder


_CACHE_FOLDER = _share_compilations()


def pytest_unconfigure(config):
    if _CACHE_FOLDER is not None:
        shutil.rmtree(_CACHE_FOLDER, ignore_errors=True)


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session, config, items):
    """Longest files first, the rest by their number of tests, fewest first (a stable sort: each
    file's tests keep their order and stay together)."""
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    counts: dict[str, int] = defaultdict(int)
    for item in items:
        counts[_file_of(item.nodeid)] += 1
    items.sort(key=lambda item: (rank.get(_file_of(item.nodeid), len(rank)), counts[_file_of(item.nodeid)]))


def pytest_runtest_logreport(report):
    """Each file's time: its tests' setup, call and teardown (on the controller with xdist)."""
    _durations[_file_of(report.nodeid)] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _durations:
        return
    slowest = sorted(_durations.items(), key=lambda kv: -kv[1])[:15]
    terminalreporter.write_sep("=", "slowest 15 files (setup + call + teardown of their tests)")
    for path, seconds in slowest:
        mark = "" if path in SLOW_FIRST else "  (not in SLOW_FIRST, tests/conftest.py)"
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}{mark}")
