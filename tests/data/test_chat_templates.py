"""Chat templates: the trained mask against hand-computed ones, parity with transformers'
apply_chat_template, the byte tokenizer's renderer, generation prompts and stop ids, errors."""

import numpy as np
import pytest

from jaxascend.data import ByteTokenizer, load_chat_template
from jaxascend.data.chat_templates import ChatTemplate, chat_prompt_ids, chat_stop_ids
from jaxascend.data.examples import ExampleSource
from tests.data.conftest import BYTE_TEMPLATE, CHATML_TEMPLATE, CONVERSATION, chat_cfg, write_jsonl

BYTE = ByteTokenizer()


def _pieces(pieces):
    """ids and trained mask from (text or special id, trained) pieces, texts as UTF-8 bytes."""
    ids, trained = [], []
    for piece, flag in pieces:
        piece_ids = [piece] if isinstance(piece, int) else list(piece.encode("utf-8"))
        ids += piece_ids
        trained += [flag] * len(piece_ids)
    return np.asarray(ids, np.int32), np.asarray(trained, bool)


def _hf_ids(tokenizer, messages, **kw):
    """transformers' own apply_chat_template(tokenize=True) ids (a BatchEncoding in 5.x, a list before)."""
    out = tokenizer._tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ----------------------------------------------------------------------------- trained mask, by hand

def test_byte_mask_covers_exactly_the_assistant_turns(byte_template):
    template = load_chat_template(chat_cfg(["x"], byte_template), BYTE)
    ids, trained = template.encode(CONVERSATION)
    bos, eos = 256, 257
    expected_ids, expected_trained = _pieces([
        (bos, False), ("<|system|>\nBe brief.\n", False), ("<|user|>\nCapital of France?\n", False),
        ("<|assistant|>\n", False), ("Paris.", True), (eos, True), ("\n", True),
        ("<|user|>\nAnd of Spain?\n", False), ("<|assistant|>\n", False), ("Madrid.", True), (eos, True),
        ("\n", True),
    ])
    assert ids.dtype == np.int32 and trained.dtype == bool
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(trained, expected_trained)
    ids_all, trained_all = template.encode(CONVERSATION, train_on_prompt=True)
    np.testing.assert_array_equal(ids_all, expected_ids)
    assert trained_all.all()


def test_byte_mask_with_multibyte_characters(byte_template):
    messages = [{"role": "user", "content": "Größe?"}, {"role": "assistant", "content": "日本 🙂"}]
    ids, trained = load_chat_template(chat_cfg(["x"], byte_template), BYTE).encode(messages)
    expected_ids, expected_trained = _pieces([
        (256, False), ("<|user|>\nGröße?\n<|assistant|>\n", False), ("日本 🙂", True), (257, True), ("\n", True)])
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(trained, expected_trained)


def test_hf_mask_covers_exactly_the_assistant_turns(chatml):
    template = load_chat_template(chat_cfg(["x"]), chatml)
    ids, trained = template.encode(CONVERSATION)
    start, end = chatml._tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    # The rendered text, cut at the special tokens; BPE never merges across them, so the ids are
    # the pieces' ids back to back and the mask can be written down piece by piece.
    pieces = [(start, False), ("system\nBe brief.", False), (end, False), ("\n", False),
              (start, False), ("user\nCapital of France?", False), (end, False), ("\n", False),
              (start, False), ("assistant\n", False), ("Paris.", True), (end, True), ("\n", True),
              (start, False), ("user\nAnd of Spain?", False), (end, False), ("\n", False),
              (start, False), ("assistant\n", False), ("Madrid.", True), (end, True), ("\n", True)]
    expected_ids, expected_trained = [], []
    for piece, flag in pieces:
        piece_ids = [piece] if isinstance(piece, int) else chatml.encode(piece)
        expected_ids += piece_ids
        expected_trained += [flag] * len(piece_ids)
    assert ids.tolist() == expected_ids
    assert trained.tolist() == expected_trained
    assert chatml.decode(ids[trained]) == "Paris.<|im_end|>\nMadrid.<|im_end|>\n"


# ----------------------------------------------------------------------------- parity with transformers

