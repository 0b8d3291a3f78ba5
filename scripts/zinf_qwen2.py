"""The DeepSpeed ZeRO-Infinity peer (``shared/peers/zero_infinity/zinf_train.py``) on a Qwen2 model
with gradient checkpointing: run with the peer venv's Python and zinf_train.py's own flags.

    /tmp/peer/venv/bin/python scripts/zinf_qwen2.py --layers 2 --hidden 896 --intermediate 4864 \\
        --vocab 151936 --heads 14 --kv-heads 2 --seq 4096 --steps 2 --nvme-dir /tmp/zinf/nvme

zinf_train.py builds ``transformers.LlamaForCausalLM(LlamaConfig(..., tie_word_embeddings=False))``
with ``sdpa`` attention and no gradient checkpointing. Here, before it runs, those two names are
swapped for Qwen2's: ``Qwen2Config`` with tied embeddings (as Qwen2.5-0.5B) and
``Qwen2ForCausalLM`` (q/k/v bias), with transformers' gradient checkpointing of every decoder
layer (non-reentrant), the counterpart of jaxascend's ``model.remat: full``. The peer's file is
other teams' too, so it is run unchanged (``runpy``) rather than edited.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

ZINF = Path(__file__).resolve().parents[2] / "shared" / "peers" / "zero_infinity" / "zinf_train.py"
ZINF = Path(os.environ.get("ZINF_TRAIN", ZINF))

# Set before transformers imports DeepSpeed's integration (zinf_train.py sets them too, later).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/peer/torch_ext")

import transformers  # noqa: E402  (after the environment above)


def qwen2_config(**fields) -> transformers.Qwen2Config:
    """zinf_train.py's LlamaConfig fields as a Qwen2Config with tied embeddings."""
    return transformers.Qwen2Config(**{**fields, "tie_word_embeddings": True})


class CheckpointedQwen2(transformers.Qwen2ForCausalLM):
    """Qwen2ForCausalLM recomputing each decoder layer's forward in the backward."""

    def __init__(self, config):
        super().__init__(config)
        self.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def main() -> None:
    transformers.LlamaConfig = qwen2_config
    transformers.LlamaForCausalLM = CheckpointedQwen2
    sys.argv[0] = str(ZINF)
    runpy.run_path(str(ZINF), run_name="__main__")


if __name__ == "__main__":
    main()
