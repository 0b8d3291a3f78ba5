"""``data.format: auto`` (the default): the format read from the first record of each data file,
said in one note; files of two formats, or a record with none of the fields, refused in one line;
the planner and the trainer reading the first records alike (the same line, exit 2), with no
tokenizer; and chat data training with a shipped model config that sets no format."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml

from jaxascend.config import ConfigError, DataConfig
from jaxascend.data import BatchStream, ByteTokenizer, eval_batches, make_batch_stream, read_data_format
from jaxascend.data.documents import build_document_index
from jaxascend.data.example_packing import ExampleStream
from tests.data.conftest import BYTE_TEMPLATE, write_jsonl
from tests.data.test_table_readers import RECORDS, WRITERS

BYTE = ByteTokenizer()
HOLDS = {"chat": "chat records ('messages')", "prompt_completion": "prompt_completion records ('prompt' and "
         "'completion')", "text": "text records ('text')"}
LOOKS_FOR = ("'messages' for chat, 'prompt' and 'completion' for prompt_completion, 'text' for text")


def _auto(*paths, **kw) -> DataConfig:
    return DataConfig(paths=[str(p) for p in paths], seq_len=31, batch_size=2, **kw)


# ----------------------------------------------------------------------------- what auto finds

@pytest.mark.parametrize("fmt", list(RECORDS))
@pytest.mark.parametrize("kind", ["jsonl", "parquet_pyarrow", "arrow_stream_pyarrow"])
def test_auto_reads_the_format_of_the_first_record(tmp_path, kind, fmt):
    path = WRITERS[kind](tmp_path, RECORDS[fmt])
    choice = read_data_format(_auto(path))
    assert choice.data.format == fmt
    assert choice.note == f"data.format: auto found {HOLDS[fmt]} in {path}: {fmt}"


def test_a_datasets_folder_is_its_arrow_files(tmp_path):
    folder = WRITERS["datasets_folder"](tmp_path, RECORDS["chat"])  # two shards
    choice = read_data_format(_auto(folder))
    first = sorted(p for p in os.listdir(folder) if p.endswith(".arrow"))[0]
    assert choice.data.format == "chat"
    assert choice.note == f"data.format: auto found {HOLDS['chat']} in {folder / first} and 1 other file: chat"


def test_text_files_are_text(tmp_path):
    (tmp_path / "a.txt").write_text("one")
    (tmp_path / "b.txt").write_text("two")
    (tmp_path / "empty.txt").write_text("")  # holds no document: not counted
    choice = read_data_format(_auto(tmp_path))
    assert (choice.data.format, choice.note) == ("text", f"data.format: auto found plain text in {tmp_path / 'a.txt'} "
                                                         "and 1 other file: text")
    stdlib = read_data_format(_auto("@stdlib", include=["*.py"]))
    assert stdlib.data.format == "text" and stdlib.note.startswith("data.format: auto found plain text in ")


def test_text_files_and_text_records_are_one_format(tmp_path):
    (tmp_path / "a.txt").write_text("plain")
    write_jsonl(tmp_path / "b.jsonl", RECORDS["text"][:3])
    assert read_data_format(_auto(tmp_path)).data.format == "text"


def test_the_first_non_blank_line_decides_and_the_config_names_the_fields(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["", "  ", json.dumps({"q": "2+2=", "a": "4"})])
    choice = read_data_format(_auto(path, prompt_field="q", completion_field="a"))
    assert choice.data.format == "prompt_completion"
    assert choice.note == f"data.format: auto found prompt_completion records ('q' and 'a') in {path}: prompt_completion"


def test_an_explicit_format_is_kept_without_a_note(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", RECORDS["text"][:3])
    choice = read_data_format(_auto(path, format="text"))
    assert (choice.data.format, choice.note) == ("text", None)


def test_the_data_functions_resolve_auto_themselves(tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", RECORDS["chat"])
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("plain text " * 20)
    stream = make_batch_stream(_auto(chat, chat_template=str(_template(tmp_path))), BYTE)
    assert isinstance(stream, ExampleStream) and stream.state()["format"] == "chat"
    assert isinstance(make_batch_stream(_auto(tmp_path / "t"), BYTE), BatchStream)
    assert isinstance(BatchStream(_auto(tmp_path / "t"), BYTE), BatchStream)
    assert next(eval_batches(_auto(chat, chat_template=str(_template(tmp_path))), BYTE)).loss_mask.any()


def _template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(BYTE_TEMPLATE)
    return path


# ----------------------------------------------------------------------------- refusals

def test_files_of_two_formats_are_one_error_naming_two(tmp_path):
    chat = write_jsonl(tmp_path / "a.jsonl", RECORDS["chat"][:2])
    text = write_jsonl(tmp_path / "b.jsonl", RECORDS["text"][:2])
    (tmp_path / "c.txt").write_text("plain")
    with pytest.raises(ValueError) as err:
        read_data_format(_auto(tmp_path))
    assert str(err.value) == (f"data.format: auto: {chat} holds {HOLDS['chat']} but {text} holds {HOLDS['text']}; "
                              "a run reads one format, so data.paths must hold files of one")
    (tmp_path / "b.jsonl").unlink()
    with pytest.raises(ValueError, match=rf"^data.format: auto: {chat} holds .* but {tmp_path / 'c.txt'} holds "
                                         "plain text; "):
        read_data_format(_auto(tmp_path))


def test_a_record_with_none_of_the_fields_names_file_line_and_fields(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["", json.dumps({"question": "q", "answer": "a"})])
    with pytest.raises(ValueError) as err:
        read_data_format(_auto(path))
    assert str(err.value) == (f"{path}: line 2 has none of the fields data.format: auto looks for ({LOOKS_FOR}); "
                              "fields present: question, answer")
    table = WRITERS["parquet_pyarrow"](tmp_path, [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError) as err:
        read_data_format(_auto(table))
    assert str(err.value) == (f"{table}: row 1 has none of the columns data.format: auto looks for ({LOOKS_FOR}); "
                              "columns present: question, answer")


def test_a_line_that_is_not_an_object_is_named(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=rf"^{path}: line 1 is a JSON list, expected an object with a 'messages', "
                                         r"'prompt' and 'completion', or 'text' field$"):
        read_data_format(_auto(path))


def test_a_chat_template_is_refused_only_when_auto_finds_no_chat(tmp_path):
    template = _template(tmp_path)
    text = write_jsonl(tmp_path / "t.jsonl", RECORDS["text"][:2])
    with pytest.raises(ConfigError) as err:
        read_data_format(_auto(text, chat_template=str(template)))
    assert str(err.value) == (f"data.chat_template: only used with data.format: chat (data.format: auto found "
                              f"{HOLDS['text']} in {text}: text)")
    chat = write_jsonl(tmp_path / "c.jsonl", RECORDS["chat"][:2])
    assert read_data_format(_auto(chat, chat_template=str(template))).data.format == "chat"
    with pytest.raises(ConfigError, match=r"only used with data.format: chat \(format is 'text'\)"):
        _auto(text, format="text", chat_template=str(template))


def test_the_first_records_give_the_indexs_own_errors(tmp_path):
    """A wrong field found from the first records is worded as the data index words it."""
    chat = write_jsonl(tmp_path / "chat.jsonl", RECORDS["chat"][:2])
    table = WRITERS["parquet_pyarrow"](tmp_path, RECORDS["chat"])
    (tmp_path / "t.txt").write_text("plain")
    template = str(_template(tmp_path))
    for cfg in (_auto(chat, format="text"), _auto(table, format="text"), _auto(tmp_path / "t.txt", format="chat",
                                                                           chat_template=template)):
        with pytest.raises(ValueError) as early:
            read_data_format(cfg)
        with pytest.raises(ValueError) as late:
            build_document_index(cfg) if cfg.format == "text" else make_batch_stream(cfg, BYTE)
        assert str(early.value) == str(late.value)


def test_held_out_files_are_checked_with_the_datas_format(tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", RECORDS["chat"][:2])
    text = write_jsonl(tmp_path / "t.jsonl", RECORDS["text"][:2])
    with pytest.raises(ValueError) as err:
        read_data_format(_auto(chat), eval_paths=[str(text)])
    assert str(err.value) == (f"eval.paths: {text}: line 1 has no field 'messages' (data.messages_field); fields "
                              "present: text, id; records with 'text' are read with data.format: text")


def test_a_bad_message_in_the_first_record_is_found_before_tokenizing(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "robot", "content": "beep"}]}])
    with pytest.raises(ValueError, match=rf"^{path}: line 1: .*robot"):
        read_data_format(_auto(path))


# ----------------------------------------------------------------------------- plan and train

@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """A tiny Qwen2 model in Hugging Face layout whose tokenizer has a chat template."""
    from transformers import AutoTokenizer

    from jaxascend.hf import make_hf_checkpoint

    folder = make_hf_checkpoint("qwen2", "tiny", tmp_path_factory.mktemp("hf") / "qwen")
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok.chat_template = BYTE_TEMPLATE
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def config_json_only(tmp_path_factory, tiny_qwen):
    folder = tmp_path_factory.mktemp("hf") / "config-only"
    folder.mkdir()
    (folder / "config.json").write_bytes((tiny_qwen / "config.json").read_bytes())
    return folder


def _cli(capsys, main, *overrides):
    args = ["--config", "configs/qwen2.5-0.5b.yaml"]
    for o in overrides:
        args += ["--set", o]
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("folder", ["tiny_qwen", "config_json_only"])
@pytest.mark.parametrize("bad", ["chat_as_text", "no_known_field"])
def test_plan_and_train_say_the_same_line(tmp_path, capsys, request, folder, bad):
    from jaxascend.plan import main as plan_main
    from jaxascend.train import main as train_main

    model = request.getfixturevalue(folder)
    capsys.readouterr()  # what making the model printed (transformers' first import)
    if bad == "chat_as_text":
        data, extra = write_jsonl(tmp_path / "chat.jsonl", RECORDS["chat"][:3]), ["data.format=text"]
        line = (f"error: {data}: line 1 has no field 'text' (data.text_field); fields present: messages, id; "
                "records with 'messages' are read with data.format: chat\n")
    else:
        data, extra = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}]), []
        line = (f"error: {data}: line 1 has none of the fields data.format: auto looks for ({LOOKS_FOR}); fields "
                "present: question, answer\n")
    overrides = [f"model.path={model}", f"data.paths=[{data}]", "data.seq_len=64", f"train.out_dir={tmp_path / 'run'}",
                 f"offload.dir={tmp_path / 'run' / 'offload'}", *extra]
    assert _cli(capsys, plan_main, *overrides) == (2, "", line)
    assert _cli(capsys, train_main, *overrides) == (2, "", line)  # the data is read before the weights
    assert not (tmp_path / "run").exists()


def test_plan_without_tokenizer_files_still_resolves_the_format(tmp_path, capsys, config_json_only):
    from jaxascend.plan import main as plan_main

    data = write_jsonl(tmp_path / "chat.jsonl", RECORDS["chat"][:3])
    code, out, err = _cli(capsys, plan_main, f"model.path={config_json_only}", f"data.paths=[{data}]",
                          f"train.out_dir={tmp_path / 'run'}", f"offload.dir={tmp_path / 'run' / 'offload'}",
                          "data.seq_len=64")
    assert code in (0, 1), err
    assert f"note: data.format: auto found {HOLDS['chat']} in {data}: chat" in out.splitlines()
    assert f"note: no tokenizer in {config_json_only}: vocabulary from config.json (512); the data's first records " \
           "checked, nothing tokenized: runtime part estimated" in out.splitlines()


def _parquet_chat(folder):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS["chat"]), path, row_group_size=16)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_chat_data_trains_with_a_shipped_config_that_sets_no_format(tmp_path, capsys, tiny_qwen, kind):
    """configs/qwen2.5-0.5b.yaml as shipped (no data.format), on a tiny model in Hugging Face
    layout: chat JSONL and Parquet train, the note says what auto found, and the run's config
    (config.yaml, the checkpoint's) records chat; resumed with auto, it resolves the same."""
    from jaxascend.checkpoint import read_meta
    from jaxascend.config import load_config
    from jaxascend.trainer import run

    data = write_jsonl(tmp_path / "chat.jsonl", RECORDS["chat"]) if kind == "jsonl" else _parquet_chat(tmp_path)
    out = tmp_path / "run"
    overrides = [f"model.path={tiny_qwen}", f"data.paths=[{data}]", "data.seq_len=64", "data.batch_size=2",
                 "train.epochs=null", "train.steps=3", f"train.out_dir={out}", f"offload.dir={out / 'offload'}", "checkpoint.every_steps=2",
                 "offload.enabled=true"]
    cfg = load_config("configs/qwen2.5-0.5b.yaml", overrides + ["train.stop_at_step=2"])
    assert cfg.data.format == "auto"
    capsys.readouterr()
    first = run(cfg)
    assert len(first.losses) == 2 and np.isfinite(first.losses).all()
    note = f"note: data.format: auto found {HOLDS['chat']} in {data}: chat"
    assert capsys.readouterr().err.splitlines().count(note) == 1
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["format"] == "chat"
    assert read_meta(out / "checkpoints" / "2")["config"]["data"]["format"] == "chat"
    if kind == "jsonl":  # resumed with auto: the same format, the example stream's state accepted
        resumed = run(load_config("configs/qwen2.5-0.5b.yaml", overrides))
        assert resumed.steps_this_run == 1 and np.isfinite(resumed.losses).all()
        assert note in capsys.readouterr().err.splitlines()
