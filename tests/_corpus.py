"""Small deterministic text corpora for the trainer tests (shared by several test files)."""

from pathlib import Path

import numpy as np

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


def write_word_corpus(directory: Path, docs: int, words_per_doc: int) -> Path:
    """Writes ``docs`` files ``doc<i>.txt`` of seeded random words into ``directory`` and returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(docs):
        (directory / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS, size=words_per_doc)) + "\n")
    return directory
