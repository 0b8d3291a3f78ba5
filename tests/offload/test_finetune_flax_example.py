"""scripts/finetune_flax_example.py has a pulse with both optimizers, and they agree."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "finetune_flax_example.py"
SMALL = ["--steps", "6", "--log-every", "3", "--batch", "16", "--d-in", "8", "--hidden", "16", "--d-out", "4"]


def _run(optimizer, tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--optimizer", optimizer,
                           "--offload-dir", str(tmp_path / "offload"), *SMALL],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in lines[:-1]] == [3, 6]
    return lines[-1]


def test_ssd_adamw_trains_like_optax_adamw(tmp_path):
    ours, theirs = _run("ssd", tmp_path), _run("optax", tmp_path)
    assert ours["optimizer"] == "ssd" and len(ours["losses"]) == 6
    assert ours["last_loss"] < ours["first_loss"]
    # Same model, data and hyperparameters: the SSD state only moves where the numbers live.
    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-5)
    assert any((tmp_path / "offload").glob("shard-*.bin"))
