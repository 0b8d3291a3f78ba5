"""Examples: prompt/completion and chat records to ids + trained mask, and one test per malformed
record, checking the whole message (file, line, what is wrong)."""

import numpy as np
import pytest

from jaxascend.config import DataConfig
from jaxascend.data import ByteTokenizer
from jaxascend.data.example_packing import ExampleStream
from jaxascend.data.examples import ExampleSource
from tests.data.conftest import CONVERSATION, chat_cfg, write_jsonl

BYTE = ByteTokenizer()
GOOD_CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
GOOD_PAIR = {"prompt": "2+2=", "completion": "4"}


def _pc_cfg(paths, **kw):
    return DataConfig(paths=[str(p) for p in paths], format="prompt_completion", seq_len=31, batch_size=2, **kw)


# ----------------------------------------------------------------------------- prompt_completion

def test_prompt_completion_ids_and_mask(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [GOOD_PAIR, {"prompt": "Q: é? A:", "completion": " yes"}])
    first, second = ExampleSource(_pc_cfg([path]), BYTE).encode([0, 1])
    assert first.ids.dtype == np.int32 and first.trained.dtype == bool
    assert first.ids.tolist() == [256, ord("2"), ord("+"), ord("2"), ord("="), ord("4"), 257]
    assert first.trained.tolist() == [False] * 5 + [True, True]  # the completion and eos
    prompt = list("Q: é? A:".encode())
    assert second.ids.tolist() == [256] + prompt + list(b" yes") + [257]
    assert second.trained.tolist() == [False] * (1 + len(prompt)) + [True] * 5


def test_prompt_completion_train_on_prompt_and_custom_fields(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"q": "ab", "a": "c"}])
    [example] = ExampleSource(_pc_cfg([path], prompt_field="q", completion_field="a", train_on_prompt=True),
                              BYTE).encode([0])
    assert example.ids.tolist() == [256, 97, 98, 99, 257]
    assert example.trained.all()


def test_prompt_completion_without_bos(tmp_path, chatml_folder):
    from jaxascend.data import HFTokenizer

    tok = HFTokenizer(chatml_folder)
    tok.bos_id = None  # as Qwen2's tokenizer: no bos
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Capital of France?", "completion": " Paris."}])
    [example] = ExampleSource(_pc_cfg([path]), tok).encode([0])
    prompt, completion = tok.encode("Capital of France?"), tok.encode(" Paris.")
    assert example.ids.tolist() == prompt + completion + [tok.eos_id]
    assert example.trained.tolist() == [False] * len(prompt) + [True] * (len(completion) + 1)


# ----------------------------------------------------------------------------- chat

def test_chat_train_on_prompt_trains_everything_and_needs_no_assistant(tmp_path, byte_template):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION},
                                              {"messages": [{"role": "user", "content": "just text"}]}])
    source = ExampleSource(chat_cfg([path], byte_template, train_on_prompt=True), BYTE)
    examples = source.encode([0, 1])
    assert all(e.trained.all() for e in examples)
    assert BYTE.decode(examples[1].ids) == "<|bos|><|user|>\njust text\n"


