"""Config discovery: ``python -m jaxascend.config`` lists every field of every section with its type,
default and meaning (from the dataclasses' own comments); an unknown key or section names the
closest allowed one, in YAML and in ``--set``; ``--help`` names the sections."""

import dataclasses
import subprocess
import sys
import textwrap
import typing

import pytest

from jaxascend.config import Config, ConfigError, load_config
from jaxascend.config.field_docs import config_fields, config_sections, default_label, field_comments, type_label


def _all_dataclass_fields(cls, prefix: str) -> list[str]:
    """Every field reachable from ``cls``, nested sections included, by walking the dataclasses."""
    names = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if prefix:
            names.append(name)
        if dataclasses.is_dataclass(tp) or inner:
            names += _all_dataclass_fields(tp if dataclasses.is_dataclass(tp) else inner[0], name)
    return names


def test_the_listing_covers_every_dataclass_field_with_a_meaning():
    docs = config_fields()
    expected = _all_dataclass_fields(Config, "")
    assert sorted(d.name for d in docs) == sorted(expected) and len(set(expected)) == len(expected)
    assert "train.distributed.coordinator" in expected and "optimizer.weight_decay" in expected
    missing = [d.name for d in docs if not d.meaning]
    assert missing == [], f"fields without a comment beside or above them: {missing}"


def test_the_cli_prints_every_field_with_type_default_and_meaning():
    done = subprocess.run([sys.executable, "-m", "jaxascend.config"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for doc in config_fields():
        assert f"  {doc.name}: {doc.type_label} = {doc.default_label}\n" in done.stdout, doc.name
    assert "  optimizer.schedule: 'constant' | 'cosine' | 'linear' = cosine\n" in done.stdout
    assert "  train.distributed.coordinator: str | null = null\n" in done.stdout
    assert "  offload.chunk_bytes: any = 8MiB\n" in done.stdout
    assert "[train.distributed] One process of a multi-process job" in done.stdout
    only = subprocess.run([sys.executable, "-m", "jaxascend.config", "checkpoint"], capture_output=True, text=True,
                          timeout=120)
    assert only.stdout.startswith("[checkpoint]") and "optimizer." not in only.stdout
    bad = subprocess.run([sys.executable, "-m", "jaxascend.config", "optimiser"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: optimiser: unknown section; did you mean 'optimizer'?")


def test_comments_above_and_beside_a_field_are_its_meaning():
    @dataclasses.dataclass
    class Sample:
        # Two lines of block comment
        # about the first field.
        first: int = 1  # and its own.
        second: str = "a#b"  # the '#' in the string is no comment

        third: typing.Optional[list[str]] = dataclasses.field(  # wrapped
            default_factory=lambda: ["x"])  # over two lines

    comments = field_comments(Sample)
    assert comments == {"first": "Two lines of block comment about the first field. and its own.",
                        "second": "the '#' in the string is no comment", "third": "wrapped over two lines"}
    fields = {f.name: f for f in dataclasses.fields(Sample)}
    assert default_label(fields["third"]) == "[x]" and default_label(fields["first"]) == "1"
    assert type_label(typing.get_type_hints(Sample)["third"]) == "list[str] | null"


def test_sections_are_listed_in_config_order():
    names = [s.name for s in config_sections()]
    assert names == ["model", "data", "optimizer", "offload", "checkpoint", "export", "train", "train.distributed",
                     "eval"]


@pytest.mark.parametrize("yaml_text, message", [
    ("optimizer:\n  learning_rat: 1e-3\n",
     r"^optimizer\.learning_rat: unknown key; did you mean 'learning_rate'\? \(allowed: learning_rate, "),
    ("trian:\n  steps: 3\n", r"^trian: unknown key; did you mean 'train'\? \(allowed: model, data, "),
    ("train:\n  distributed: {coordinatr: 'h:1'}\n",
     r"^train\.distributed\.coordinatr: unknown key; did you mean 'coordinator'\?"),
])
def test_unknown_yaml_keys_say_did_you_mean(tmp_path, yaml_text, message):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(yaml_text))
    with pytest.raises(ConfigError, match=message):
        load_config(path, inputs=False)


def test_unknown_set_keys_say_did_you_mean():
    with pytest.raises(ConfigError, match=r"^train\.log_evry: unknown key; did you mean 'log_every'\?"):
        load_config("configs/tiny.yaml", ["train.log_evry=5"], inputs=False)


@pytest.mark.parametrize("cli", ["jaxascend.train", "jaxascend.plan"])
def test_help_names_the_sections_and_the_listing(cli):
    done = subprocess.run([sys.executable, "-m", cli, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for section in ("model", "data", "optimizer", "offload", "checkpoint", "export", "train", "eval"):
        assert f"\n  {section} " in done.stdout, section
    assert "python -m jaxascend.config" in done.stdout and "README.md" in done.stdout
