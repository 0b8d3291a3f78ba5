"""``model.init: random``: a model folder with config.json alone trains from a random
initialization of its shape (transformers' ``from_config``), said on one note line; the folder's
safetensors, when it has them, are not read, and the run starts exactly where a run from scratch
of the same shape and seed starts. ``pretrained`` (the default) on such a folder is one line that
names the folder and ``model.init: random``."""

import dataclasses
import json

import numpy as np
import pytest

from jaxascend.config import ConfigError, ModelConfig, load_config
from jaxascend.data import ByteTokenizer
from jaxascend.hf import ParamsFile, export_hf, lean_init_reader
from jaxascend.offload import JobShape
from jaxascend.plan import main as plan_main
from jaxascend.preparation import prepare_run, read_available_inputs
from jaxascend.train import main as train_main
from tests._corpus import write_word_corpus

SHAPE = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
         "model.num_attention_heads=4", "model.num_key_value_heads=2"]
RUN = ["data.seq_len=32", "data.batch_size=4", "train.progress=false", "optimizer.warmup_steps=0",
       "train.steps=2", "train.log_every=1"]
NOTE = "note: model.init: random: the weights start from a random initialization (std 0.02, train.seed 0) of "
BYTES = "note: data.tokenizer: auto is the byte tokenizer: "


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words_per_doc=300)


def _hf_folder(folder, weights: bool, vocab_size: int = 259, seed: int = 5):
    """A Hugging Face folder of the test shape (no tokenizer files): config.json, and ``weights``:
    a model.safetensors of bfloat16 weights drawn from ``seed`` (not the runs' train.seed 0)."""
    model_cfg = dataclasses.replace(load_config("configs/tiny.yaml", SHAPE).model, vocab_size=vocab_size)
    read = lean_init_reader(model_cfg, seed)
    export_hf(lambda path, layer: read(path, layer), model_cfg, folder, dtype="bfloat16")
    if not weights:
        (folder / "model.safetensors").unlink()
    return folder


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    return _hf_folder(tmp_path_factory.mktemp("hf") / "config-only", weights=False)


def _train(tmp_path, corpus, *overrides) -> int:
    args = ["--config", "configs/tiny.yaml"]
    for o in (*RUN, f"data.paths=[{corpus}]", "data.include=['*.txt']", f"train.out_dir={tmp_path / 'run'}",
              *overrides):
        args += ["--set", o]
    return train_main(args)


def _losses(out_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("engine", [("offload.params=ssd", "model.remat=full"), ("offload.params=resident",),
                                    ("offload.enabled=false",)], ids=["ssd", "resident", "in-memory"])
def test_config_json_alone_trains_from_a_random_init(engine, tmp_path, corpus, config_only, capsys):
    assert _train(tmp_path, corpus, f"model.path={config_only}", "model.init=random", *engine) == 0
    err = capsys.readouterr().err
    notes = err.splitlines()
    assert [n for n in notes if n.startswith("note: model.init:")] == [
        f"{NOTE}{config_only}/config.json's shape; no safetensors are read"], err
    assert [n for n in notes if n.startswith(BYTES)] == [
        f"{BYTES}{config_only} holds no tokenizer files (model.init: random); the vocabulary stays "
        "config.json's (259)"], err
    losses = _losses(tmp_path / "run")
    assert len(losses) == 2 and all(np.isfinite(losses))
    saved = ParamsFile(str(tmp_path / "run" / "params.safetensors"))
    # A random init's source dtype is model.param_dtype, as from scratch (export.dtype: source).
    assert saved.source_dtype == "float32" and saved.model_source == str(config_only) and saved.tokenizer is None


def test_pretrained_from_config_json_alone_is_one_line_naming_model_init(tmp_path, corpus, config_only, capsys):
    assert _train(tmp_path, corpus, f"model.path={config_only}", "data.tokenizer=byte") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: model.path: {config_only}: no model.safetensors or model.safetensors.index.json; set model.init: "
                   "random to train from its config.json alone (a random initialization)")
    assert not (tmp_path / "run").exists()


