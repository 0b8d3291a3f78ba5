"""A run's own bookkeeping: its peak memory is its own (not the process that started it), its
offload files go once the final checkpoint holds the state (unless kept), checkpoints come by the
clock too, and the stop settings are checked by name."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxascend.config import ConfigError, load_config
from jaxascend.trainer import run
from tests.test_signals import BASE, train

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def re_size(name: str):
    """The parameter count in billions a shipped config's name gives (qwen2.5-7b: 7.0), or None."""
    import re

    if name == "phi3-mini-4k":
        return 3.8
    found = re.search(r"-(\d+(?:\.\d+)?)b$", name)
    return float(found.group(1)) if found else None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests._corpus import write_word_corpus

    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words_per_doc=400)


def _cfg(tmp_path, corpus, *extra):
    return load_config("configs/tiny.yaml", BASE + [f"data.paths=[{corpus}]", f"train.out_dir={tmp_path / 'run'}",
                                                    *extra])


def test_the_peak_reported_is_the_runs_own_not_its_parents(tmp_path, corpus):
    # A parent holding 3 GiB starts the run: getrusage's ru_maxrss would carry its 3 GiB over.
    args = [sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml"]
    for s in BASE + [f"data.paths=[{corpus}]", f"train.out_dir={tmp_path / 'run'}", "train.steps=2"]:
        args += ["--set", s]
    parent = textwrap.dedent(f"""
        import json, resource, subprocess, sys
        import numpy as np
        held = np.ones(3 * 2**30, np.uint8)  # written: resident
        inherited = subprocess.run([sys.executable, "-c", "import resource; "
                                    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"],
                                   capture_output=True, text=True).stdout
        done = subprocess.run({args!r}, capture_output=True, text=True, cwd={str(REPO)!r})
        print(json.dumps({{"inherited": int(inherited), "rc": done.returncode, "err": done.stderr[-2000:]}}))
    """)
    out = json.loads(subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True,
                                    timeout=600).stdout.strip().splitlines()[-1])
    assert out["rc"] == 0, out["err"]
    assert out["inherited"] >= 3 * GIB  # what ru_maxrss reports in a child of this parent
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert 0 < summary["peak_rss_bytes"] < 2 * GIB
    assert all(0 < r["peak_rss_bytes"] < 2 * GIB for r in records)


def test_offload_files_go_at_the_end_unless_kept(tmp_path, corpus):
    result = run(_cfg(tmp_path, corpus, "train.steps=2"))
    offload = tmp_path / "run" / "offload"
    assert not offload.exists() and result.offload_files.startswith(f"removed from {offload}")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["offload_files"] == result.offload_files
    kept = run(_cfg(tmp_path / "kept", corpus, "train.steps=2", "offload.keep_files=true"))
    shards = list((tmp_path / "kept" / "run" / "offload").glob("shard-*.bin"))
    assert shards and kept.offload_files.startswith("kept in ")


def test_a_stopped_run_keeps_its_offload_files(tmp_path, corpus):
    done = train(tmp_path / "run", corpus, "offload.overlap=false", signal_at="step_end:1:SIGTERM")
    assert done.returncode == 143, done.stderr[-2000:]
    assert list((tmp_path / "run" / "offload").glob("shard-*.bin"))


def test_checkpoints_come_by_the_clock_too(tmp_path, corpus):
    # every_minutes this small is due at every step boundary; every_steps alone would save 2 and 4.
    run(_cfg(tmp_path, corpus, "train.steps=4", "checkpoint.every_minutes=0.00001", "checkpoint.keep_last=10"))
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == \
        [1, 2, 3, 4]


@pytest.mark.parametrize("overrides, message", [
    (["train.stop_signals=[SIGKILL]"], "train.stop_signals: expected some of SIGINT, SIGTERM, SIGUSR1, SIGHUP"),
    (["checkpoint.every_minutes=-1"], "checkpoint.every_minutes"),
])
def test_schedule_and_stop_settings_are_checked_by_name(tmp_path, corpus, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _cfg(tmp_path, corpus, *overrides)


@pytest.mark.parametrize("path", sorted(p for p in (REPO / "configs").glob("*.yaml")
                                        if re_size(p.stem) is not None and re_size(p.stem) >= 1.0), ids=lambda p: p.stem)
def test_shipped_configs_of_1b_and_more_resume_after_a_kill(path):
    """A kill loses at most 30 minutes (a checkpoint by the clock) or nothing (every step a resume
    point: offload.durable, and then no copy of the state by the clock)."""
    import yaml

    cfg = yaml.safe_load(path.read_text())
    checkpoint = cfg.get("checkpoint") or {}
    if (cfg.get("offload") or {}).get("durable"):
        assert checkpoint.get("every_minutes", 0) == 0
    else:
        assert 0 < checkpoint.get("every_minutes", 0) <= 30
    assert checkpoint.get("keep_last", 0) >= 1
