"""Data: documents and instruction examples on disk, tokenizers, and packed, resumable batches.

    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.path)
    stream = make_batch_stream(cfg.data, tokenizer)   # per next(): int32 [B, T+1] (text) or a PackedBatch

* :func:`~jaxascend.data.discovery.discover_files` / :func:`~jaxascend.data.documents.build_document_index` -- documents of UTF-8
  text, ``.jsonl``, Parquet and Arrow files, ``datasets`` folders and directories (``@stdlib``:
  Python's standard library), indexed, read lazily (table files a group of rows at a time);
* :class:`ByteTokenizer` / :class:`HFTokenizer` / :func:`load_tokenizer` -- byte-level or a
  local Hugging Face tokenizer; :func:`has_tokenizer_files` / :func:`missing_paths` -- whether
  a tokenizer and the data are there at all (the planner can plan without them);
* :class:`BatchStream` -- documents (``data.format: text``) packed into fixed-length rows in a
  seeded order, with a small JSON position to resume from;
* :class:`~jaxascend.data.examples.ExampleSource` -- records (``prompt_completion`` or ``chat``; JSONL
  lines or table rows), every one checked,
  encoded to ids and a trained mask; :class:`~jaxascend.data.chat_templates.ChatTemplate` / :func:`load_chat_template` render chats;
* :class:`~jaxascend.data.example_packing.ExampleStream` -- examples packed into rows (:class:`~jaxascend.data.example_packing.PackedBatch`: tokens, loss_mask,
  segment_ids, positions), seeded and resumable; :func:`make_batch_stream` picks the stream;
* :func:`~jaxascend.data.epochs.with_epoch_steps` -- ``train.epochs`` counted into ``train.steps``
  (:class:`~jaxascend.data.epochs.EpochCount`: the batches until every document or example of
  the epochs was in one, over ``train.grad_accum``);
* :func:`eval_batches` -- one pass over held-out data in file order, for every format;
* :func:`~jaxascend.data.first_records.read_data_format` -- ``data.format: auto`` resolved from the
  first record of each file, and those records checked, with no tokenizer (the planner too);
* :func:`~jaxascend.data.chat_templates.chat_prompt_ids` / :func:`~jaxascend.data.chat_templates.chat_stop_ids` -- a conversation's prompt for generation, and
  the ids that end the assistant's turn.

Imports only :mod:`jaxascend.config`.
"""

from jaxascend.data.chat_templates import load_chat_template
from jaxascend.data.discovery import missing_paths
from jaxascend.data.epochs import EpochCount, with_epoch_steps
from jaxascend.data.eval_data import eval_batches
from jaxascend.data.example_packing import make_batch_stream
from jaxascend.data.first_records import read_data_format
from jaxascend.data.packing import BatchStream
from jaxascend.data.tokenizers import (ByteTokenizer, HFTokenizer, Tokenizer, has_tokenizer_files, load_tokenizer,
                                       tokenizer_folder, write_hf_tokenizer)

__all__ = [
    "BatchStream", "ByteTokenizer", "EpochCount", "HFTokenizer", "Tokenizer", "eval_batches",
    "has_tokenizer_files", "load_chat_template", "load_tokenizer", "make_batch_stream", "missing_paths",
    "read_data_format", "tokenizer_folder", "with_epoch_steps", "write_hf_tokenizer",
]
