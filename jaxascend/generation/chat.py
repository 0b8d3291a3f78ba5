"""Chat prompts: a conversation rendered by a chat template into the ids the model continues.

    chat = template_chat_format(tokenizer)              # the tokenizer's own template
    ids = chat.prompt_ids([{"role": "user", "content": "Hi"}])
    settings = SamplingConfig(stop_ids=chat.stop_ids)

A :class:`ChatFormat` is two things: ``prompt_ids(messages)`` (the conversation with the
assistant's turn opened, ``add_generation_prompt=True``) and the ids that end the assistant's
turn. Anything that provides them plugs into the generate CLI (``jaxascend.generate.run``'s
``chat_format``); :func:`template_chat_format` is the one built from a Hugging Face tokenizer's
chat template or a Jinja template file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment  # as transformers renders chat templates

from jaxascend.data import Tokenizer

Messages = list[dict]  # [{"role": "user", "content": "..."}, ...]
NO_TEMPLATE = ("--chat: the tokenizer has no chat template; pass --chat-template FILE "
               "(a Jinja chat template, as in tokenizer_config.json's chat_template)")


@dataclass(frozen=True)
class ChatFormat:
    """How a conversation becomes a prompt, and which ids end the assistant's reply."""

    prompt_ids: Callable[[Messages], np.ndarray]  # int32 [P]
    stop_ids: tuple[int, ...]


def read_template(path: str) -> str:
    """The text of a chat template file; ValueError naming the file when it cannot be read."""
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--chat-template: cannot read {str(file)!r} ({getattr(err, 'strerror', None) or err})") from None
    if not text.strip():
        raise ValueError(f"--chat-template: {str(file)!r} is empty")
    return text


def _as_ids(rendered) -> np.ndarray:
    """transformers returns a list of ids, or (5.x by default) a mapping holding ``input_ids``."""
    if hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    ids = np.asarray(rendered, dtype=np.int32)
    return ids.reshape(-1)


def template_chat_format(tokenizer: Tokenizer, template: Optional[str] = None,
                         stop_ids: tuple[int, ...] = ()) -> ChatFormat:
    """The chat format of ``tokenizer``: a Hugging Face tokenizer renders with ``template`` (the
    text of a Jinja chat template) or its own ``chat_template``; any other tokenizer (bytes)
    renders ``template`` with Jinja and encodes the text. ValueError (:data:`NO_TEMPLATE`) when
    there is no template. ``stop_ids`` (e.g. the generation config's eos ids) join the
    tokenizer's eos."""
    stops = tuple(dict.fromkeys(tuple(stop_ids) + (tokenizer.eos_id,)))
    hf = getattr(tokenizer, "_tok", None)  # HFTokenizer's transformers tokenizer
    if hf is not None:
        if template is None and not getattr(hf, "chat_template", None):
            raise ValueError(NO_TEMPLATE)

        def hf_prompt(messages: Messages) -> np.ndarray:
            try:
                return _as_ids(hf.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                                      tokenize=True))
            except TemplateError as err:
                raise ValueError(f"chat template: {err}") from None

        return ChatFormat(hf_prompt, stops)
    if template is None:
        raise ValueError(NO_TEMPLATE)
    try:
        compiled = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    except TemplateError as err:
        raise ValueError(f"chat template: {err}") from None

    def text_prompt(messages: Messages) -> np.ndarray:
        try:
            text = compiled.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        except TemplateError as err:
            raise ValueError(f"chat template: {err}") from None
        return np.asarray(tokenizer.encode(text), dtype=np.int32)

    return ChatFormat(text_prompt, stops)
