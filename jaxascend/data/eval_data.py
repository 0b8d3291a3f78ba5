"""Evaluation batches: one pass over held-out data in file order, as :class:`PackedBatch` es.

    held_out = dataclasses.replace(cfg.data, paths=cfg.eval.paths, batch_size=eval_batch_size)
    for batch in eval_batches(held_out, tokenizer, max_batches=cfg.eval.batches):
        ...                                   # tokens, loss_mask, segment_ids, positions

Every format gives the same batch type. Nothing is shuffled: each document or example is used
exactly once, in discovery order, and the last batch is padded (``loss_mask`` False and
``segment_ids`` 0 where padded). ``max_batches`` stops the pass early.

* ``text``: documents framed ``[bos] + ids + [eos]`` back to back and cut into rows of
  ``seq_len + 1`` tokens as :class:`~jaxascend.data.packing.BatchStream` cuts them (a document
  may continue in the next row); ``segment_ids`` is 1 on real tokens, ``positions`` is
  ``arange(seq_len)``, ``loss_mask`` is True wherever the target is a real token.
* ``prompt_completion`` / ``chat``: examples placed as :class:`~jaxascend.data.example_packing.ExampleStream`
  places them (``data.packing``, ``data.overlong``; dropped examples are skipped).

The data is indexed and checked when ``eval_batches`` is called, so a bad held-out file fails
then, before the first batch is asked for.
"""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np

from jaxascend.config import DataConfig
from jaxascend.data.documents import DocumentIndex, build_document_index
from jaxascend.data.example_packing import BatchBuilder, PackedBatch, fit_to_row
from jaxascend.data.examples import ExampleSource
from jaxascend.data.first_records import resolve_format
from jaxascend.data.tokenizers import Tokenizer

_CHUNK = 256  # documents or examples read and tokenized at a time


def eval_batches(cfg: DataConfig, tokenizer: Tokenizer,
                 max_batches: Optional[int] = None) -> Iterator[PackedBatch]:
    """One pass over ``cfg.paths`` in file order, ``cfg.batch_size`` rows at a time (see the module doc).

    ``cfg`` is the data config with the held-out ``paths`` and the evaluation batch size; at most
    ``max_batches`` batches (None: all of them).
    """
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"eval_batches: max_batches must be at least 1 or None, got {max_batches}")
    cfg = resolve_format(cfg).data  # data.format: auto, if the caller has not resolved it
    if cfg.format == "text":
        batches = _text_batches(cfg, tokenizer, build_document_index(cfg))
    else:
        batches = _example_batches(cfg, tokenizer, ExampleSource(cfg, tokenizer))
    return _take(batches, max_batches)


def _take(batches: Iterator[PackedBatch], limit: Optional[int]) -> Iterator[PackedBatch]:
    for count, batch in enumerate(batches, 1):
        yield batch
        if limit is not None and count >= limit:
            return


def _text_rows(cfg: DataConfig, tokenizer: Tokenizer, index: DocumentIndex) -> Iterator[tuple[np.ndarray, int]]:
    """Rows of ``seq_len + 1`` tokens of the framed documents back to back, with their real length."""
    row_len = cfg.seq_len + 1
    prefix = np.asarray([] if tokenizer.bos_id is None else [tokenizer.bos_id], np.int32)
    suffix = np.asarray([tokenizer.eos_id], np.int32)
    buffer = np.zeros(0, np.int32)
    for start in range(0, len(index), _CHUNK):
        texts = [index.read(i) for i in range(start, min(start + _CHUNK, len(index)))]
        framed = [part for ids in tokenizer.encode_batch(texts)
                  for part in (prefix, ids.astype(np.int32, copy=False), suffix)]
        buffer = np.concatenate([buffer, *framed])
        full = len(buffer) // row_len
        for r in range(full):
            yield buffer[r * row_len:(r + 1) * row_len], row_len
        buffer = buffer[full * row_len:]
    if len(buffer):
        row = np.full(row_len, tokenizer.pad_id, np.int32)
        row[:len(buffer)] = buffer
        yield row, len(buffer)


def _text_batches(cfg: DataConfig, tokenizer: Tokenizer, index: DocumentIndex) -> Iterator[PackedBatch]:
    rows, seq_len = cfg.batch_size, cfg.seq_len
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len))
    tokens = np.full((rows, seq_len + 1), tokenizer.pad_id, np.int32)
    lengths = np.zeros(rows, np.int64)  # real tokens in each row (padding is by position, not by id)
    filled = 0

    def batch() -> PackedBatch:
        t = np.arange(seq_len)
        return PackedBatch(tokens=tokens.copy(), loss_mask=t[None, :] + 1 < lengths[:, None],
                           segment_ids=(t[None, :] < lengths[:, None]).astype(np.int32),
                           positions=positions.copy())

    for row, length in _text_rows(cfg, tokenizer, index):
        tokens[filled], lengths[filled] = row, length
        filled += 1
        if filled == rows:
            yield batch()
            tokens[:], lengths[:], filled = tokenizer.pad_id, 0, 0
    if filled:
        yield batch()


def _example_batches(cfg: DataConfig, tokenizer: Tokenizer, source: ExampleSource) -> Iterator[PackedBatch]:
    def new_builder() -> BatchBuilder:
        return BatchBuilder(cfg.batch_size, cfg.seq_len, tokenizer.pad_id, cfg.packing)

    builder, placed = new_builder(), 0
    for start in range(0, len(source), _CHUNK):
        for example in source.encode(range(start, min(start + _CHUNK, len(source)))):
            example, _ = fit_to_row(example, cfg.seq_len + 1, cfg.overlong)
            if example is None:
                continue
            if not builder.add(example):
                yield builder.finish()
                builder = new_builder()
                builder.add(example)
            placed += 1
    if not placed:
        raise ValueError(f"data.overlong: drop: every one of the {len(source)} held-out examples is longer "
                         f"than a row of data.seq_len + 1 = {cfg.seq_len + 1} tokens")
    if builder.count:
        yield builder.finish()
