"""Data pipeline: document discovery, packing, determinism, resumption and error messages."""

import json
import os
import sysconfig

import numpy as np
import pytest

from jaxascend.config import DataConfig
from jaxascend.data import BatchStream, ByteTokenizer, jsonl_files, load_tokenizer, write_hf_tokenizer
from jaxascend.data.discovery import discover_files
from jaxascend.data.documents import build_document_index

TOK = ByteTokenizer()


def _cfg(paths, **kw):
    kw.setdefault("seq_len", 15)
    kw.setdefault("batch_size", 3)
    return DataConfig(paths=[str(p) for p in paths], **kw)


@pytest.fixture
def corpus(tmp_path):
    """A directory with .txt files, a .jsonl file, a .py file and a nested folder."""
    (tmp_path / "b.txt").write_text("second text file, with ünïcode\n")
    (tmp_path / "a.txt").write_text("first text file\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "code.py").write_text("print('hi')\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "c.txt").write_text("nested " * 30)
    lines = [json.dumps({"text": f"json document {i} " + "x" * i, "id": i}) for i in range(12)]
    lines[1] = "  " + lines[1]  # leading whitespace before a record is fine
    lines.insert(3, "")  # blank lines are not documents
    lines.insert(7, "   \t")
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    hidden = tmp_path / ".git"
    hidden.mkdir()
    (hidden / "ignored.txt").write_text("never read")
    return tmp_path


def _all_texts(index):
    return [index.read(i) for i in range(len(index))]


def _reference_stream(index, tokenizer, seed, epochs):
    """The documented token stream, built the slow obvious way."""
    texts = _all_texts(index)
    out = []
    for epoch in range(epochs):
        for doc in np.random.default_rng([seed, epoch]).permutation(len(texts)):
            if tokenizer.bos_id is not None:
                out.append(tokenizer.bos_id)
            out += tokenizer.encode(texts[doc]) + [tokenizer.eos_id]
    return np.asarray(out, np.int32)


# ----------------------------------------------------------------------------- discovery

def test_directory_discovery_is_recursive_sorted_and_skips_hidden(corpus):
    files = discover_files([str(corpus)], ["*.txt", "*.jsonl"])
    rel = [os.path.relpath(f.path, corpus) for f in files]
    assert rel == ["a.txt", "b.txt", "docs.jsonl", "empty.txt", os.path.join("sub", "c.txt")]
    index = build_document_index(_cfg([corpus]))
    texts = _all_texts(index)
    # empty.txt is skipped; blank and whitespace-only JSONL lines are not documents.
    assert len(index) == 2 + 12 + 1
    assert texts[:2] == ["first text file\n", "second text file, with ünïcode\n"]
    assert texts[2:14] == [f"json document {i} " + "x" * i for i in range(12)]
    assert texts[14] == "nested " * 30
    assert index.line[2:14].tolist() == [1, 2, 3, 5, 6, 7, 9, 10, 11, 12, 13, 14]


def test_include_globs_select_files(corpus):
    index = build_document_index(_cfg([corpus], include=["*.py"]))
    assert _all_texts(index) == ["print('hi')\n"]
    index = build_document_index(_cfg([corpus], include=["sub/*.txt"]))
    assert _all_texts(index) == ["nested " * 30]


def test_named_files_and_duplicates(corpus):
    index = build_document_index(_cfg([corpus / "b.txt", corpus / "docs.jsonl", corpus / "b.txt"]))
    assert len(index) == 1 + 12
    assert index.read(0).startswith("second")
    with pytest.raises(ValueError, match=r"code\.py.*add a glob such as '\*\.py' to data\.include"):
        build_document_index(_cfg([corpus / "code.py"]))
    assert _all_texts(build_document_index(_cfg([corpus / "code.py"], include=["*.py"]))) == ["print('hi')\n"]


def test_max_documents_caps_in_discovery_order(corpus):
    index = build_document_index(_cfg([corpus], max_documents=5))
    assert len(index) == 5
    assert index.read(4) == "json document 2 xx"


def test_jsonl_without_final_newline_crlf_and_small_index_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl_files, "_INDEX_CHUNK_BYTES", 7)  # lines straddle many chunk boundaries
    docs = [f"doc {i} " + "é" * (3 * i) for i in range(20)]
    raw = "\r\n".join(json.dumps({"body": d}) for d in docs)  # no trailing newline
    (tmp_path / "d.jsonl").write_text(raw, newline="")
    index = build_document_index(_cfg([tmp_path / "d.jsonl"], text_field="body"))
    assert _all_texts(index) == docs


