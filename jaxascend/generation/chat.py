"""Chat prompts: a conversation rendered by the chat template the run trained with.

    chat = template_chat_format(tokenizer, "data/sft_tiny/template.jinja")   # or None: the tokenizer's own
    ids = chat.prompt_ids([{"role": "user", "content": "Hi"}])
    settings = SamplingConfig(stop_ids=chat.stop_ids)

A :class:`ChatFormat` is two things: ``prompt_ids(messages)`` (the conversation with the
assistant's turn opened, ``add_generation_prompt=True``) and the ids that end the assistant's
turn. :func:`template_chat_format` builds it from :class:`jaxascend.data.ChatTemplate`, the very
renderer the training data went through (a Hugging Face tokenizer's ``apply_chat_template``, or
a Jinja file rendered as transformers renders it, with the byte tokenizer's special names as its
special ids), so a prompt is framed exactly as the training conversations were.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from jaxascend.config import DataConfig
from jaxascend.data import HFTokenizer, Tokenizer, load_chat_template

Messages = list[dict]  # [{"role": "user", "content": "..."}, ...]
NO_TEMPLATE = ("--chat: the tokenizer has no chat template; pass --chat-template FILE "
               "(a Jinja chat template, as in tokenizer_config.json's chat_template)")


@dataclass(frozen=True)
class ChatFormat:
    """How a conversation becomes a prompt, and which ids end the assistant's reply."""

    prompt_ids: Callable[[Messages], np.ndarray]  # int32 [P]
    stop_ids: tuple[int, ...]


def check_template_file(path: str) -> str:
    """``path`` itself if it names a readable, non-empty file; ValueError naming it otherwise."""
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--chat-template: cannot read {str(file)!r} ({getattr(err, 'strerror', None) or err})") from None
    if not text.strip():
        raise ValueError(f"--chat-template: {str(file)!r} is empty")
    return str(file)


def template_chat_format(tokenizer: Tokenizer, template: Optional[str] = None,
                         stop_ids: tuple[int, ...] = ()) -> ChatFormat:
    """The chat format of ``tokenizer`` with the Jinja file ``template`` (None: the tokenizer's
    own ``chat_template``); ValueError (:data:`NO_TEMPLATE`) when there is neither. The stop ids
    are ``stop_ids`` (e.g. the generation config's eos ids), the tokenizer's eos and the
    template's end-of-turn token when it is a single special token."""
    if template is None and not (isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template is not None):
        raise ValueError(NO_TEMPLATE)
    chat = load_chat_template(DataConfig(format="chat", chat_template=template), tokenizer)
    stops = tuple(dict.fromkeys(tuple(stop_ids) + (tokenizer.eos_id,) + tuple(chat.stop_ids())))
    return ChatFormat(chat.prompt_ids, stops)
