"""Tokenizers: byte round trips, a BPE folder written offline and loaded back, error messages."""

import json

import numpy as np
import pytest

from jaxascend.data import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer, write_hf_tokenizer

SAMPLES = ["hello world", "héllo wörld, 日本語, emoji 🙂", "", "tabs\tand\nnewlines\r\n", "a" * 1000]
TRAIN_TEXTS = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the lazy dog\n",
               "naïve café, 日本語のテキスト\n"] * 20


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return write_hf_tokenizer(tmp_path_factory.mktemp("tok"), TRAIN_TEXTS, vocab_size=300)


def test_byte_tokenizer_ids_and_round_trip():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    assert tok.encode("é") == [0xC3, 0xA9]
    for text in SAMPLES:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(np.asarray(ids, np.int32)) == text


def test_byte_tokenizer_batch_matches_single_and_is_int32():
    tok = ByteTokenizer()
    arrays = tok.encode_batch(SAMPLES)
    assert [a.dtype for a in arrays] == [np.int32] * len(SAMPLES)
    assert [a.tolist() for a in arrays] == [tok.encode(t) for t in SAMPLES]


def test_byte_tokenizer_decode_specials_and_invalid_bytes():
    tok = ByteTokenizer()
    assert tok.decode([tok.bos_id, *b"hi", tok.eos_id]) == "<|bos|>hi<|eos|>"
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"
    with pytest.raises(ValueError, match="id 259 is outside 0..258"):
        tok.decode([65, 259])


def test_byte_tokenizer_handles_lone_surrogates():
    assert ByteTokenizer().encode("a\ud800b") == [97, ord("?"), 98]


def test_written_hf_folder_loads_offline_and_round_trips(hf_folder):
    names = sorted(p.name for p in hf_folder.iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((hf_folder / "tokenizer_config.json").read_text())["eos_token"] == "<|eos|>"
    tok = load_tokenizer(str(hf_folder))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (300, 0, 1, 2)
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    # BPE merges learned from the training texts make them shorter than their bytes.
    assert len(tok.encode(TRAIN_TEXTS[0])) < len(TRAIN_TEXTS[0].encode()) * 3 // 4
    arrays = tok.encode_batch(SAMPLES)
    assert [a.tolist() for a in arrays] == [tok.encode(t) for t in SAMPLES]
    assert all(a.dtype == np.int32 for a in arrays)


def test_model_spec_uses_model_folder(hf_folder):
    assert load_tokenizer("model", model_path=str(hf_folder)).vocab_size == 300
    with pytest.raises(ValueError, match="needs a model folder"):
        load_tokenizer("model", model_path=None)


def test_added_tokens_count_in_vocab_size(hf_folder, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(hf_folder), local_files_only=True)
    hf.add_tokens(["<|extra_a|>", "<|extra_b|>"])
    hf.save_pretrained(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    assert tok.vocab_size == 302
    assert tok.encode("<|extra_b|>") == [301]


def test_missing_special_tokens_fall_back(hf_folder, tmp_path):
    # Qwen2-like: no bos, no pad; GPT-2-like: bos == eos. Both must still separate documents.
    (tmp_path / "tokenizer.json").write_text((hf_folder / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, 1, 1)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|eos|>", "eos_token": "<|eos|>"}))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.bos_id, tok.eos_id) == (None, 1)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>"}))
    assert load_tokenizer(str(tmp_path)).eos_id == 0  # eos falls back to bos


def test_missing_or_empty_tokenizer_folder_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=rf"tokenizer folder '{missing}' does not exist.*tokenizer\.json"):
        load_tokenizer(str(missing))
    with pytest.raises(ValueError, match=rf"tokenizer folder '{tmp_path}' has no tokenizer files.*tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer("model", model_path=str(missing))


def test_unloadable_tokenizer_folder_names_the_folder(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"tokenizer folder '{tmp_path}' could not be loaded"):
        load_tokenizer(str(tmp_path))


def test_write_hf_tokenizer_rejects_tiny_vocab(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be >= 259"):
        write_hf_tokenizer(tmp_path, ["x"], vocab_size=100)
