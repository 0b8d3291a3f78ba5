"""Writes (or checks) the plan block of each shipped model config: the memory and disk figures in
its comments come from the planner, never from hand arithmetic.

    python scripts/config_comments.py            # rewrite the block in every model config
    python scripts/config_comments.py --check    # exit 1 naming each config whose block is stale

Each config in :data:`CONFIG_MODELS` is planned the way ``python -m jaxascend.plan`` plans it from
the model's published ``config.json`` alone (jaxascend.hf.presets holds their architecture
fields), with the settings as shipped, on a fixed machine (:data:`MACHINE_RAM` available, the
runtime part :data:`RUNTIME_BYTES`), so the figures do not depend on where this runs. The block
sits between :data:`BEGIN` and :data:`END`; ``tests/test_config_comments.py`` checks that it is
current and that no other comment of a model config states a size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MACHINE_RAM = "32 GiB"  # what the plan assumes the machine gives the run (the README's user: 32-128 GB)
MEM_AVAILABLE_ENV = "JAXASCEND_MEM_AVAILABLE_BYTES"  # the planner's stand-in for the machine's MemAvailable
RUNTIME_BYTES = 600 * 2**20  # the runtime part (JAX, the compiled step, tokenizer, data index), estimated
BEGIN = "# --- the plan (scripts/config_comments.py writes this block from the planner; a test checks it) ---"
END = "# --- end of the plan ---"

# config file -> the preset (jaxascend.hf.presets) holding the published config.json's architecture
CONFIG_MODELS = {
    "gemma3-1b.yaml": ("gemma3", "1B"), "gemma3-4b.yaml": ("gemma3", "4B"), "gpt2.yaml": ("gpt2", "124M"),
    "llama3.1-8b.yaml": ("llama", "8B"), "llama3.2-1b.yaml": ("llama", "1B"), "llama3.2-3b.yaml": ("llama", "3B"),
    "phi3-mini-4k.yaml": ("phi3", "mini-4k"), "qwen2.5-0.5b.yaml": ("qwen2", "0.5B"),
    "qwen2.5-1.5b.yaml": ("qwen2", "1.5B"), "qwen2.5-3b.yaml": ("qwen2", "3B"), "qwen2.5-7b.yaml": ("qwen2", "7B"),
    "qwen3-0.6b.yaml": ("qwen3", "0.6B"), "qwen3-1.7b.yaml": ("qwen3", "1.7B"), "qwen3-4b.yaml": ("qwen3", "4B"),
    "qwen3-8b.yaml": ("qwen3", "8B"),
}


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _parts(parts: dict) -> str:
    """The largest parts first, those of 0.05 GiB and more."""
    big = sorted(((nbytes, name) for name, nbytes in parts.items() if nbytes >= 0.05 * 2**30), reverse=True)
    return ", ".join(f"{name} {_gib(nbytes)}" for nbytes, name in big)


def plan_of(config: Path, arch: str, size: str, extra: tuple = ()):
    """The plan of ``config`` as shipped (with ``extra`` settings on top), for the preset's
    ``config.json`` (in a temporary folder)."""
    from jaxascend.config import load_config
    from jaxascend.hf import model_config_from_hf, preset_config
    from jaxascend.planning import plan_run

    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(preset_config(arch, size)))
        cfg = load_config(config, [f"model.path={folder}", *extra], inputs=False)
        model_cfg = model_config_from_hf(folder, base=cfg.model)
    saved = os.environ.get(MEM_AVAILABLE_ENV)
    os.environ[MEM_AVAILABLE_ENV] = MACHINE_RAM
    try:
        return cfg, plan_run(cfg, model_cfg, runtime_bytes=RUNTIME_BYTES, levers=False)
    finally:
        if saved is None:
            del os.environ[MEM_AVAILABLE_ENV]
        else:
            os.environ[MEM_AVAILABLE_ENV] = saved


def block(config: Path) -> list[str]:
    """The plan block's lines for ``config``."""
    arch, size = CONFIG_MODELS[config.name]
    cfg, plan = plan_of(config, arch, size)
    n = plan.num_params
    disk = {part.name: part.nbytes for fs in plan.disk for part in fs.parts}
    weights = {"ssd": "the layer stack's weights stream from SSD (offload.params: ssd)",
               "resident": "the weights resident"}[plan.params]
    chosen = " (offload.params: auto's choice)" if cfg.offload.params == "auto" else ""
    step = plan.ssd_read_step + plan.ssd_write_step
    lines = [BEGIN,
             f"# As `python -m jaxascend.plan` plans it from the published config.json, with the settings below,",
             f"# on a machine giving the run {MACHINE_RAM} of RAM (runtime part estimated):",
             f"#   {n:,} parameters; {weights}{chosen}",
             f"#   RAM at the peak, on the CPU backend: {_gib(plan.host_peak)} ({_parts(plan.host)})",
             f"#   the device's part (a GPU's memory): {_gib(sum(plan.device.values()))} ({_parts(plan.device)})",
             f"#   disk: {_gib(sum(fs.need for fs in plan.disk))} in all: {_parts(disk)}" + _shared(plan),
             f"#   SSD per step: read {_gib(plan.ssd_read_step)}, write {_gib(plan.ssd_write_step)} "
             f"({step / max(n, 1):.1f} B/param): at least {plan.step_floor_seconds:.1f} s a step at "
             f"{plan.disk_gbps:g} GB/s",
             END]
    return lines


def with_block(text: str, lines: list[str]) -> str:
    """``text`` with its plan block replaced by ``lines`` (inserted before the first key if none)."""
    rows = text.splitlines()
    if BEGIN in rows:
        start, end = rows.index(BEGIN), rows.index(END)
        rows[start:end + 1] = lines
    else:
        first_key = next(i for i, row in enumerate(rows) if re.match(r"^[a-z_]+:", row))
        rows[first_key:first_key] = lines
    return "\n".join(rows) + "\n"


def stale_configs() -> list[str]:
    """The model configs whose plan block is missing or differs from the plan's."""
    stale = []
    for name in sorted(CONFIG_MODELS):
        path = REPO / "configs" / name
        text = path.read_text()
        if with_block(text, block(path)) != text:
            stale.append(name)
    return stale


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 naming each config whose block is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_configs()
        for name in stale:
            print(f"stale: configs/{name}: run python scripts/config_comments.py")
        return 1 if stale else 0
    for name in sorted(CONFIG_MODELS):
        path = REPO / "configs" / name
        path.write_text(with_block(path.read_text(), block(path)))
        print(f"wrote configs/{name}")
    return 0


def _shared(plan) -> str:
    """What the end-of-run outputs reuse of the gradients' space (the high-water mark is less than the sum)."""
    shared = sum(fs.shared_at_end for fs in plan.disk)
    return f" (the export reuses the gradients' {_gib(shared)}, freed at the end)" if shared else ""


if __name__ == "__main__":
    sys.exit(main())

