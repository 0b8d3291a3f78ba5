"""``model.path`` as a Hugging Face hub id (``org/name[@revision]``): read from the Hugging Face
cache laid out as huggingface_hub lays it out (blobs, snapshots/<commit>/ links, refs/<branch>),
with the hub offline (``HF_HUB_OFFLINE=1``) and the cache in a temporary folder; a download is
a fake that copies from a local folder. Nothing here touches the network."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError

from jaxascend.checkpoint import read_meta
from jaxascend.config import ConfigError, load_config, parse_hub_id
from jaxascend.hf import locate_model, make_hf_checkpoint
from tests._corpus import write_word_corpus

REPO = Path(__file__).resolve().parents[2]
REPO_ID = "tiny-org/tiny-qwen"
RUN = ["data.seq_len=32", "data.batch_size=2", "train.progress=false", "train.log_every=1",
       "offload.chunk_bytes=1MiB", "offload.staging_bytes=1MiB", "checkpoint.async_save=false",
       "optimizer.warmup_steps=0", "data.include=['*.txt']"]


def put_in_cache(cache: Path, repo_id: str, folder: Path, commit: str, revision: str = "main",
                 leave_out: tuple[str, ...] = ()) -> Path:
    """``folder``'s files as the hub cache holds a download of ``repo_id`` at ``commit``: each file a
    blob named by its hash, linked from snapshots/<commit>/, and refs/<revision> naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(folder.iterdir()):
        if f.name in leave_out:
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_hf_checkpoint("qwen2", "tiny", tmp_path_factory.mktemp("hf") / "tiny-qwen", dtype="float32",
                              shard_bytes=1 << 16)  # several shards and an index


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, the hub offline (huggingface_hub read both at import: patched here)."""
    folder = tmp_path / "hub-cache"
    folder.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


@pytest.mark.parametrize("text, hub", [
    ("Qwen/Qwen2.5-0.5B", ("Qwen/Qwen2.5-0.5B", None)), ("org/name@v1.0", ("org/name", "v1.0")),
    ("org/name@refs/pr/1", ("org/name", "refs/pr/1")), ("./org/name", None), ("/abs/org", None),
    ("a/b/c", None), ("a--b/c", None), ("org/.name", None), ("org/name.git", None), ("name", None),
    ("org/name@", None), ("~/models", None)])
def test_a_hub_id_is_org_slash_name_and_an_optional_revision(text, hub):
    assert parse_hub_id(text) == (tuple(hub) if hub else None)


def test_a_cached_hub_id_is_its_snapshot_folder(cache, tiny_model):
    snapshot = put_in_cache(cache, REPO_ID, tiny_model, "a" * 40)
    source = locate_model(REPO_ID)
    assert source.folder == str(snapshot) and source.hub == (REPO_ID, None)
    assert source.note() == (f"model.path: '{REPO_ID}' is read from the Hugging Face cache's snapshot {snapshot} "
                             "(revision main)")
    assert locate_model(f"{REPO_ID}@{'a' * 40}").folder == str(snapshot)  # a commit: its snapshot


def test_a_folder_of_that_name_wins(cache, tiny_model, tmp_path, monkeypatch):
    put_in_cache(cache, REPO_ID, tiny_model, "a" * 40)
    (tmp_path / REPO_ID).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    source = locate_model(REPO_ID)
    assert (source.folder, source.hub, source.note()) == (REPO_ID, None, None)


def test_not_cached_and_offline_is_one_line_saying_what_to_do(cache):
    with pytest.raises(ConfigError) as err:
        locate_model("no-org/no-model@v2")
    assert str(err.value) == (
        f"model.path: 'no-org/no-model@v2' is neither a folder nor in the Hugging Face cache ({cache}), and the "
        "hub is offline (HF_HUB_OFFLINE=1): download it with `hf download no-org/no-model --revision v2` or give "
        "a folder")


def test_a_cached_snapshot_without_a_shard_is_refused_offline_naming_it(cache, tiny_model):
    shard = sorted(json.loads((tiny_model / "model.safetensors.index.json").read_text())["weight_map"].values())[-1]
    snapshot = put_in_cache(cache, REPO_ID, tiny_model, "b" * 40, leave_out=(shard,))
    with pytest.raises(ConfigError, match=f"is in the Hugging Face cache \\({snapshot}\\) without {shard}, and the "
                                          "hub is offline"):
        locate_model(REPO_ID)
    assert locate_model(REPO_ID, weights=False).folder == str(snapshot)  # the planner reads no weights


def test_neither_a_folder_nor_a_hub_id_keeps_the_folder_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.path: '/no/such/model' is not a directory$"):
        load_config("configs/tiny.yaml", ["model.path=/no/such/model", f"train.out_dir={tmp_path}"])
    assert load_config("configs/tiny.yaml", [f"model.path={REPO_ID}"], inputs=False).model.path == REPO_ID


def _fake_download(source: Path, calls: list):
    """snapshot_download that "downloads" ``source``'s files matching allow_patterns into the cache."""
    def download(repo_id, *, revision=None, allow_patterns=None, **_):
        calls.append((revision, sorted(allow_patterns)))
        snapshot = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots" / ("c" * 40)
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.name in allow_patterns and not (snapshot / f.name).exists():
                (snapshot / f.name).write_bytes(f.read_bytes())
        return str(snapshot)
    return download


