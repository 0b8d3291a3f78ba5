"""Packing: documents tokenized lazily into fixed-length rows, in a seeded, resumable order.

    stream = BatchStream(cfg.data, tokenizer)          # or BatchStream(cfg.data, tokenizer, state=saved)
    batch = next(stream)                               # int32 [batch_size, seq_len + 1]
    inputs, targets = batch[:, :-1], batch[:, 1:]
    saved = stream.state()                             # small JSON-serialisable dict

The token stream of an epoch is its documents (:mod:`jaxascend.data.documents`) in a seeded
order (:meth:`~jaxascend.data.documents.DocumentIndex.epoch_order`: a permutation, by groups
for table rows), each framed as ``[bos] + tokens + [eos]`` (no bos if the tokenizer has none), cut
into consecutive rows of ``seq_len + 1`` tokens; epochs follow each other without a gap. The
position in that stream (epoch, document, token within the document) is the whole state, so a
restored stream continues with exactly the batches an uninterrupted one would have produced, even
if ``batch_size`` or ``seq_len`` changed in between.
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from jaxascend.config import DataConfig
from jaxascend.data.documents import build_document_index
from jaxascend.data.tokenizers import Tokenizer

_READ_AHEAD_BYTES = 256 << 10  # text tokenized per refill (one batched tokenizer call)
_READ_AHEAD_DOCS = 1024


@dataclass(frozen=True)
class StreamState:
    """Position of a :class:`BatchStream`: the next token is token ``token`` of the framed
    document at position ``document`` of epoch ``epoch``'s order.

    ``seed``, ``num_documents``, ``fingerprint`` and ``vocab_size`` describe the data the
    position refers to and are checked when a stream is restored.
    """

    epoch: int
    document: int
    token: int
    seed: int
    num_documents: int
    fingerprint: str
    vocab_size: int
    version: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "StreamState":
        if not isinstance(data, dict):
            raise ValueError(f"data stream state: expected a dict, got {type(data).__name__}")
        if "format" in data:  # an ExampleStream's state
            raise ValueError(f"data stream state was saved by a data.format: {data['format']} stream; "
                             "this stream is data.format: text")
        return cls(**state_fields(data, (("epoch", int), ("document", int), ("token", int), ("seed", int),
                                         ("num_documents", int), ("fingerprint", str), ("vocab_size", int),
                                         ("version", int))))


def state_fields(data: dict, fields) -> dict:
    """The ``(name, type)`` ``fields`` of a saved stream state, each checked (present; an int
    non-negative, a bool a bool, a str a str; version 1), or a one-line ValueError naming it."""
    kwargs = {}
    for name, kind in fields:
        if name not in data:
            raise ValueError(f"data stream state: missing key {name!r}")
        value = data[name]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)) or (kind is int and value < 0):
            what = "a bool" if kind is bool else "a non-negative int" if kind is int else "a str"
            raise ValueError(f"data stream state: {name!r} must be {what}, got {value!r}")
        kwargs[name] = value
    if kwargs["version"] != 1:
        raise ValueError(f"data stream state: version {kwargs['version']} is not supported (expected 1)")
    return kwargs


class BatchStream:
    """An endless, deterministic, resumable iterator of packed token batches.

    Every ``next(stream)`` returns an int32 array ``[batch_size, seq_len + 1]``; ``state()`` is
    the position after the last batch returned, and ``BatchStream(cfg, tok, state)`` continues
    from it. Epoch ``e`` visits the documents in ``index.epoch_order(seed, e)``: the permutation
    of ``numpy.random.default_rng([seed, e])``, or for table rows the same rng's order by groups.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, state: Optional[dict] = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.index = build_document_index(cfg)
        self.num_documents = len(self.index)
        self._fingerprint = self.index.fingerprint()
        self._prefix = [] if tokenizer.bos_id is None else [int(tokenizer.bos_id)]
        self._suffix = [int(tokenizer.eos_id)]
        self._order_epoch, self._order = -1, np.zeros(0, np.int64)
        # Consumption position (what state() reports) and read-ahead position (next to tokenize).
        self._epoch, self._document, self._token = 0, 0, 0
        if state is not None:
            restored = StreamState.from_dict(state)
            self._check_compatible(restored)
            self._epoch, self._document, self._token = restored.epoch, restored.document, restored.token
        self._read_epoch, self._read_document = self._epoch, self._document
        self._pending: collections.deque[np.ndarray] = collections.deque()  # framed, tokenized docs
        self._lengths: Optional[np.ndarray] = None  # document_lengths(), once asked for
        if self._token:
            self._read_ahead()
            if self._token >= len(self._pending[0]):
                raise ValueError(f"data stream state: token {self._token} is past the end of document "
                                 f"{self._document} of epoch {self._epoch} ({len(self._pending[0])} tokens); "
                                 "the tokenizer or the data changed since the state was saved")

    def _check_compatible(self, s: StreamState) -> None:
        here = (self.cfg.seed, self.num_documents, self._fingerprint, self.tokenizer.vocab_size)
        saved = (s.seed, s.num_documents, s.fingerprint, s.vocab_size)
        if here != saved:
            raise ValueError(
                "data stream state does not match this data: saved for seed={}, {} documents "
                "(fingerprint {}), vocab_size={}; now seed={}, {} documents (fingerprint {}), "
                "vocab_size={}".format(*saved, *here))
        if s.document >= self.num_documents:
            raise ValueError(f"data stream state: document {s.document} is out of range "
                             f"(0..{self.num_documents - 1})")

    @property
    def epoch(self) -> int:
        """The epoch of the next token."""
        return self._epoch

    def state(self) -> dict:
        """The position after the last batch returned, as a small JSON-serialisable dict."""
        return StreamState(epoch=self._epoch, document=self._document, token=self._token,
                           seed=self.cfg.seed, num_documents=self.num_documents,
                           fingerprint=self._fingerprint, vocab_size=self.tokenizer.vocab_size).to_dict()

    def stats(self) -> dict:
        """Documents consumed so far (whole ones, across resumes and epochs), as ExampleStream counts examples."""
        return {"documents_seen": self._epoch * self.num_documents + self._document}

    @property
    def epochs_seen(self) -> float:
        """Epochs consumed so far (across resumes): whole ones plus the fraction of the current
        one's documents consumed whole."""
        return self._epoch + self._document / self.num_documents

    def document_lengths(self) -> np.ndarray:
        """int64 [n]: the tokens of every framed document (bos, its tokens, eos), in index order;
        every document read and tokenized once, then kept."""
        if self._lengths is None:
            framing = len(self._prefix) + len(self._suffix)
            lengths = np.empty(self.num_documents, np.int64)
            lo = 0
            while lo < self.num_documents:  # about _READ_AHEAD_BYTES of text per tokenizer call
                ahead = np.cumsum(self.index.length[lo:lo + _READ_AHEAD_DOCS])
                hi = lo + max(1, int(np.searchsorted(ahead, _READ_AHEAD_BYTES)))
                ids = self.tokenizer.encode_batch([self.index.read(i) for i in range(lo, hi)])
                lengths[lo:hi] = [len(x) + framing for x in ids]
                lo = hi
            self._lengths = lengths
        return self._lengths

    def batches_to_cover(self, items: int) -> int:
        """The batches a stream from the start yields until the first ``items`` documents of its
        order (epoch after epoch, without a gap) are all in them: their tokens over a batch's."""
        lengths = self.document_lengths()
        epochs, rest = divmod(items, self.num_documents)
        tokens = epochs * int(lengths.sum())
        if rest:
            tokens += int(lengths[self.index.epoch_order(self.cfg.seed, epochs)[:rest]].sum())
        return -(-tokens // (self.cfg.batch_size * (self.cfg.seq_len + 1)))

    def _order_of(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = self.index.epoch_order(self.cfg.seed, epoch)
            self._order_epoch = epoch
        return self._order

    def _read_ahead(self) -> None:
        """Reads and tokenizes the next documents (about _READ_AHEAD_BYTES of text) in one call."""
        texts, nbytes = [], 0
        while not texts or (nbytes < _READ_AHEAD_BYTES and len(texts) < _READ_AHEAD_DOCS):
            doc = int(self._order_of(self._read_epoch)[self._read_document])
            texts.append(self.index.read(doc))
            nbytes += int(self.index.length[doc])
            self._read_document += 1
            if self._read_document == self.num_documents:
                self._read_epoch, self._read_document = self._read_epoch + 1, 0
        for ids in self.tokenizer.encode_batch(texts):
            self._pending.append(np.concatenate(
                [np.asarray(self._prefix, np.int32), ids.astype(np.int32, copy=False),
                 np.asarray(self._suffix, np.int32)]))

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> np.ndarray:
        rows, row_len = self.cfg.batch_size, self.cfg.seq_len + 1
        out = np.empty(rows * row_len, np.int32)
        filled = 0
        while filled < len(out):
            if not self._pending:
                self._read_ahead()
            head = self._pending[0]
            take = min(len(out) - filled, len(head) - self._token)
            out[filled:filled + take] = head[self._token:self._token + take]
            filled += take
            self._token += take
            if self._token == len(head):
                self._pending.popleft()
                self._token = 0
                self._document += 1
                if self._document == self.num_documents:
                    self._epoch, self._document = self._epoch + 1, 0
        return out.reshape(rows, row_len)
