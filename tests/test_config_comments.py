"""The shipped model configs' comments tell the truth: their memory and disk figures are the
planner's (scripts/config_comments.py writes them, this test re-plans and compares), no other
comment states a size, each checkpoints by the clock, and none pins a data format (chat data
reads as shipped, through data.format: auto)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("config_comments", REPO / "scripts" / "config_comments.py")
config_comments = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(config_comments)

SIZE = re.compile(r"\d+(?:\.\d+)?\s?(?:[KMGT]i?B|B/param)\b")


def test_every_model_config_is_listed():
    shipped = {p.name for p in (REPO / "configs").glob("*.yaml") if "path:" in p.read_text()}
    assert shipped == set(config_comments.CONFIG_MODELS)


def test_the_plan_blocks_are_the_planners():
    stale = config_comments.stale_configs()
    assert not stale, f"run python scripts/config_comments.py: stale plan block in {stale}"


@pytest.mark.parametrize("name", sorted(config_comments.CONFIG_MODELS))
def test_no_size_outside_the_plan_block(name):
    rows = (REPO / "configs" / name).read_text().splitlines()
    start, end = rows.index(config_comments.BEGIN), rows.index(config_comments.END)
    outside = [row.split("#", 1)[1] for i, row in enumerate(rows) if "#" in row and not start <= i <= end]
    sized = [comment for comment in outside if SIZE.search(comment)]
    assert not sized, f"configs/{name}: a comment states a size the plan does not check: {sized}"


@pytest.mark.parametrize("name", sorted(config_comments.CONFIG_MODELS))
def test_resumes_after_a_kill_and_reads_any_format(name):
    """Every step is a resume point (offload.durable; the 1B+ configs), or a checkpoint is saved by the clock."""
    cfg = yaml.safe_load((REPO / "configs" / name).read_text())
    durable = cfg.get("offload", {}).get("durable", False)
    assert durable or cfg.get("checkpoint", {}).get("every_minutes", 0) > 0, \
        f"configs/{name}: neither offload.durable nor checkpoint.every_minutes"
    assert "format" not in cfg["data"], f"configs/{name}: data.format is set; auto reads chat data as shipped"


def test_a_stale_block_is_found(tmp_path):
    text = (REPO / "configs" / "qwen2.5-0.5b.yaml").read_text()
    lines = config_comments.block(REPO / "configs" / "qwen2.5-0.5b.yaml")
    assert config_comments.with_block(text, lines) == text
    changed = text.replace("batch_size: 8", "batch_size: 16")
    path = tmp_path / "qwen2.5-0.5b.yaml"
    path.write_text(changed)
    assert config_comments.with_block(changed, config_comments.block(path)) != changed