def test_online_a_missing_model_downloads_what_the_run_reads_saying_where(cache, tiny_model, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls: list = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _fake_download(tiny_model, calls))
    source = locate_model(REPO_ID)
    shards = json.loads((tiny_model / "model.safetensors.index.json").read_text())["weight_map"].values()
    assert [revision for revision, _ in calls] == [None, "c" * 40]  # the shards at the commit found first
    assert "config.json" in calls[0][1] and "tokenizer.json" in calls[0][1]
    assert not [name for name in calls[0][1] if name.endswith(".safetensors")]  # the weights second
    assert calls[1][1] == sorted({"model.safetensors.index.json", *shards})
    assert sorted(os.listdir(source.folder)) == sorted(os.listdir(tiny_model))
    assert capsys.readouterr().err == (
        f"note: model.path: '{REPO_ID}' is not in the Hugging Face cache: downloading config.json, the tokenizer "
        f"and the safetensors weights from the hub to {cache}\n")


def test_online_an_unreachable_hub_is_one_line(cache, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unreachable(*args, **kwargs):
        raise LocalEntryNotFoundError("Got: ConnectError: [Errno -3] name resolution failed\nmore")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ConfigError) as err:
        locate_model(REPO_ID)
    assert str(err.value) == (
        f"model.path: '{REPO_ID}' is neither a folder nor in the Hugging Face cache ({cache}), and the hub cannot be "
        "reached (Got: ConnectError: [Errno -3] name resolution failed): download it with "
        f"`hf download {REPO_ID}` or give a folder")


def test_generate_samples_from_a_cached_hub_id(cache, tiny_model, capsys):
    from jaxascend.generate import main as generate

    snapshot = put_in_cache(cache, REPO_ID, tiny_model, "a" * 40)
    assert generate(["--checkpoint", REPO_ID, "--prompt", "hello", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("hello")
    assert err.startswith(f"note: --checkpoint: '{REPO_ID}' is read from the Hugging Face cache's snapshot {snapshot} "
                          "(revision main)\n")
    assert generate(["--checkpoint", "no-org/no-model", "--prompt", "hello"]) == 2
    assert capsys.readouterr().err == (
        f"error: --checkpoint: 'no-org/no-model' is neither a folder nor in the Hugging Face cache ({cache}), and the "
        "hub is offline (HF_HUB_OFFLINE=1): download it with `hf download no-org/no-model` or give a folder\n")


# The CLIs, in fresh processes with the cache and the offline switch in their environment.

def _cli(module: str, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", module, "--config", str(REPO / "configs/tiny.yaml")]
    for o in overrides:
        args += ["--set", o]
    env = {k: v for k, v in os.environ.items() if k not in ("JAXASCEND_DEBUG", "HF_HOME", "HF_HUB_CACHE")}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)


def test_the_planner_plans_a_cached_hub_id(cache, tiny_model, tmp_path):
    snapshot = put_in_cache(cache, REPO_ID, tiny_model, "a" * 40)
    proc = _cli("jaxascend.plan", cache, f"model.path={REPO_ID}", f"train.out_dir={tmp_path / 'run'}",
                "data.paths=[/no/data]")
    assert proc.returncode == 0, proc.stderr
    assert f"note: model.path: '{REPO_ID}' is read from the Hugging Face cache's snapshot {snapshot}" in proc.stdout
    assert not (tmp_path / "run").exists()


def test_not_cached_offline_the_trainer_stops_with_one_line_writing_nothing(cache, tmp_path):
    corpus = write_word_corpus(tmp_path / "corpus", docs=2, words_per_doc=50)
    proc = _cli("jaxascend.train", cache, f"model.path={REPO_ID}", f"data.paths=[{corpus}]",
                f"train.out_dir={tmp_path / 'run'}", *RUN)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"error: model.path: '{REPO_ID}' is neither a folder nor in the Hugging Face cache "
                           f"({cache}), and the hub is offline (HF_HUB_OFFLINE=1): download it with "
                           f"`hf download {REPO_ID}` or give a folder\n")
    assert not (tmp_path / "run").exists()


def test_training_from_a_hub_id_records_it_and_notes_a_new_snapshot_on_resume(cache, tiny_model, tmp_path):
    corpus = write_word_corpus(tmp_path / "corpus", docs=4, words_per_doc=300)
    first = put_in_cache(cache, REPO_ID, tiny_model, "a" * 40)
    out = tmp_path / "run"
    proc = _cli("jaxascend.train", cache, f"model.path={REPO_ID}", f"data.paths=[{corpus}]", f"train.out_dir={out}",
                "train.steps=2", *RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"note: model.path: '{REPO_ID}' is read from the Hugging Face cache's snapshot {first}" in proc.stderr
    config = (out / "config.yaml").read_text()
    assert f"path: {REPO_ID}\n" in config and str(cache) not in config  # what the user wrote
    record = read_meta(out / "checkpoints" / "2")
    assert record["config"]["model"]["path"] == REPO_ID
    assert record["meta"]["origin"]["model_source"] == str(first)  # the folder it trained from
    # The hub's main moved on and the cache holds the new snapshot: a resume says so.
    second = put_in_cache(cache, REPO_ID, tiny_model, "d" * 40)
    proc = _cli("jaxascend.train", cache, f"model.path={REPO_ID}", f"data.paths=[{corpus}]", f"train.out_dir={out}",
                "train.steps=3", *RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"note: model.path: '{REPO_ID}' now resolves to snapshot {'d' * 40}; checkpoint 2 was made from "
            f"{first}: the run resumes the checkpoint's weights and reads config.json and the tokenizer from "
            f"{second}") in proc.stderr
