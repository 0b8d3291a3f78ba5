"""Text out of the sampler: new tokens streamed as text, and the generation config's stop ids.

    stream = TextStream(tokenizer, context=prompt_ids)
    gen.generate(prompt_ids, settings, on_token=lambda t: print(stream.push(t), end="", flush=True))
    print(stream.flush())
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

from jaxascend.data import Tokenizer

GENERATION_CONFIG = "generation_config.json"
_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first new ones (a leading space depends on them)
_INCOMPLETE = "\ufffd"  # what a decoder gives for the first bytes of a character still to come


class TextStream:
    """Turns new token ids into text pieces as they arrive, so that printing the pieces in order
    prints what decoding all the tokens at once gives. A token that ends inside a multi-byte
    UTF-8 character (a byte of the byte tokenizer, a byte-level BPE piece) yields nothing until
    the character is complete; each token is decoded with the few before it, because tokenizers
    decode a token differently at the start of a text (sentencepiece drops a leading space).

    ``context``: the prompt's ids (its last few are decoded with the first new tokens).
    """

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._ids = [int(i) for i in list(context)[-_CONTEXT_TOKENS:]]
        self._prefix = 0  # ids[prefix:read] is the text already printed (with its context)
        self._read = len(self._ids)

    def _pending(self) -> str:
        done = self._tokenizer.decode(self._ids[self._prefix:self._read])
        return self._tokenizer.decode(self._ids[self._prefix:])[len(done):]

    def push(self, token: int) -> str:
        """The text that ``token`` completes ("" while a character is incomplete)."""
        self._ids.append(int(token))
        piece = self._pending()
        if not piece or piece.endswith(_INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return piece

    def flush(self) -> str:
        """Whatever is still held back at the end (an incomplete character as U+FFFD)."""
        piece = self._pending()
        self._prefix = self._read = len(self._ids)
        return piece


def generation_stop_ids(folders: Iterable[Optional[str]]) -> tuple[int, ...]:
    """``eos_token_id`` (an int or a list) of the first ``generation_config.json`` among
    ``folders`` (a model folder, its tokenizer folder); () when none has one."""
    for folder in folders:
        path = Path(folder).expanduser() / GENERATION_CONFIG if folder else None
        if path is None or not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(eos, int):
            return (eos,)
        if isinstance(eos, list) and all(isinstance(i, int) for i in eos):
            return tuple(eos)
    return ()
