"""Examples: JSONL records (prompt/completion pairs or chats), checked, then encoded with a trained mask.

    source = ExampleSource(cfg.data, tokenizer)   # indexes the records and checks every one of them
    [example] = source.encode([0])                 # Example(ids int32 [n], trained bool [n])

``data.format: prompt_completion``: each record's ``prompt_field`` and ``completion_field`` are
strings; the ids are ``[bos] + enc(prompt) + enc(completion) + [eos]`` (no bos if the tokenizer has
none) and the trained tokens are the completion's and the eos.

``data.format: chat``: each record's ``messages_field`` is a list of ``{"role", "content"}``
messages (roles system, user, assistant, tool), rendered by the chat template
(:mod:`jaxascend.data.chat_templates`); the trained tokens are the assistant turns'.

With ``data.train_on_prompt`` every token is trained. The structure of every record (JSON, fields,
types, roles) is checked when the source is built, before anything is tokenized or written, and a
malformed one is a one-line ValueError naming the file, the 1-based line and what is wrong; a
template failure (rendering happens as records are reached) names the record the same way.
Records are indexed by :func:`jaxascend.data.documents.index_documents`, so ``data.paths``,
``data.include`` and ``data.max_documents`` mean what they mean for text.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from jaxascend.config import DataConfig
from jaxascend.data.chat_templates import check_messages, load_chat_template
from jaxascend.data.documents import index_documents, jsonl_field, load_jsonl_object
from jaxascend.data.tokenizers import Tokenizer

EXAMPLE_FORMATS = ("prompt_completion", "chat")


class Example(NamedTuple):
    """One encoded example."""

    ids: np.ndarray  # int32 [n] token ids
    trained: np.ndarray  # bool [n] True where the token is a target the loss counts


class ExampleSource:
    """The examples of ``cfg.paths``: indexed, structurally checked, encoded when asked for.

    Example ``i`` is the ``i``-th non-blank JSONL line in discovery order (files sorted as
    :func:`~jaxascend.data.documents.discover_files` sorts them).
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer):
        if cfg.format not in EXAMPLE_FORMATS:
            raise ValueError(f"data.format: ExampleSource reads {' or '.join(EXAMPLE_FORMATS)} records, "
                             f"not {cfg.format!r}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.index = index_documents(cfg)
        plain = np.flatnonzero(self.index.line == 0)
        if len(plain):
            path = self.index.files[self.index.file[plain[0]]]
            raise ValueError(f"data.format: {cfg.format} reads JSONL records (one per line); {path} is "
                             "not a .jsonl file")
        # Built before the records are checked: a missing template is a config error, said first.
        self.template = load_chat_template(cfg, tokenizer) if cfg.format == "chat" else None
        self._check_every_record()
        if self.template is not None:
            self.encode([0])  # a template that cannot render the data fails now, naming the record

    def __len__(self) -> int:
        return len(self.index)

    def fingerprint(self) -> str:
        """A short hash of the record sizes, to notice data that changed under a saved state."""
        return self.index.fingerprint()

    def location(self, i: int) -> str:
        """``"<file>: line <n>"`` of example ``i``."""
        return f"{self.index.files[self.index.file[i]]}: line {int(self.index.line[i])}"

    def _fields(self, raw: bytes, path: str, line: int) -> tuple[str, str] | list[dict]:
        """The validated fields of one record: ``(prompt, completion)`` or the messages list."""
        cfg = self.cfg
        if cfg.format == "prompt_completion":
            record = load_jsonl_object(raw, path, line, f"{cfg.prompt_field!r} and {cfg.completion_field!r} fields")
            values = []
            for name, key in ((cfg.prompt_field, "data.prompt_field"), (cfg.completion_field, "data.completion_field")):
                value = jsonl_field(record, path, line, name, key)
                if not isinstance(value, str):
                    raise ValueError(f"{path}: line {line}: field {name!r} ({key}) is a "
                                     f"{type(value).__name__}, expected a string")
                values.append(value)
            return tuple(values)
        record = load_jsonl_object(raw, path, line, f"a {cfg.messages_field!r} field")
        messages = jsonl_field(record, path, line, cfg.messages_field, "data.messages_field")
        try:
            check_messages(messages, field=cfg.messages_field, need_assistant=not cfg.train_on_prompt)
        except ValueError as err:
            raise ValueError(f"{path}: line {line}: {err}") from None
        return messages

    def _check_every_record(self) -> None:
        index = self.index
        for file_no, path in enumerate(index.files):
            records = np.flatnonzero(index.file == file_no)
            with open(path, "rb") as f:  # one open per file; records are in file order
                for i in records.tolist():
                    f.seek(int(index.offset[i]))
                    raw = f.read(int(index.length[i]))
                    if len(raw) != int(index.length[i]):
                        raise ValueError(f"{path}: line {int(index.line[i])} is shorter than when it was "
                                         "indexed; the file changed")
                    self._fields(raw, path, int(index.line[i]))

    def _read(self, i: int):
        return self._fields(self.index.read_bytes(i), self.index.files[self.index.file[i]],
                            int(self.index.line[i]))

    def encode(self, indices: Sequence[int]) -> list[Example]:
        """The examples at ``indices`` (in that order), read from disk and tokenized."""
        records = [self._read(int(i)) for i in indices]
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
