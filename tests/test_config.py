"""Config loading: YAML + --set overrides, and one-line errors that name the field."""

import textwrap

import pytest

from jaxascend.config import Config, ConfigError, load_config, parse_bytes


@pytest.fixture
def data_file(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text("hello world\n" * 10)
    return p


def _write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_bundled_tiny_config_loads():
    cfg = load_config("configs/tiny.yaml")
    assert isinstance(cfg, Config)
    assert cfg.data.paths == ["@stdlib"]
    assert cfg.model.arch == "llama"
    assert cfg.offload.enabled and cfg.offload.dir == "runs/tiny/offload"  # under train.out_dir by default
    baseline = load_config("configs/tiny-in-memory.yaml")
    assert not baseline.offload.enabled and baseline.model.dtype == "float32"


def test_overrides_are_typed(data_file, tmp_path):
    path = _write(tmp_path, f"data:\n  paths: [{data_file}]\n")
    cfg = load_config(path, ["train.steps=7", "optimizer.learning_rate=1e-3", "model.tie_word_embeddings=false",
                             "offload.arena_bytes=512MiB", "optimizer.grad_clip_norm=null"])
    assert cfg.train.steps == 7
    assert cfg.optimizer.learning_rate == 1e-3
    assert cfg.model.tie_word_embeddings is False
    assert cfg.offload.arena_bytes == 512 * 2**20
    assert cfg.optimizer.grad_clip_norm is None


def test_a_nested_sections_field_is_set_at_any_depth(data_file, tmp_path):
    job = ["train.distributed.coordinator=node0:29500", "train.distributed.num_processes=2",
           "train.distributed.process_id=1"]
    cfg = load_config(_write(tmp_path, f"data:\n  paths: [{data_file}]\n"), job)
    assert (cfg.train.distributed.coordinator, cfg.train.distributed.num_processes) == ("node0:29500", 2)
    assert cfg.train.distributed.process_id == 1 and cfg.train.steps == Config().train.steps
    # Beside the YAML's own fields of that section, which stay.
    yaml_job = f"data:\n  paths: [{data_file}]\ntrain:\n  distributed:\n    heartbeat_timeout_seconds: 7\n"
    cfg = load_config(_write(tmp_path, yaml_job), ["train.distributed.shutdown_timeout_seconds=9"])
    assert (cfg.train.distributed.heartbeat_timeout_seconds, cfg.train.distributed.shutdown_timeout_seconds) == (7, 9)
    with pytest.raises(ConfigError, match=r"^train\.distributed: expected a mapping of fields, got 5$"):
        load_config(_write(tmp_path, f"data: {{paths: [{data_file}]}}\ntrain: {{distributed: 5}}\n"),
                    ["train.distributed.num_processes=2"])


def test_list_override_with_a_yaml_reserved_character(data_file, tmp_path):
    # '@' cannot start a plain YAML scalar; a bracketed list is still split on commas.
    cfg = load_config(_write(tmp_path, "train: {steps: 1}\n"), [f"data.paths=[@stdlib, {data_file}]"])
    assert cfg.data.paths == ["@stdlib", str(data_file)]


def test_int_widens_to_float(data_file, tmp_path):
    cfg = load_config(_write(tmp_path, f"data: {{paths: [{data_file}]}}\noptimizer: {{learning_rate: 1}}\n"))
    assert cfg.optimizer.learning_rate == 1.0 and isinstance(cfg.optimizer.learning_rate, float)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.hiden_size=4", r"^model\.hiden_size: unknown key; did you mean 'hidden_size'\? \(allowed: path, arch,"),
        ("optimiser.b1=0.8", r"^optimiser: unknown section; did you mean 'optimizer'\? \(allowed: model, data,"),
        ("nosuch.x=1", r"^nosuch: unknown section \(allowed: model, data,"),
        ("model.zzz=1", r"^model\.zzz: unknown key \(allowed: path, arch,"),
        ("train.steps=abc", r"^train\.steps: expected an integer or null, got 'abc'$"),
        ("train.steps=1.5", r"^train\.steps: expected an integer or null, got 1\.5$"),
        ("train.steps=0", r"^train\.steps: must be >= 1, got 0$"),
        ("model.dtype=int8", r"^model\.dtype: expected one of 'bfloat16', 'float16', 'float32', got 'int8'$"),
        ("model.remat=sometimes", r"^model\.remat: expected one of 'none', 'full'"),
        ("optimizer.b2=1.0", r"^optimizer\.b2: must be >= 0 and < 1, got 1\.0$"),
        ("offload.arena_bytes=lots", r"^offload\.arena_bytes: expected a byte size like 4096 or '512MiB', got 'lots'$"),
        ("model.num_key_value_heads=3", r"^model\.num_key_value_heads: 3 must divide model\.num_attention_heads=8$"),
        ("data.tokenizer=/no/such/folder", r"^data\.tokenizer: expected 'auto', 'byte', 'model' or a tokenizer folder"),
        ("data.seq_len=4096", r"^data\.seq_len: 4096 exceeds model\.max_position_embeddings=2048$"),
        ("train.steps", r"^--set 'train\.steps': expected section\.field=value$"),
        ("train.distributd.num_processes=2",
         r"^train\.distributd: unknown section in train; did you mean 'distributed'\? \(allowed: distributed\)$"),
        ("train.distributed.num_proceses=2",
         r"^train\.distributed\.num_proceses: unknown key; did you mean 'num_processes'\? \(allowed: coordinator, "),
        ("model.rope.factor=8", r"^model\.rope: unknown section in model \(model has no nested section\)$"),
        ("train.steps.max=3", r"^--set 'train\.steps\.max': train\.steps is a field \(an integer or null\), not a section; "
                              r"set it with --set train\.steps=VALUE$"),
        ("model.rope_scaling.factor=8", r"^--set 'model\.rope_scaling\.factor': model\.rope_scaling is a field "
                                        r"\(a mapping or null\), not a section"),
        ("train.distributed.num_processes=0", r"^train\.distributed\.num_processes: must be >= 1, got 0$"),
        ("train..steps=3", r"^--set 'train\.\.steps': expected section\.field \(e\.g\. train\.steps or "),
        ("offload.overlap=maybe", r"^offload\.overlap: expected true/false, got 'maybe'$"),
    ],
)
def test_bad_values_name_the_field(override, message, data_file, tmp_path):
    path = _write(tmp_path, f"data:\n  paths: [{data_file}]\n")
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path, [override])
    assert "\n" not in str(info.value)


def test_missing_data_path(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.paths: missing"):
        load_config(_write(tmp_path, "train: {steps: 3}\n"))


def test_nonexistent_data_path(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.paths: '/nope/x\.txt' does not exist$"):
        load_config(_write(tmp_path, "data: {paths: [/nope/x.txt]}\n"))


def test_missing_config_file():
    with pytest.raises(ConfigError, match=r"^--config: file 'configs/nope\.yaml' not found$"):
        load_config("configs/nope.yaml")


def test_yaml_is_read_safely(tmp_path):
    # A python tag would run code under an unsafe loader; the safe loader refuses it.
    path = _write(tmp_path, "train: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match=r"invalid YAML"):
        load_config(path)


def test_section_must_be_mapping(data_file, tmp_path):
    with pytest.raises(ConfigError, match=r"^train: expected a mapping of fields, got 5$"):
        load_config(_write(tmp_path, f"data: {{paths: [{data_file}]}}\ntrain: 5\n"))


@pytest.mark.parametrize("text, value", [(4096, 4096), ("4KiB", 4096), ("1.5GiB", 3 * 2**29), ("2GB", 2 * 10**9)])
def test_parse_bytes(text, value):
    assert parse_bytes(text, "x") == value