def test_chat_records_use_messages_field_and_ignore_extra_keys(tmp_path, byte_template):
    record = {"id": 7, "conv": [{"role": "user", "content": "Hi", "name": "x"},
                                {"role": "assistant", "content": "Yo"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [record])
    [example] = ExampleSource(chat_cfg([path], byte_template, messages_field="conv"), BYTE).encode([0])
    assert BYTE.decode(example.ids[example.trained]) == "Yo<|eos|>\n"


def test_every_record_is_checked_when_the_source_is_built(tmp_path, byte_template):
    records = [GOOD_CHAT] * 500 + [{"messages": [{"role": "user", "content": 5}]}]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    with pytest.raises(ValueError) as err:
        ExampleStream(chat_cfg([path], byte_template), BYTE)  # before any batch is asked for
    assert str(err.value) == f"{path}: line 501: message 1: 'content' is a int, expected a string"


def test_plain_text_files_are_refused(tmp_path, byte_template):
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(ValueError) as err:
        ExampleSource(chat_cfg([tmp_path / "a.txt"], byte_template), BYTE)
    assert str(err.value) == (f"data.format: chat reads records (JSONL lines, Parquet or Arrow rows); "
                              f"{tmp_path / 'a.txt'} is a text file")


# ----------------------------------------------------------------------------- malformed records

def _chat(*messages):
    return {"messages": list(messages)}


USER, ASSISTANT = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}

CHAT_CASES = {
    "not_json": ("{oops", "line 2 is not valid JSON (Expecting property name enclosed in double quotes: "
                          "line 1 column 2 (char 1))"),
    "not_an_object": ("[1, 2]", "line 2 is a JSON list, expected an object with a 'messages' field"),
    "missing_field": ({"msgs": [], "id": 3}, "line 2 has no field 'messages' (data.messages_field); "
                                             "fields present: msgs, id"),
    "not_a_list": ({"messages": "Hi"}, "line 2: field 'messages' is a str, expected a list of "
                                       "{'role': ..., 'content': ...} messages"),
    "empty_list": ({"messages": []}, "line 2: field 'messages' is an empty list of messages"),
    "message_not_an_object": (_chat(USER, "Hello."), "line 2: message 2 is a str, expected an object "
                                                      "with 'role' and 'content'"),
    "no_role": (_chat({"content": "Hi"}, ASSISTANT), "line 2: message 1 has no 'role'"),
    "no_content": (_chat(USER, {"role": "assistant"}), "line 2: message 2 has no 'content'"),
    "unknown_role": (_chat(USER, {"role": "bot", "content": "x"}),
                     "line 2: message 2 has role 'bot'; allowed roles: system, user, assistant, tool"),
    "role_not_a_string": (_chat({"role": 1, "content": "x"}, ASSISTANT),
                          "line 2: message 1 has role 1; allowed roles: system, user, assistant, tool"),
    "content_not_a_string": (_chat(USER, {"role": "assistant", "content": ["a"]}),
                             "line 2: message 2: 'content' is a list, expected a string"),
    "no_assistant": (_chat(USER, {"role": "user", "content": "?"}),
                     "line 2: no assistant message, so nothing would be trained "
                     "(data.train_on_prompt: true trains on the whole conversation)"),
    "assistant_first": (_chat(ASSISTANT, USER, ASSISTANT),
                        "line 2: message 1 is the assistant's; its tokens are found after a system, user "
                        "or tool message, so put one first (or set data.train_on_prompt: true)"),
}


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_malformed_chat_record(tmp_path, byte_template, case):
    record, message = CHAT_CASES[case]
    path = write_jsonl(tmp_path / "c.jsonl", [GOOD_CHAT, record, GOOD_CHAT])
    with pytest.raises(ValueError) as err:
        ExampleSource(chat_cfg([path], byte_template), BYTE)
    assert str(err.value) == f"{path}: {message}"


PC_CASES = {
    "not_json": ("not json", "line 2 is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    "not_an_object": ('"text"', "line 2 is a JSON str, expected an object with 'prompt' and 'completion' fields"),
    "missing_prompt": ({"completion": "x"}, "line 2 has no field 'prompt' (data.prompt_field); "
                                            "fields present: completion"),
    "missing_completion": ({"prompt": "x"}, "line 2 has no field 'completion' (data.completion_field); "
                                            "fields present: prompt"),
    "prompt_not_a_string": ({"prompt": None, "completion": "x"},
                            "line 2: field 'prompt' (data.prompt_field) is a NoneType, expected a string"),
    "completion_not_a_string": ({"prompt": "x", "completion": 4},
                                "line 2: field 'completion' (data.completion_field) is a int, expected a string"),
}


@pytest.mark.parametrize("case", sorted(PC_CASES))
def test_malformed_prompt_completion_record(tmp_path, case):
    record, message = PC_CASES[case]
    path = write_jsonl(tmp_path / "pc.jsonl", [GOOD_PAIR, record])
    with pytest.raises(ValueError) as err:
        ExampleSource(_pc_cfg([path]), BYTE)
    assert str(err.value) == f"{path}: {message}"


def test_template_error_names_the_record_at_build_and_when_reached(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'tool' %}"
                        "{{ raise_exception('tool messages are not supported\nby this template') }}"
                        "{% endif %}{{ m['content'] }}{% endfor %}")
    tool = _chat(USER, {"role": "tool", "content": "42"}, ASSISTANT)
    first = write_jsonl(tmp_path / "first.jsonl", [tool])
    with pytest.raises(ValueError) as err:  # the first record is rendered when the stream is built
        ExampleStream(chat_cfg([first], template), BYTE)
    assert str(err.value) == (f"{first}: line 1: the chat template ({template}) failed: "
                              "tool messages are not supported")
    later = write_jsonl(tmp_path / "later.jsonl", [GOOD_CHAT, "", tool])
    stream = ExampleStream(chat_cfg([later], template, seed=0), BYTE)
    with pytest.raises(ValueError) as err:
        for _ in range(3):
            next(stream)
    assert str(err.value) == (f"{later}: line 3: the chat template ({template}) failed: "
                              "tool messages are not supported")

