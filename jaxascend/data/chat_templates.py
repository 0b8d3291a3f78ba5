"""Chat templates: conversations rendered to text, to token ids, and to the assistant tokens.

    template = load_chat_template(cfg.data, tokenizer)   # data.chat_template's file, else the tokenizer's
    ids, trained = template.encode(messages)             # int32 ids, bool: the assistant turns' tokens

For generation (the ``generate`` CLI, the trainer's end-of-run samples):

    ids = chat_prompt_ids(cfg.data, tokenizer, [{"role": "user", "content": "Hi"}])
    stop = chat_stop_ids(cfg.data, tokenizer)            # stop when the model emits one of these

``chat_prompt_ids`` renders the conversation with ``add_generation_prompt=True`` (it ends with the
assistant header, ready for the model to answer) and returns int32 ids; ``chat_stop_ids`` is
``[eos]`` plus the template's end-of-turn token (ChatML's ``<|im_end|>``, Gemma's
``<end_of_turn>``) when the tokenizer has it as a single special token.

A Hugging Face tokenizer renders with its own ``apply_chat_template`` (passing the
``data.chat_template`` text as ``chat_template=`` when set), and the rendered text is tokenized
once by the call ``apply_chat_template(..., tokenize=True)`` makes, so the ids are identical to its
ids. The built-in :class:`~jaxascend.data.tokenizers.ByteTokenizer` renders the template file with
jinja2's sandbox set up as transformers sets it up (``trim_blocks``, ``lstrip_blocks``, loop
controls, ``tojson``, ``raise_exception``; variables ``messages``, ``bos_token``, ``eos_token``,
``pad_token``, ``add_generation_prompt``); the names ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` in the
rendered text become its special ids 256, 257, 258, everything else is UTF-8 bytes.

The trained tokens of a chat are those overlapping an assistant turn's text: for message ``i``
(an assistant's) the text between ``render(messages[:i], add_generation_prompt=True)`` and
``render(messages[:i + 1])``, which holds the content and the template's end-of-turn text after
it (so the model learns to stop). A template whose renders are not prefixes of each other
(one that drops earlier turns' reasoning, say) is refused: its assistant tokens cannot be found.
Errors here carry no file name; :mod:`jaxascend.data.examples` prefixes ``file: line n:``.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Optional

import numpy as np

from jaxascend.config import DataConfig
from jaxascend.data.tokenizers import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, ByteTokenizer, HFTokenizer, Tokenizer

CHAT_ROLES = ("system", "user", "assistant", "tool")
_BYTE_SPECIALS = re.compile("|".join(re.escape(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)))
_BYTE_SPECIAL_IDS = {BOS_TOKEN: ByteTokenizer.bos_id, EOS_TOKEN: ByteTokenizer.eos_id,
                     PAD_TOKEN: ByteTokenizer.pad_id}
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ok"}]


def check_messages(messages: object, field: str = "messages", need_assistant: bool = True) -> None:
    """Raises a one-line ValueError saying what is wrong with a conversation's structure.

    ``messages`` must be a non-empty list of objects with a ``role`` (one of :data:`CHAT_ROLES`)
    and a string ``content``; with ``need_assistant`` one of them must be the assistant's, and
    not the first (its tokens are found after the messages before it).
    """
    if not isinstance(messages, list):
        raise ValueError(f"field {field!r} is a {type(messages).__name__}, expected a list of "
                         "{'role': ..., 'content': ...} messages")
    if not messages:
        raise ValueError(f"field {field!r} is an empty list of messages")
    for k, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            raise ValueError(f"message {k} is a {type(message).__name__}, expected an object with "
                             "'role' and 'content'")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"message {k} has no {key!r}")
        role = message["role"]
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ValueError(f"message {k} has role {role!r}; allowed roles: {', '.join(CHAT_ROLES)}")
        if not isinstance(message["content"], str):
            raise ValueError(f"message {k}: 'content' is a {type(message['content']).__name__}, "
                             "expected a string")
    if need_assistant:
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("no assistant message, so nothing would be trained "
                             "(data.train_on_prompt: true trains on the whole conversation)")
        if messages[0]["role"] == "assistant":
            raise ValueError("message 1 is the assistant's; its tokens are found after a system, user "
                             "or tool message, so put one first (or set data.train_on_prompt: true)")


# ----------------------------------------------------------------------------- rendering

def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ValueError("data.format: chat needs the jinja2 package (pip install 'jinja2>=3.1.6')") from None
    return jinja2


def _raise_exception(message):
    raise _jinja().exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As transformers' filter: Jinja's own escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(text: str, source: str):
    """The template compiled in transformers' sandbox (a ``{% generation %}`` block renders its body)."""
    jinja2 = _jinja()

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"data.chat_template: {source}: line {err.lineno}: {err.message}") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _byte_encode_with_offsets(tokenizer: ByteTokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Byte ids of ``text`` (``<|bos|>``, ``<|eos|>``, ``<|pad|>`` as special ids) and each token's
    ``[start, end)`` character offsets."""
    ids, starts, ends, pos = [], [], [], 0
    for match in [*_BYTE_SPECIALS.finditer(text), None]:
        stop = match.start() if match else len(text)
        if stop > pos:
            piece = text[pos:stop]
            codes = np.frombuffer(piece.encode("utf-32-le", errors="replace"), np.uint32)
            per_char = 1 + (codes >= 0x80) + (codes >= 0x800) + (codes >= 0x10000)  # UTF-8 lengths
            char_of_byte = np.repeat(np.arange(pos, stop, dtype=np.int64), per_char)
            ids.append(tokenizer.encode_array(piece))
            starts.append(char_of_byte)
            ends.append(char_of_byte + 1)
        if match:
            ids.append(np.array([_BYTE_SPECIAL_IDS[match.group()]], np.int32))
            starts.append(np.array([match.start()], np.int64))
            ends.append(np.array([match.end()], np.int64))
            pos = match.end()
    if not ids:
        return np.zeros(0, np.int32), np.zeros((0, 2), np.int64)
    return np.concatenate(ids).astype(np.int32), np.stack([np.concatenate(starts), np.concatenate(ends)], axis=1)


def _overlapping(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """True for each token whose ``[start, end)`` overlaps a span (an empty one: lies inside it)."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    hit = np.zeros(len(offsets), bool)
    for s, e in spans:
        hit |= ((starts < e) & (ends > s)) | ((starts == ends) & (starts >= s) & (starts < e))
    return hit


class ChatTemplate:
    """One tokenizer's chat template: renders conversations and encodes them (see the module doc).

    ``text`` is the Jinja source, or None for a Hugging Face tokenizer's own; ``source`` names it
    in errors (a file path, or ``"the tokenizer's"``).
    """

    def __init__(self, tokenizer: Tokenizer, text: Optional[str], source: str):
        self.tokenizer = tokenizer
        self.text = text
        self.source = source
        self._jinja = _jinja()
        if isinstance(tokenizer, ByteTokenizer):
            if text is None:
                raise ValueError("ChatTemplate: the byte tokenizer has no template of its own; pass its text")
            self._compiled = _compile(text, source)
        elif isinstance(tokenizer, HFTokenizer):
            if text is not None:
                _compile(text, source)  # a syntax error names the file now, not the first record
        else:
            raise ValueError(f"data.format: chat: tokenizer {tokenizer!r} is neither the byte tokenizer "
                             "nor a Hugging Face one, so it cannot render a chat template")

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text; a template error becomes a one-line ValueError."""
        errors = (self._jinja.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)
        try:
            if isinstance(self.tokenizer, HFTokenizer):
                return self.tokenizer.render_chat(messages, chat_template=self.text,
                                                  add_generation_prompt=add_generation_prompt)
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
        except errors as err:
            raise ValueError(f"the chat template ({self.source}) failed: {_first_line(err)}") from None

    def encode_text(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Ids of rendered text (its special-token names as special ids) and ``[n, 2]`` char offsets."""
        if isinstance(self.tokenizer, HFTokenizer):
            return self.tokenizer.encode_with_offsets(text)
        return _byte_encode_with_offsets(self.tokenizer, text)

    def assistant_spans(self, messages: list[dict], rendered: str) -> list[tuple[int, int]]:
        """``[start, end)`` character spans of the assistant turns in ``rendered`` (the whole render)."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[:i + 1])
            if not (through.startswith(before) and rendered.startswith(through)):
                raise ValueError(
                    f"the chat template ({self.source}) does not render prefix-stably: messages 1..{i} "
                    f"with the generation prompt, messages 1..{i + 1} and the whole conversation are not "
                    f"prefixes of each other, so the tokens of message {i + 1} (the assistant's) cannot be found")
            spans.append((len(before), len(through)))
        return spans

    def encode(self, messages: list[dict], train_on_prompt: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """int32 ids of the rendered conversation and a bool array: True for trained tokens
        (the assistant turns' tokens, or every token with ``train_on_prompt``)."""
        check_messages(messages, need_assistant=not train_on_prompt)
        rendered = self.render(messages)
        ids, offsets = self.encode_text(rendered)
        if train_on_prompt:
            return ids, np.ones(len(ids), bool)
        trained = _overlapping(offsets, self.assistant_spans(messages, rendered))
        if not trained.any():
            raise ValueError(f"the chat template ({self.source}) renders the assistant messages as no "
                             "tokens, so nothing would be trained")
        return ids, trained

    def prompt_ids(self, messages: list[dict]) -> np.ndarray:
        """int32 ids of the conversation followed by the assistant header (add_generation_prompt)."""
        check_messages(messages, need_assistant=False)
        return self.encode_text(self.render(messages, add_generation_prompt=True))[0]

    def stop_ids(self) -> list[int]:
        """eos, then the end-of-turn token: the first token after an assistant's content in a probe
        conversation, if it is a single special token other than eos."""
        stop = [int(self.tokenizer.eos_id)]
        before = self.render(_PROBE[:1], add_generation_prompt=True)
        through = self.render(_PROBE)
        turn = through[len(before):] if through.startswith(before) else ""
        at = turn.find(_PROBE[1]["content"])
        if at < 0:
            return stop
        after, _ = self.encode_text(turn[at + len(_PROBE[1]["content"]):])
        special = (self.tokenizer.special_ids if isinstance(self.tokenizer, HFTokenizer)
                   else set(_BYTE_SPECIAL_IDS.values()))
        if len(after) and int(after[0]) in special and int(after[0]) not in stop:
            stop.append(int(after[0]))
        return stop


def load_chat_template(cfg: DataConfig, tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template ``cfg`` asks for: the ``data.chat_template`` file, else the tokenizer's own.

    A tokenizer without one (the byte tokenizer always) and no file is refused in one line.
    """
    if cfg.chat_template is not None:
        path = os.path.expanduser(cfg.chat_template)
        if not os.path.isfile(path):
            raise ValueError(f"data.chat_template: {cfg.chat_template!r} does not exist or is not a file")
        with open(path, encoding="utf-8") as f:
            return ChatTemplate(tokenizer, f.read(), source=path)
    if isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template is not None:
        return ChatTemplate(tokenizer, None, source="the tokenizer's")
    raise ValueError(f"data.format: chat needs a chat template: tokenizer {tokenizer!r} has none; "
                     "set data.chat_template to a Jinja file")


def chat_prompt_ids(cfg: DataConfig, tokenizer: Tokenizer, messages: list[dict]) -> np.ndarray:
    """int32 ids of ``messages`` rendered with the generation prompt, for the model to answer.

        ids = chat_prompt_ids(cfg.data, tok, [{"role": "user", "content": "What is 2 + 2?"}])
    """
    return load_chat_template(cfg, tokenizer).prompt_ids(messages)


def chat_stop_ids(cfg: DataConfig, tokenizer: Tokenizer) -> list[int]:
    """The ids that end an assistant turn: eos, and the template's end-of-turn token if special."""
    return load_chat_template(cfg, tokenizer).stop_ids()
