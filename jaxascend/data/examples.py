"""Examples: records (prompt/completion pairs or chats), checked, then encoded with a trained mask.

    source = ExampleSource(cfg.data, tokenizer)   # indexes the records and checks every one of them
    [example] = source.encode([0])                 # Example(ids int32 [n], trained bool [n])

A record is a JSONL line's object or a Parquet / Arrow row (a ``datasets`` folder's too), with
the same field names (:mod:`jaxascend.data.fields`).

``data.format: prompt_completion``: each record's ``prompt_field`` and ``completion_field`` are
strings; the ids are ``[bos] + enc(prompt) + enc(completion) + [eos]`` (no bos if the tokenizer has
none) and the trained tokens are the completion's and the eos.

``data.format: chat``: each record's ``messages_field`` is a list of ``{"role", "content"}``
messages (roles system, user, assistant, tool), rendered by the chat template
(:mod:`jaxascend.data.chat_templates`); the trained tokens are the assistant turns'.

With ``data.train_on_prompt`` every token is trained. The structure of every record (JSON, fields,
types, roles) is checked when the source is built, before anything is tokenized or written, and a
malformed one is a one-line ValueError naming the file, the 1-based line (or row) and what is
wrong; a template failure (rendering happens as records are reached) names the record the same
way. Records are indexed by :func:`jaxascend.data.documents.index_documents`, so ``data.paths``,
``data.include`` and ``data.max_documents`` mean what they mean for text.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from jaxascend.config import DataConfig
from jaxascend.data.chat_templates import load_chat_template
from jaxascend.data.documents import index_documents
from jaxascend.data.fields import field_value, record_fields
from jaxascend.data.tokenizers import Tokenizer

EXAMPLE_FORMATS = ("prompt_completion", "chat")


class Example(NamedTuple):
    """One encoded example."""

    ids: np.ndarray  # int32 [n] token ids
    trained: np.ndarray  # bool [n] True where the token is a target the loss counts


class ExampleSource:
    """The examples of ``cfg.paths``: indexed, structurally checked, encoded when asked for.

    Example ``i`` is the ``i``-th record (non-blank JSONL line, or table row) in discovery order
    (files sorted as :func:`~jaxascend.data.discovery.discover_files` sorts them).
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer):
        if cfg.format not in EXAMPLE_FORMATS:
            raise ValueError(f"data.format: ExampleSource reads {' or '.join(EXAMPLE_FORMATS)} records, "
                             f"not {cfg.format!r}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.index = index_documents(cfg)  # refuses text files: they hold no records
        # Built before the records are checked: a missing template is a config error, said first.
        self.template = load_chat_template(cfg, tokenizer) if cfg.format == "chat" else None
        for i, record in self.index.records():
            self._fields(record, i)
        if self.template is not None:
            self.encode([0])  # a template that cannot render the data fails now, naming the record

    def __len__(self) -> int:
        return len(self.index)

    def fingerprint(self) -> str:
        """A short hash of the record sizes, to notice data that changed under a saved state."""
        return self.index.fingerprint()

    def location(self, i: int) -> str:
        """``"<file>: line <n>"`` (or ``row <n>``) of example ``i``."""
        return self.index.where(i)

    def _fields(self, record: dict, i: int) -> tuple[str, str] | list[dict]:
        """The validated fields of record ``i``: ``(prompt, completion)`` or the messages list."""
        values = tuple(field_value(record, self.location(i), f, self.cfg) for f in record_fields(self.cfg))
        return values if self.cfg.format == "prompt_completion" else values[0]

    def encode(self, indices: Sequence[int]) -> list[Example]:
        """The examples at ``indices`` (in that order), read from disk and tokenized."""
        records = [self._fields(self.index.record(int(i)), int(i)) for i in indices]
        if self.template is None:
            return self._encode_prompt_completion(records)
        out = []
        for i, messages in zip(indices, records):
            try:
                ids, trained = self.template.encode(messages, train_on_prompt=self.cfg.train_on_prompt)
            except ValueError as err:
                raise ValueError(f"{self.location(int(i))}: {err}") from None
            out.append(Example(ids, trained))
        return out

    def _encode_prompt_completion(self, records: list[tuple[str, str]]) -> list[Example]:
        tok = self.tokenizer
        encoded = tok.encode_batch([p for p, _ in records] + [c for _, c in records])
        prefix = [] if tok.bos_id is None else [int(tok.bos_id)]
        out = []
        for prompt, completion in zip(encoded[:len(records)], encoded[len(records):]):
            ids = np.concatenate([np.asarray(prefix, np.int32), prompt.astype(np.int32, copy=False),
                                  completion.astype(np.int32, copy=False),
                                  np.asarray([tok.eos_id], np.int32)])
            trained = np.zeros(len(ids), bool)
            trained[0 if self.cfg.train_on_prompt else len(prefix) + len(prompt):] = True
            out.append(Example(ids, trained))
        return out