def test_text_that_is_not_utf8_or_binary_is_refused_by_name(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf\xe9 ok\n")
    with pytest.raises(ValueError, match=rf"^{path}: not UTF-8 \(byte 0xe9 at offset 3\); data reads UTF-8 text"):
        build_document_index(_cfg([tmp_path]))
    path.write_bytes(b"text\x00\x01binary")
    with pytest.raises(ValueError, match=rf"^{path}: a NUL byte at offset 4, so a binary file; data reads"):
        build_document_index(_cfg([path]))
    path.write_bytes("ok é".encode()[:-1])  # cut inside the last character
    with pytest.raises(ValueError, match=rf"^{path}: not UTF-8 \(it ends inside a character\)"):
        build_document_index(_cfg([path]))
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")  # an unknown kind, included by a glob
    path.unlink()
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'image.png'}: a NUL byte at offset 8"):
        build_document_index(_cfg([tmp_path], include=["*"]))


def test_a_character_cut_by_the_check_pieces_is_fine_and_offsets_count_from_the_file_start(tmp_path, monkeypatch):
    from jaxascend.data import discovery

    monkeypatch.setattr(discovery, "_CHECK_CHUNK_BYTES", 3)
    path = tmp_path / "u.txt"
    path.write_text("aé€bc")  # é and € straddle the 3-byte pieces
    assert _all_texts(build_document_index(_cfg([path]))) == ["aé€bc"]
    path.write_bytes("aé€bc".encode() + b"\xff")
    with pytest.raises(ValueError, match=r"byte 0xff at offset 8\)"):
        build_document_index(_cfg([path]))


def test_stdlib_finds_many_python_files():
    index = build_document_index(DataConfig(paths=["@stdlib"], include=["*.py"]))
    stdlib = sysconfig.get_paths()["stdlib"]
    assert len(index) > 500
    assert os.path.join(stdlib, "os.py") in index.files
    assert all(f.startswith(stdlib) and "site-packages" not in f and "__pycache__" not in f
               for f in index.files)
    assert index.total_bytes > 5_000_000


# ----------------------------------------------------------------------------- errors

def test_bad_jsonl_line_names_file_and_line(tmp_path):
    good = json.dumps({"text": "fine"})
    path = tmp_path / "bad.jsonl"
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=rf"{path}: line 1 is not valid JSON"):
        build_document_index(_cfg([path]))
    # A bad line further down is found when the stream reaches it.
    path.write_text(f"{good}\n\n{good}\n[1, 2\n")
    stream = BatchStream(_cfg([path], seq_len=31, batch_size=1), TOK)
    with pytest.raises(ValueError, match=rf"{path}: line 4 is not valid JSON"):
        next(stream)


def test_missing_or_wrong_text_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"content": "x", "id": 1}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}: line 1 has no field 'text'.*fields present: content, id"):
        build_document_index(_cfg([path], format="text"))  # auto would name the fields it looks for
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": 5}) + "\n")
    index = build_document_index(_cfg([path]))
    with pytest.raises(ValueError, match=rf"{path}: line 2: field 'text' \(data.text_field\) is a int, expected a string"):
        index.read(1)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="line 1 is a JSON list, expected an object"):
        build_document_index(_cfg([path]))


def test_no_documents_names_paths_and_globs(tmp_path):
    (tmp_path / "notes.md").write_text("markdown is not included")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=rf"no documents found in data.paths \['{tmp_path}'\] "
                                         r"with data.include \['\*.txt', '\*.jsonl', '\*.parquet', '\*.arrow'\]"):
        build_document_index(_cfg([tmp_path]))
    with pytest.raises(ValueError, match=r"data path '/does/not/exist' does not exist"):
        build_document_index(_cfg(["/does/not/exist"]))


# ----------------------------------------------------------------------------- packing and order

