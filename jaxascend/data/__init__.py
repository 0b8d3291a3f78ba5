"""Text data: documents on disk, tokenizers, and packed, resumable batches.

    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.path)
    stream = BatchStream(cfg.data, tokenizer)        # int32 [batch_size, seq_len + 1] per next()

* :func:`discover_files` / :func:`build_document_index` -- documents of ``.txt`` / ``.jsonl``
  files and directories (``@stdlib``: Python's standard library), indexed, read lazily;
* :class:`ByteTokenizer` / :class:`HFTokenizer` / :func:`load_tokenizer` -- byte-level or a
  local Hugging Face tokenizer;
* :class:`BatchStream` -- documents packed into fixed-length rows in a seeded order, with a
  small JSON position to resume from.

Imports only :mod:`jaxascend.config`.
"""

from jaxascend.data.documents import STDLIB, DocumentIndex, build_document_index, discover_files
from jaxascend.data.packing import BatchStream, StreamState
from jaxascend.data.tokenizers import (ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer,
                                       resolve_tokenizer_spec, tokenizer_folder, write_hf_tokenizer)

__all__ = [
    "STDLIB", "BatchStream", "ByteTokenizer", "DocumentIndex", "HFTokenizer", "StreamState", "Tokenizer",
    "build_document_index", "discover_files", "load_tokenizer", "resolve_tokenizer_spec", "tokenizer_folder",
    "write_hf_tokenizer",
]