CONVERSATIONS = [
    CONVERSATION,
    [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "héllo wörld"}],
    [{"role": "user", "content": "  spaces  and\nnewlines\n"}, {"role": "assistant", "content": "ok\n\n"},
     {"role": "user", "content": "call a tool"}, {"role": "assistant", "content": "{\"x\": 1}"},
     {"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."}],
    [{"role": "user", "content": "日本語 🙂 emoji"}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_ids_equal_apply_chat_template_with_the_tokenizers_template(chatml, k):
    messages = CONVERSATIONS[k]
    template = load_chat_template(chat_cfg(["x"]), chatml)
    ids, trained = template.encode(messages)
    assert ids.tolist() == _hf_ids(chatml, messages)
    assert len(trained) == len(ids)
    assert template.prompt_ids(messages[:1]).tolist() == _hf_ids(chatml, messages[:1], add_generation_prompt=True)


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_ids_equal_apply_chat_template_with_a_template_file(chatml, byte_template, k):
    messages = CONVERSATIONS[k]
    template = load_chat_template(chat_cfg(["x"], byte_template), chatml)
    ids, trained = template.encode(messages)
    assert ids.tolist() == _hf_ids(chatml, messages, chat_template=BYTE_TEMPLATE)
    assert ids.tolist() != _hf_ids(chatml, messages)  # the file, not the tokenizer's own, was used
    # The byte template closes an assistant turn with the tokenizer's eos token, which is trained.
    assert chatml.decode(ids[trained]).endswith("<|eos|>\n")


def test_byte_renderer_renders_as_transformers_does(plain_hf, tmp_path):
    # A template using what transformers' sandbox provides: trim_blocks / lstrip_blocks, loop
    # controls, tojson, raise_exception, {% generation %}, namespace.
    text = ("{% set ns = namespace(n=0) %}\n"
            "{{ bos_token }}\n"
            "  {% for m in messages %}\n"
            "    {% if m['role'] == 'tool' %}{% continue %}{% endif %}\n"
            "    {% set ns.n = ns.n + 1 %}\n"
            "<|{{ m['role'] }}|>{{ m['content'] | tojson }}\n"
            "    {% if m['role'] == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}\n"
            "  {% endfor %}\n"
            "{% if ns.n == 0 %}{{ raise_exception('no messages') }}{% endif %}\n"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}\n")
    path = tmp_path / "t.jinja"
    path.write_text(text)
    mine = load_chat_template(chat_cfg(["x"], path), BYTE)
    theirs = load_chat_template(chat_cfg(["x"], path), plain_hf)
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            assert mine.render(messages, prompt) == theirs.render(messages, prompt)
    assert "<|eos|>" in mine.render(CONVERSATION) and '"Be brief."' in mine.render(CONVERSATION)
    only_tool = [{"role": "tool", "content": "x"}]
    for template in (mine, theirs):
        with pytest.raises(ValueError, match=r"the chat template \(.*t\.jinja\) failed: no messages$"):
            template.render(only_tool)


# ----------------------------------------------------------------------------- generation helpers

def test_chat_prompt_ids_end_with_the_assistant_header(byte_template, chatml):
    cfg = chat_cfg(["x"], byte_template)
    ids = chat_prompt_ids(cfg, BYTE, [{"role": "user", "content": "Hi"}])
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, _pieces([(256, False), ("<|user|>\nHi\n<|assistant|>\n", False)])[0])
    ids = chat_prompt_ids(chat_cfg(["x"]), chatml, [{"role": "user", "content": "Hi"}])
    assert chatml.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="^message 1 has role 'bot'; allowed roles: system, user, assistant, tool$"):
        chat_prompt_ids(cfg, BYTE, [{"role": "bot", "content": "Hi"}])


def test_stop_ids_are_eos_and_the_end_of_turn_token(byte_template, chatml):
    assert chat_stop_ids(chat_cfg(["x"], byte_template), BYTE) == [257]
    im_end = chatml._tok.convert_tokens_to_ids("<|im_end|>")
    assert chat_stop_ids(chat_cfg(["x"]), chatml) == [chatml.eos_id, im_end]
    # The byte template on the HF tokenizer ends a turn with eos itself: nothing else to stop on.
    assert chat_stop_ids(chat_cfg(["x"], byte_template), chatml) == [chatml.eos_id]


# ----------------------------------------------------------------------------- errors

def test_a_tokenizer_without_a_template_needs_the_file(plain_hf, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(ValueError) as err:
        ExampleSource(chat_cfg([path]), BYTE)
    assert str(err.value) == ("data.format: chat needs a chat template: tokenizer ByteTokenizer(vocab_size=259) "
                              "has none; set data.chat_template to a Jinja file")
    with pytest.raises(ValueError, match=r"^data.format: chat needs a chat template: tokenizer HFTokenizer\("
                                         r".*\) has none; set data.chat_template to a Jinja file$"):
        ExampleSource(chat_cfg([path]), plain_hf)


def test_missing_template_file(tmp_path):
    with pytest.raises(ValueError) as err:
        load_chat_template(chat_cfg(["x"], tmp_path / "nope.jinja"), BYTE)
    assert str(err.value) == f"data.chat_template: '{tmp_path / 'nope.jinja'}' does not exist or is not a file"


@pytest.mark.parametrize("use_hf", [False, True])
def test_template_syntax_error_names_the_file_and_line(tmp_path, use_hf, chatml):
    path = tmp_path / "bad.jinja"
    path.write_text("{{ bos_token }}\n{% for m in messages %}{{ m['content'] }}\n")
    with pytest.raises(ValueError) as err:
        load_chat_template(chat_cfg(["x"], path), chatml if use_hf else BYTE)
    assert str(err.value).startswith(f"data.chat_template: {path}: line ")
    assert "Unexpected end of template" in str(err.value) and "\n" not in str(err.value)


def test_a_template_that_is_not_prefix_stable_is_refused(tmp_path):
    path = tmp_path / "count.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ messages | length }}")
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(ValueError) as err:
        ExampleSource(chat_cfg([data], path), BYTE)
    assert str(err.value) == (
        f"{data}: line 1: the chat template ({path}) does not render prefix-stably: messages 1..2 with the "
        "generation prompt, messages 1..3 and the whole conversation are not prefixes of each other, so the "
        "tokens of message 3 (the assistant's) cannot be found")
    ExampleSource(chat_cfg([data], path, train_on_prompt=True), BYTE)  # no spans needed: fine


def test_chat_template_class_refuses_other_tokenizers():
    class Words:
        vocab_size, bos_id, eos_id, pad_id = 10, None, 1, 1

        def __repr__(self):
            return "Words()"

    with pytest.raises(ValueError, match=r"^data.format: chat: tokenizer Words\(\) is neither the byte "
                                         "tokenizer nor a Hugging Face one"):
        ChatTemplate(Words(), CHATML_TEMPLATE, "t.jinja")