def test_rows_concatenate_to_the_token_stream(corpus):
    cfg = _cfg([corpus], seq_len=15, batch_size=3, seed=7)
    stream = BatchStream(cfg, TOK)
    batches = [next(stream) for _ in range(40)]  # several epochs of this small corpus
    assert all(b.shape == (3, 16) and b.dtype == np.int32 for b in batches)
    got = np.concatenate([b.reshape(-1) for b in batches])
    expected = _reference_stream(stream.index, TOK, seed=7, epochs=8)
    assert len(expected) > len(got)
    np.testing.assert_array_equal(got, expected[: len(got)])
    assert stream.epoch > 0


def test_packing_with_hf_tokenizer_without_bos(corpus, tmp_path_factory):
    folder = write_hf_tokenizer(tmp_path_factory.mktemp("tok"), ["some training text for bpe"] * 5,
                                vocab_size=280)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # Qwen2-like: no bos token
        config = json.loads((folder / name).read_text())
        del config["bos_token"]
        (folder / name).write_text(json.dumps(config))
    tok = load_tokenizer(str(folder))
    assert tok.bos_id is None
    stream = BatchStream(_cfg([corpus], seed=1), tok)
    got = np.concatenate([next(stream).reshape(-1) for _ in range(10)])
    np.testing.assert_array_equal(got, _reference_stream(stream.index, tok, seed=1, epochs=3)[: len(got)])


def test_same_seed_same_batches_different_seed_different(corpus):
    take = lambda seed: np.stack([next(s) for s in [BatchStream(_cfg([corpus], seed=seed), TOK)] for _ in range(8)])
    np.testing.assert_array_equal(take(3), take(3))
    assert not np.array_equal(take(3), take(4))


# ----------------------------------------------------------------------------- resumption

@pytest.mark.parametrize("first", [1, 5, 13, 21])
def test_resume_continues_exactly(corpus, first):
    cfg = _cfg([corpus], seq_len=15, batch_size=3, seed=2)
    uninterrupted = BatchStream(cfg, TOK)
    expected = [next(uninterrupted) for _ in range(first + 12)]
    stream = BatchStream(cfg, TOK)
    for _ in range(first):
        next(stream)
    saved = json.loads(json.dumps(stream.state()))
    assert len(json.dumps(saved)) < 300
    restored = BatchStream(cfg, TOK, state=saved)
    for i in range(12):
        np.testing.assert_array_equal(next(restored), expected[first + i])


def test_resume_across_epoch_boundary(corpus):
    cfg = _cfg([corpus], seq_len=15, batch_size=2, seed=5)
    stream = BatchStream(cfg, TOK)
    reference = BatchStream(cfg, TOK)
    while stream.epoch == 0:  # stop right before the batch that crosses into epoch 1
        probe = BatchStream(cfg, TOK, state=stream.state())
        next(probe)
        if probe.epoch > 0:
            break
        next(stream)
        next(reference)
    restored = BatchStream(cfg, TOK, state=stream.state())
    for _ in range(30):
        np.testing.assert_array_equal(next(restored), next(reference))
    assert restored.epoch >= 2


def test_resume_with_other_batch_size_continues_the_token_stream(corpus):
    cfg = _cfg([corpus], seq_len=15, batch_size=3)
    stream = BatchStream(cfg, TOK)
    head = [next(stream) for _ in range(4)]
    other = BatchStream(_cfg([corpus], seq_len=7, batch_size=5), TOK, state=stream.state())
    tail = [next(other) for _ in range(6)]
    got = np.concatenate([b.reshape(-1) for b in head + tail])
    np.testing.assert_array_equal(got, _reference_stream(stream.index, TOK, seed=0, epochs=4)[: len(got)])


def test_state_from_other_data_or_seed_is_refused(corpus):
    cfg = _cfg([corpus])
    stream = BatchStream(cfg, TOK)
    next(stream)
    state = stream.state()
    with pytest.raises(ValueError, match="saved for seed=0.*now seed=1"):
        BatchStream(_cfg([corpus], seed=1), TOK, state=state)
    (corpus / "a.txt").write_text("first text file, now longer\n")
    with pytest.raises(ValueError, match="does not match this data.*fingerprint"):
        BatchStream(cfg, TOK, state=state)
    with pytest.raises(ValueError, match="missing key 'token'"):
        BatchStream(cfg, TOK, state={k: v for k, v in state.items() if k != "token"})
    with pytest.raises(ValueError, match="'epoch' must be a non-negative int"):
        BatchStream(cfg, TOK, state={**state, "epoch": -1})
