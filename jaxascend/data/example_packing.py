"""Example packing: encoded examples placed into rows, in a seeded, resumable order.

    stream = make_batch_stream(cfg.data, tokenizer)       # ExampleStream unless data.format: text
    batch = next(stream)                                   # PackedBatch of numpy arrays
    inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]
    saved = stream.state()                                 # small JSON-serialisable dict
    stream.stats()                                         # examples seen, truncated, dropped

A :class:`PackedBatch` (B = ``batch_size``, T = ``seq_len``)::

    tokens:      int32 [B, T+1]  token ids (pad_id where padded)
    loss_mask:   bool  [B, T]    True iff the target tokens[b, t+1] counts in the loss
    segment_ids: int32 [B, T]    for the inputs tokens[:, :-1]: 1, 2, ... per example in the row, 0 = padding
    positions:   int32 [B, T]    position of input token t within its example (0 at its first token)

``loss_mask[b, t]`` is True only if token t+1 is a trained token of the same example as token t:
never across an example boundary, never into padding. With ``data.packing: true`` the examples are
placed greedily in order; one that does not fit the rest of a row starts the next row (an example
is never split), the rest of the row is padding. With ``packing: false`` each example has a row of
its own. An example longer than a row (T+1 tokens) is cut to its first T+1 tokens
(``data.overlong: truncate``) or skipped (``drop``).

Epoch ``e`` visits the examples in ``numpy.random.default_rng([seed, e])``'s permutation (table
rows: in that rng's order by groups, :meth:`~jaxascend.data.documents.DocumentIndex.epoch_order`). Every
batch starts at an example, so the state is the position of the next example (epoch, index in
that epoch's order) plus the counters; a restored stream yields exactly the batches an
uninterrupted one would have, also with another ``batch_size`` or ``seq_len`` from there on.
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional, Union

import numpy as np

from jaxascend.config import DataConfig
from jaxascend.data.examples import Example, ExampleSource
from jaxascend.data.first_records import resolve_format
from jaxascend.data.packing import BatchStream, state_fields
from jaxascend.data.tokenizers import Tokenizer

_READ_AHEAD_EXAMPLES = 256  # examples read and encoded per refill


class PackedBatch(NamedTuple):
    """One batch of examples (or documents) in rows; see the module docstring."""

    tokens: np.ndarray  # int32 [B, T+1] token ids, pad_id where padded
    loss_mask: np.ndarray  # bool [B, T] the target tokens[:, t+1] counts in the loss
    segment_ids: np.ndarray  # int32 [B, T] example number of input t within its row (1, 2, ...), 0 = padding
    positions: np.ndarray  # int32 [B, T] position of input t within its example


def fit_to_row(example: Example, row_len: int, overlong: str) -> tuple[Optional[Example], bool]:
    """``example`` as it goes into a row of ``row_len`` tokens and whether it was cut: truncated to
    ``row_len`` tokens (``overlong == "truncate"``) or None (``"drop"``) when longer."""
    if len(example.ids) <= row_len:
        return example, False
    if overlong == "drop":
        return None, False
    return Example(example.ids[:row_len], example.trained[:row_len]), True


class RowCursor:
    """Where the next example goes among the rows of one batch: the packing rule alone, shared by
    :class:`BatchBuilder` (which writes the example there) and the epoch count (which only counts)."""

    def __init__(self, rows: int, row_len: int, packing: bool):
        self.rows, self.row_len, self.packing = rows, row_len, packing
        self.row, self.col = 0, 0

    def place(self, n: int) -> Optional[tuple[int, int]]:
        """(row, column) of an example of ``n`` tokens (at most a row): the current row or, if it
        does not fit there (or ``packing`` is off), the next one; None when no row is left for it."""
        if self.col > 0 and (not self.packing or self.col + n > self.row_len):
            self.row, self.col = self.row + 1, 0
        if self.row == self.rows:
            return None
        at = (self.row, self.col)
        self.col += n
        return at


class BatchBuilder:
    """Places examples (each at most a row long) into the rows of one batch, then makes the batch."""

    def __init__(self, rows: int, seq_len: int, pad_id: int, packing: bool):
        self.row_len = seq_len + 1
        self.cursor = RowCursor(rows, self.row_len, packing)
        self.tokens = np.full((rows, self.row_len), pad_id, np.int32)
        self.segments = np.zeros((rows, self.row_len), np.int32)  # 0 = padding
        self.positions = np.zeros((rows, self.row_len), np.int32)
        self.trained = np.zeros((rows, self.row_len), bool)
        self.count = 0

    def add(self, example: Example) -> bool:
        """Places ``example`` in the current row or, if it does not fit there, the next one;
        False (nothing placed) when no row is left for it."""
        n = len(example.ids)
        if n > self.row_len:
            raise ValueError(f"BatchBuilder.add: an example of {n} tokens does not fit a row of {self.row_len}")
        at = self.cursor.place(n)
        if at is None:
            return False
        r, c = at
        self.tokens[r, c:c + n] = example.ids
        self.segments[r, c:c + n] = self.segments[r, c - 1] + 1 if c else 1
        self.positions[r, c:c + n] = np.arange(n, dtype=np.int32)
        self.trained[r, c:c + n] = example.trained
        self.count += 1
        return True

    def finish(self) -> PackedBatch:
        """The batch as placed so far (unused rows and row ends are padding)."""
        seg = self.segments
        same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
        return PackedBatch(tokens=self.tokens, loss_mask=self.trained[:, 1:] & same,
                           segment_ids=seg[:, :-1].copy(), positions=self.positions[:, :-1].copy())


# ----------------------------------------------------------------------------- the resumable stream

_STATE_FIELDS = (("epoch", int), ("example", int), ("seen", int), ("truncated", int), ("dropped", int),
                 ("seed", int), ("num_examples", int), ("fingerprint", str), ("vocab_size", int),
                 ("format", str), ("packing", bool), ("overlong", str), ("version", int))


@dataclass(frozen=True)
class ExampleStreamState:
    """Position of an :class:`ExampleStream`: the next example is the one at position ``example``
    of epoch ``epoch``'s order; ``seen`` / ``truncated`` / ``dropped`` count examples so far.

    The other fields describe the data and settings the position refers to; they are checked when
    a stream is restored.
    """

    epoch: int
    example: int
    seen: int
    truncated: int
    dropped: int
    seed: int
    num_examples: int
    fingerprint: str
    vocab_size: int
    format: str
    packing: bool
    overlong: str
    version: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, expected_format: str) -> "ExampleStreamState":
        if not isinstance(data, dict):
            raise ValueError(f"data stream state: expected a dict, got {type(data).__name__}")
        if "format" not in data and "document" in data:
            raise ValueError("data stream state was saved by a data.format: text stream; this stream is "
                             f"data.format: {expected_format}")
        return cls(**state_fields(data, _STATE_FIELDS))


class ExampleStream:
    """An endless, deterministic, resumable iterator of :class:`PackedBatch` es of examples.

    ``ExampleStream(cfg, tokenizer, state)`` continues from ``state()`` of an earlier stream; the
    examples are checked when it is built (see :class:`~jaxascend.data.examples.ExampleSource`).
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, state: Optional[dict] = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.source = ExampleSource(cfg, tokenizer)
        self.num_examples = len(self.source)
        self._fingerprint = self.source.fingerprint()
        self._order_epoch, self._order = -1, np.zeros(0, np.int64)
        self._epoch, self._example = 0, 0  # the next example to place (what state() reports)
        self._counts = {"seen": 0, "truncated": 0, "dropped": 0}
        if state is not None:
            restored = ExampleStreamState.from_dict(state, cfg.format)
            self._check_compatible(restored)
            self._epoch, self._example = restored.epoch, restored.example
            self._counts = {k: getattr(restored, k) for k in self._counts}
        self._read_epoch, self._read_example = self._epoch, self._example
        self._pending: collections.deque[Example] = collections.deque()  # encoded, from the next one on
        self._lengths: Optional[np.ndarray] = None  # example_lengths(), once asked for

    def _settings(self) -> dict:
        return {"seed": self.cfg.seed, "num_examples": self.num_examples, "fingerprint": self._fingerprint,
                "vocab_size": self.tokenizer.vocab_size, "format": self.cfg.format,
                "packing": self.cfg.packing, "overlong": self.cfg.overlong}

    def _check_compatible(self, s: ExampleStreamState) -> None:
        differ = [f"{k} {getattr(s, k)!r} (now {v!r})" for k, v in self._settings().items() if getattr(s, k) != v]
        if differ:
            raise ValueError(f"data stream state does not match this data: saved for {', '.join(differ)}")
        if s.example >= self.num_examples:
            raise ValueError(f"data stream state: example {s.example} is out of range (0..{self.num_examples - 1})")

    @property
    def epoch(self) -> int:
        """The epoch of the next example."""
        return self._epoch

    def state(self) -> dict:
        """The position after the last batch returned, as a small JSON-serialisable dict."""
        return ExampleStreamState(epoch=self._epoch, example=self._example, **self._counts,
                                  **self._settings()).to_dict()

    def stats(self) -> dict:
        """Examples consumed so far (across resumes): seen (placed or dropped), truncated, dropped."""
        return {f"examples_{k}": v for k, v in self._counts.items()}

    @property
    def epochs_seen(self) -> float:
        """Epochs consumed so far (across resumes): whole ones plus the fraction of the examples
        of the current one placed or dropped."""
        return self._epoch + self._example / self.num_examples

    def example_lengths(self) -> np.ndarray:
        """int64 [n]: the tokens of every example as encoded (before fitting a row), in index
        order; every example read and encoded once, then kept."""
        if self._lengths is None:
            lengths = np.empty(self.num_examples, np.int64)
            for lo in range(0, self.num_examples, 4 * _READ_AHEAD_EXAMPLES):
                hi = min(lo + 4 * _READ_AHEAD_EXAMPLES, self.num_examples)
                lengths[lo:hi] = [len(e.ids) for e in self.source.encode(range(lo, hi))]
            self._lengths = lengths
        return self._lengths

    def batches_to_cover(self, items: int) -> int:
        """The batches a stream from the start yields until the first ``items`` examples of its
        order (epoch after epoch) are all in them, placed or dropped: ``__next__``'s rule
        (:func:`fit_to_row`, :class:`RowCursor`) run on the examples' lengths alone."""
        cfg, row_len = self.cfg, self.cfg.seq_len + 1
        lengths = self.example_lengths()
        fitted = np.where(lengths <= row_len, lengths, row_len if cfg.overlong == "truncate" else 0)
        if not fitted.any():
            raise self._all_too_long()
        batches, cursor = 0, None
        for epoch in range(-(-items // self.num_examples)):
            take = min(self.num_examples, items - epoch * self.num_examples)
            for n in fitted[self.source.index.epoch_order(cfg.seed, epoch)[:take]].tolist():
                if n and (cursor is None or cursor.place(n) is None):  # 0: dropped, in the batch being built
                    batches, cursor = batches + 1, RowCursor(cfg.batch_size, row_len, cfg.packing)
                    cursor.place(n)
        return max(batches, 1)  # items all dropped: the first batch consumes them

    def _all_too_long(self) -> ValueError:
        return ValueError(f"data.overlong: drop: every one of the {self.num_examples} examples is longer than a row "
                          f"of data.seq_len + 1 = {self.cfg.seq_len + 1} tokens; raise data.seq_len or set "
                          "data.overlong: truncate")

    def _order_of(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = self.source.index.epoch_order(self.cfg.seed, epoch)
            self._order_epoch = epoch
        return self._order

    def _peek(self) -> Example:
        if not self._pending:
            indices = []
            for _ in range(min(_READ_AHEAD_EXAMPLES, self.num_examples)):
                indices.append(int(self._order_of(self._read_epoch)[self._read_example]))
                self._read_example += 1
                if self._read_example == self.num_examples:
                    self._read_epoch, self._read_example = self._read_epoch + 1, 0
            self._pending.extend(self.source.encode(indices))
        return self._pending[0]

    def _consume(self, outcome: str) -> None:
        self._pending.popleft()
        self._counts["seen"] += 1
        if outcome:
            self._counts[outcome] += 1
        self._example += 1
        if self._example == self.num_examples:
            self._epoch, self._example = self._epoch + 1, 0

    def __iter__(self) -> "ExampleStream":
        return self

    def __next__(self) -> PackedBatch:
        cfg = self.cfg
        builder = BatchBuilder(cfg.batch_size, cfg.seq_len, self.tokenizer.pad_id, cfg.packing)
        dropped_in_a_row = 0
        while True:
            example, truncated = fit_to_row(self._peek(), cfg.seq_len + 1, cfg.overlong)
            if example is None:
                self._consume("dropped")
                dropped_in_a_row += 1
                # 2N drops in a row span a whole epoch: every example is too long.
                if dropped_in_a_row >= 2 * self.num_examples:
                    raise self._all_too_long()
                continue
            if not builder.add(example):
                return builder.finish()
            self._consume("truncated" if truncated else "")
            dropped_in_a_row = 0


def make_batch_stream(cfg: DataConfig, tokenizer: Tokenizer,
                      state: Optional[dict] = None) -> Union[BatchStream, ExampleStream]:
    """The training stream ``cfg.format`` asks for: :class:`~jaxascend.data.packing.BatchStream`
    for ``text`` (int32 ``[B, T+1]`` arrays), :class:`ExampleStream` (:class:`PackedBatch`) otherwise.

    Both have ``state()``, ``stats()`` and ``epoch``, and take a saved ``state`` to continue from.
    ``data.format: auto`` is resolved from the data's first records if the caller has not.
    """
    cfg = resolve_format(cfg).data
    if cfg.format == "text":
        return BatchStream(cfg, tokenizer, state=state)
    return ExampleStream(cfg, tokenizer, state=state)
