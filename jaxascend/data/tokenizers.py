"""Tokenizers: a built-in byte-level one and a wrapper over a local Hugging Face tokenizer folder.

Both expose the same small interface (:class:`Tokenizer`), which is all the data pipeline and the
trainer use:

    tok = load_tokenizer("byte", model_path=None)
    ids = tok.encode("héllo")            # list[int], no special tokens added
    text = tok.decode(ids)               # "héllo"
    arrays = tok.encode_batch(texts)     # list of int32 arrays, the fast path for many documents

Hugging Face folders are only ever read from disk (``local_files_only=True``); nothing is downloaded.
:func:`write_hf_tokenizer` trains a small real BPE tokenizer and writes such a folder, so tests and
scripts can make Hugging Face layouts without network access.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

# Files that make a folder loadable by transformers.AutoTokenizer: any one of these suffices
# (tokenizer.json is the `tokenizers` serialization; the others are slow-tokenizer vocabularies).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>"


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the trainer need from a tokenizer.

    ``eos_id`` is always set (it separates packed documents); ``bos_id`` may be None.
    """

    vocab_size: int
    bos_id: Optional[int]
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, then bos, eos and pad (vocab_size 259).

    Encoding goes through ``str.encode`` and ``np.frombuffer``, so tens of MB take milliseconds.
    Lone surrogates (possible in JSON input) are encoded as ``?``.
    """

    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258
    _SPECIAL_NAMES = {256: BOS_TOKEN, 257: EOS_TOKEN, 258: PAD_TOKEN}

    def encode_array(self, text: str) -> np.ndarray:
        """Encodes ``text`` into an int32 array of byte ids (no special tokens)."""
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int32)

    def encode(self, text: str) -> list[int]:
        """Encodes ``text`` into a list of byte ids (no special tokens)."""
        return self.encode_array(text).tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encodes each text into an int32 array (no special tokens)."""
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Decodes ids back to text; invalid UTF-8 becomes U+FFFD, special ids become their names."""
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
        bad = (arr < 0) | (arr >= self.vocab_size)
        if bad.any():
            raise ValueError(f"ByteTokenizer.decode: id {int(arr[bad][0])} is outside 0..{self.vocab_size - 1}")
        special = np.flatnonzero(arr >= 256)
        if special.size == 0:
            return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        # Decode the byte runs between special ids separately so a special id never splits a
        # multi-byte character silently into something else.
        parts, start = [], 0
        for pos in special.tolist():
            parts.append(arr[start:pos].astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
            parts.append(self._SPECIAL_NAMES[int(arr[pos])])
            start = pos + 1
        parts.append(arr[start:].astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
        return "".join(parts)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"


class HFTokenizer:
    """A Hugging Face tokenizer read from a local folder, behind the :class:`Tokenizer` interface.

    ``vocab_size`` is ``len(tokenizer)`` so added tokens count. Many tokenizers lack some special
    tokens (Qwen2 has no bos, Llama no pad), so:
      * eos falls back to sep, then bos, then pad; a tokenizer with none of them is refused;
      * bos is None when absent, and also when it equals eos (GPT-2's single ``<|endoftext|>``),
        so the pipeline does not put the same token twice between documents;
      * pad falls back to eos.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = str(folder)
        _check_tokenizer_folder(self.folder)
        from transformers import AutoTokenizer  # imported here: it takes about a second

        try:
            self._tok = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"tokenizer folder {self.folder!r} could not be loaded by transformers.AutoTokenizer: "
                f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
        tok = self._tok
        self.vocab_size = len(tok)
        eos = next((i for i in (tok.eos_token_id, tok.sep_token_id, tok.bos_token_id, tok.pad_token_id)
                    if i is not None), None)
        if eos is None:
            raise ValueError(
                f"tokenizer folder {self.folder!r}: the tokenizer has no eos, sep, bos or pad token, "
                "so documents cannot be separated; add an eos_token to tokenizer_config.json")
        self.eos_id = int(eos)
        bos = tok.bos_token_id
        self.bos_id = None if bos is None or int(bos) == self.eos_id else int(bos)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        # A `tokenizers` backend encodes a batch on several threads and skips the Python-side
        # length checks ("sequence longer than model_max_length") that long documents would trip.
        backend = getattr(tok, "backend_tokenizer", None)
        self._backend = backend if backend is not None and hasattr(backend, "encode_batch") else None

    def encode(self, text: str) -> list[int]:
        """Encodes ``text`` without adding special tokens."""
        return self.encode_batch([text])[0].tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encodes several texts at once (without special tokens) into int32 arrays."""
        texts = list(texts)
        if not texts:
            return []
        if self._backend is not None:
            encodings = self._backend.encode_batch(texts, add_special_tokens=False)
            return [np.asarray(e.ids, dtype=np.int32) for e in encodings]
        out = self._tok(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)
        return [np.asarray(ids, dtype=np.int32) for ids in out["input_ids"]]

    def decode(self, ids: Iterable[int]) -> str:
        """Decodes ids to text, keeping special tokens visible."""
        ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        return self._tok.decode(ids, skip_special_tokens=False)

    @property
    def chat_template(self) -> Optional[str]:
        """The folder's own chat template (None if it has none); a dict of named templates counts."""
        template = getattr(self._tok, "chat_template", None)
        return template or None

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens and the added tokens marked special (``<|im_end|>`` ...)."""
        ids = set(self._tok.all_special_ids)
        ids.update(i for i, tok in self._tok.added_tokens_decoder.items() if tok.special)
        return frozenset(int(i) for i in ids)

    def render_chat(self, messages: list[dict], chat_template: Optional[str] = None,
                    add_generation_prompt: bool = False) -> str:
        """``messages`` rendered by ``apply_chat_template`` (``chat_template`` text, else the folder's)."""
        return self._tok.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Ids of ``text`` without added special tokens, and int64 ``[n, 2]`` character offsets.

        Tokenized by the same call ``apply_chat_template(..., tokenize=True)`` makes on the
        rendered text, so the ids are identical to its ids.
        """
        if not getattr(self._tok, "is_fast", False):
            raise ValueError(f"tokenizer folder {self.folder!r}: a chat's trained tokens need character "
                             "offsets, which only a fast tokenizer (tokenizer.json) gives")
        out = self._tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        offsets = np.asarray(out["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        return np.asarray(out["input_ids"], dtype=np.int32), offsets

    def __repr__(self) -> str:
        return f"HFTokenizer({self.folder!r}, vocab_size={self.vocab_size})"


def _check_tokenizer_folder(folder: str) -> None:
    """Raises ValueError naming the folder and the expected files if it cannot hold a tokenizer."""
    expected = ", ".join(_TOKENIZER_FILES)
    if not os.path.isdir(folder):
        raise ValueError(f"tokenizer folder {folder!r} does not exist or is not a directory "
                         f"(expected a folder with tokenizer_config.json and one of: {expected})")
    try:
        names = set(os.listdir(folder))
    except OSError as err:
        raise ValueError(f"tokenizer folder {folder!r} cannot be read ({err.strerror})") from err
    if not names.intersection(_TOKENIZER_FILES):
        raise ValueError(f"tokenizer folder {folder!r} has no tokenizer files "
                         f"(expected tokenizer_config.json and one of: {expected})")


def has_tokenizer_files(folder: str) -> bool:
    """Whether ``folder`` holds a tokenizer's files (a model folder may hold only config.json)."""
    folder = os.path.expanduser(folder)
    return os.path.isdir(folder) and bool(set(os.listdir(folder)).intersection(_TOKENIZER_FILES))


def resolve_tokenizer_spec(spec: str, model_path: Optional[str] = None) -> str:
    """``DataConfig.tokenizer`` with ``"auto"`` decided: a pretrained model (``model_path`` set)
    is trained on its own tokenizer (``"model"``), a model from scratch on bytes (``"byte"``)."""
    if spec == "auto":
        return "model" if model_path is not None else "byte"
    return spec


def tokenizer_folder(spec: str, model_path: Optional[str] = None) -> Optional[str]:
    """The folder holding the tokenizer ``spec`` names (what an export copies), None for bytes."""
    spec = resolve_tokenizer_spec(spec, model_path)
    if spec == "byte":
        return None
    return model_path if spec == "model" else spec


def load_tokenizer(spec: str, model_path: Optional[str] = None) -> Tokenizer:
    """Builds the tokenizer named by ``DataConfig.tokenizer``.

    ``spec`` is ``"auto"`` (see :func:`resolve_tokenizer_spec`), ``"byte"`` (the built-in
    :class:`ByteTokenizer`), ``"model"`` (the tokenizer files inside ``model_path``, the Hugging
    Face model folder) or a path to a tokenizer folder.
    """
    spec = resolve_tokenizer_spec(spec, model_path)
    if spec == "byte":
        return ByteTokenizer()
    if spec == "model":
        if model_path is None:
            raise ValueError("tokenizer 'model' needs a model folder (model.path) but none was given")
        return HFTokenizer(os.path.expanduser(model_path))
    return HFTokenizer(os.path.expanduser(spec))


def write_hf_tokenizer(folder: str | os.PathLike, texts: Iterable[str], vocab_size: int = 512,
                       model_max_length: int = 2048) -> Path:
    """Trains a small byte-level BPE tokenizer on ``texts`` and writes a Hugging Face folder.

    The folder holds ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
    (special tokens ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` with ids 0, 1, 2) and loads with
    ``AutoTokenizer.from_pretrained(folder, local_files_only=True)``. ``vocab_size`` counts the
    256 byte symbols and the 3 special tokens, so it must be at least 259. Returns the folder.

        write_hf_tokenizer("/tmp/tok", ["some text", "more text"], vocab_size=300)
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
    if vocab_size < 256 + len(specials):
        raise ValueError(f"write_hf_tokenizer: vocab_size must be >= {256 + len(specials)} "
                         f"(256 bytes + {len(specials)} special tokens), got {vocab_size}")
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(texts, trainer=trainer)

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    raw.save(str(out / "tokenizer.json"))
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    # "PreTrainedTokenizerFast" (rather than transformers 5's "TokenizersBackend") keeps the folder
    # loadable by older transformers releases too.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "add_bos_token": False, "add_eos_token": False, **special_map}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return out