def test_random_init_reads_no_safetensors_and_starts_where_a_run_from_scratch_does(tmp_path, corpus, capsys):
    folder = _hf_folder(tmp_path / "with-weights", weights=True)
    assert _train(tmp_path / "scratch", corpus, *SHAPE) == 0
    assert _train(tmp_path / "random", corpus, f"model.path={folder}", "model.init=random") == 0
    assert _train(tmp_path / "pretrained", corpus, f"model.path={folder}", "data.tokenizer=byte") == 0
    notes = capsys.readouterr().err.splitlines()
    assert [n for n in notes if n.startswith("note: model.init:")] == [
        f"{NOTE}{folder}/config.json's shape; the folder's model.safetensors is not read"]
    scratch, random = _losses(tmp_path / "scratch" / "run"), _losses(tmp_path / "random" / "run")
    assert random == scratch  # bitwise: the same initial weights, the same steps
    assert _losses(tmp_path / "pretrained" / "run")[0] != scratch[0]  # the folder's weights are other ones
    assert ParamsFile(str(tmp_path / "random" / "run" / "params.safetensors")).source_dtype == "float32"
    assert ParamsFile(str(tmp_path / "pretrained" / "run" / "params.safetensors")).source_dtype == "bfloat16"


def test_the_vocabulary_stays_config_jsons_under_the_byte_tokenizer(tmp_path, corpus):
    folder = _hf_folder(tmp_path / "hf", weights=False, vocab_size=320)
    cfg = load_config("configs/tiny.yaml", [*RUN, f"data.paths=[{corpus}]", "data.include=['*.txt']",
                                            f"model.path={folder}", "model.init=random"], inputs=False)
    prepared = prepare_run(cfg, JobShape(), inputs=read_available_inputs(cfg))
    assert isinstance(prepared.tokenizer, ByteTokenizer) and prepared.sized.vocab_size == 320
    assert prepared.cfg.data.tokenizer == "byte" and prepared.weights_folder is None
    assert prepared.model_folder == str(folder)


def test_the_planner_plans_a_random_init_from_config_json_alone(tmp_path, corpus, config_only, capsys):
    args = ["--config", "configs/tiny.yaml"]
    for o in (*RUN, f"data.paths=[{corpus}]", "data.include=['*.txt']", f"train.out_dir={tmp_path / 'run'}",
              f"model.path={config_only}", "model.init=random"):
        args += ["--set", o]
    assert plan_main(args) == 0
    notes = capsys.readouterr().out.splitlines()
    assert sum(n.startswith(NOTE) for n in notes) == 1 and sum(n.startswith(BYTES) for n in notes) == 1
    assert not (tmp_path / "run").exists()


def test_the_model_tokenizer_of_a_folder_without_one_is_one_line(tmp_path, corpus, config_only, capsys):
    assert _train(tmp_path, corpus, f"model.path={config_only}", "model.init=random", "data.tokenizer=model") == 2
    assert capsys.readouterr().err.strip() == (
        f"error: data.tokenizer: 'model': {config_only} holds no tokenizer files (model.init: random reads its "
        "config.json alone); set data.tokenizer to auto or byte (the byte tokenizer), or a tokenizer folder")
    assert not (tmp_path / "run").exists()


def test_a_bad_init_is_one_line_naming_the_field():
    with pytest.raises(ConfigError, match=r"^model.init: expected one of 'pretrained', 'random', got 'scratch'$"):
        load_config("configs/tiny.yaml", ["model.init=scratch"])
    with pytest.raises(ConfigError, match=r"^model.init: 'scratch' is not supported \(allowed: 'pretrained', "
                                          r"'random'\)$"):
        ModelConfig(init="scratch")
    # Without model.path a model starts random either way: pretrained is the default, not a refusal.
    assert load_config("configs/tiny.yaml", ["model.init=pretrained"]).model.path is None
