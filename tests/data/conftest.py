"""Shared pieces of the data tests: a byte-tokenizer chat template, a ChatML Hugging Face tokenizer
folder, and a JSONL writer."""

import json

import pytest

from jaxascend.config import DataConfig
from jaxascend.data import HFTokenizer, write_hf_tokenizer

# Renders "<|bos|>" then per message "<|role|>\n" + content, the assistant's closed by "<|eos|>",
# each followed by "\n"; the generation prompt is "<|assistant|>\n".
BYTE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Spain?"},
    {"role": "assistant", "content": "Madrid."},
]

BPE_TEXTS = ["Be brief. Capital of France? Paris. And of Spain? Madrid. hello world, héllo wörld",
             "the quick brown fox jumps over the lazy dog 0123456789 {} [] : \" ,"] * 20


def write_jsonl(path, records):
    """Writes records (dicts, or raw strings written as they are) one per line; returns the path."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat_cfg(paths, template=None, **kw):
    kw.setdefault("seq_len", 63)
    kw.setdefault("batch_size", 2)
    return DataConfig(paths=[str(p) for p in paths], format="chat",
                      chat_template=None if template is None else str(template), **kw)


@pytest.fixture
def byte_template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(BYTE_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def chatml_folder(tmp_path_factory):
    """A BPE tokenizer folder with a ChatML chat template and <|im_start|> / <|im_end|> special
    tokens, saved by transformers itself (so the folder is in the installed version's format)."""
    from transformers import AutoTokenizer

    folder = write_hf_tokenizer(tmp_path_factory.mktemp("chatml"), BPE_TEXTS, vocab_size=320)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def chatml(chatml_folder):
    return HFTokenizer(chatml_folder)


@pytest.fixture(scope="session")
def plain_hf(tmp_path_factory):
    """A BPE tokenizer with the byte tokenizer's special names and no chat template."""
    return HFTokenizer(write_hf_tokenizer(tmp_path_factory.mktemp("plain"), BPE_TEXTS, vocab_size=320))
