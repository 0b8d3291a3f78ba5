"""Sampling (jaxascend.generation) and ``python -m jaxascend.generate``: the sampler's
distributions, stopping, text streamed piece by piece, and the CLI end to end on a tiny
``params.safetensors``, a run folder and a Hugging Face folder, with every error as one line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from jaxascend.config import ModelConfig, load_config
from jaxascend.data import ByteTokenizer, HFTokenizer, write_hf_tokenizer
from jaxascend.generate import main
from jaxascend.generation import (MAX_LENGTH, MAX_NEW_TOKENS, STOP_ID, Generator, LayerStream, SamplingConfig,
                                  SamplePrompts, TextStream, bucket_length, sample_logits, template_chat_format)
from jaxascend.generation import text as text_module
from jaxascend.hf import make_hf_checkpoint, param_plan, reader_from_params, save_params
from jaxascend.models import build_model
from tests._corpus import write_word_corpus
from tests.test_workflow import scratch_run

REPO = Path(__file__).resolve().parents[1]
BYTES = ByteTokenizer()
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(arch="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=BYTES.vocab_size, max_position_embeddings=64,
                  dtype="float32", param_dtype="float32", init_std=0.5)  # a large std: peaked logits
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture(scope="module")
def model_cfg():
    return tiny_config()


@pytest.fixture(scope="module")
def params(model_cfg):
    return nnx.state(build_model(model_cfg, model_cfg.vocab_size, rngs=nnx.Rngs(0)), nnx.Param)


@pytest.fixture(scope="module")
def generator(model_cfg, params):
    with Generator(model_cfg, params) as gen:
        yield gen


@pytest.fixture(scope="module")
def params_file(tmp_path_factory, model_cfg, params):
    return save_params(tmp_path_factory.mktemp("run") / "params.safetensors", params, model_cfg)


PROMPT = [BYTES.bos_id] + BYTES.encode("def main(")

# ----------------------------------------------------------------------------- the sampler


def draws(logits, n=4000, seed=0, **settings) -> np.ndarray:
    keys = jax.random.split(jax.random.key(seed), n)
    sample = jax.vmap(lambda k: sample_logits(jnp.asarray(logits, jnp.float32), k, jnp.float32(settings["t"]),
                                              jnp.float32(settings.get("p", 1.0))))
    return np.bincount(np.asarray(sample(keys)), minlength=len(logits)) / n


PROBS = np.array([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("temperature, top_p, expected", [
    (1.0, 1.0, PROBS),
    (0.5, 1.0, PROBS ** 2 / (PROBS ** 2).sum()),  # p^(1/T), renormalized
    (1.0, 0.8, np.array([0.625, 0.375, 0, 0])),  # the nucleus {0, 1} (0.5 + 0.3 >= 0.8), renormalized
    (1.0, 0.5, np.array([1.0, 0, 0, 0])),  # the most likely token alone reaches 0.5
])
def test_sampling_follows_the_tempered_nucleus_distribution(temperature, top_p, expected):
    freq = draws(np.log(PROBS), t=temperature, p=top_p)
    np.testing.assert_allclose(freq, expected, atol=0.03)
    assert (freq[expected == 0] == 0).all()


def test_a_tiny_top_p_is_greedy_and_temperature_zero_is_argmax():
    logits = np.random.default_rng(0).standard_normal((64, 50)).astype(np.float32)
    best = logits.argmax(-1)
    for seed in range(3):
        key = jax.random.key(seed)
        assert (np.asarray(sample_logits(jnp.asarray(logits), key, jnp.float32(1.5), jnp.float32(1e-6))) == best).all()
        assert (np.asarray(sample_logits(jnp.asarray(logits), key, jnp.float32(0), jnp.float32(1))) == best).all()


def test_ids_past_the_vocab_limit_are_never_chosen():
    logits = np.zeros(10, np.float32)
    logits[8:] = 100.0  # the most likely ids are outside the tokenizer
    key = jax.random.key(0)
    assert int(sample_logits(jnp.asarray(logits), key, jnp.float32(0), jnp.float32(1), jnp.int32(8))) < 8
    keys = jax.random.split(key, 200)
    drawn = jax.vmap(lambda k: sample_logits(jnp.asarray(logits), k, jnp.float32(1), jnp.float32(1), jnp.int32(8)))(keys)
    assert np.asarray(drawn).max() < 8


@pytest.mark.parametrize("fields, message", [
    (dict(temperature=-0.1), "temperature: must be a number >= 0"),
    (dict(top_p=0.0), r"top_p: must be a number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p: must be a number in \(0, 1\]"),
    (dict(max_new_tokens=0), "max_new_tokens: must be an integer >= 1"),
    (dict(seed=2 ** 32), r"seed: must be an integer in \[0, 2\*\*32\)"),
])
def test_sampling_config_rejects(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**fields)


def test_bucket_lengths():
    assert [bucket_length(n) for n in (1, 16, 17, 100, 1024, 1025, 3000)] == [16, 16, 32, 128, 1024, 2048, 3072]

# ----------------------------------------------------------------------------- the generation loop


def test_a_fixed_seed_reproduces_the_sample(generator):
    settings = SamplingConfig(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=4)
    first = generator.generate(PROMPT, settings).tokens
    assert generator.generate(PROMPT, settings).tokens == first
    assert generator.generate(PROMPT, dataclasses.replace(settings, seed=5)).tokens != first


def test_generation_stops_at_a_stop_id_and_reports_why(generator):
    free = generator.generate(PROMPT, SamplingConfig(max_new_tokens=10))
    assert free.stop_reason == MAX_NEW_TOKENS and len(free.tokens) == 10
    stop = next(t for t in free.tokens[1:] if t != free.tokens[0])  # a token not at the start
    at = free.tokens.index(stop)
    seen = []
    out = generator.generate(PROMPT, SamplingConfig(max_new_tokens=10, stop_ids=(stop,)), on_token=seen.append)
    assert out.tokens == free.tokens[:at] == seen and out.stop_reason == STOP_ID
    assert len(out.token_seconds) == at + 1  # the stop id was computed, not printed


def test_generation_stops_at_max_position_embeddings(params):
    cfg = tiny_config(max_position_embeddings=16)
    with Generator(cfg, params) as gen:
        out = gen.generate(PROMPT, SamplingConfig(max_new_tokens=50))  # 10 prompt tokens
    assert out.stop_reason == MAX_LENGTH and len(out.tokens) == 16 - len(PROMPT) + 1


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt: empty"),
    (list(range(65)), r"prompt: 65 tokens, longer than the model's max_position_embeddings \(64\)"),
    ([1, 300], "prompt: token id 300 is outside the model's vocabulary 0..258"),
])
def test_bad_prompts_are_refused(generator, prompt, message):
    with pytest.raises(ValueError, match=message):
        generator.generate(prompt)


def test_end_of_run_samples_decode_what_the_generator_makes(model_cfg, params, generator):
    cfg = load_config("configs/tiny.yaml", ["eval.sample_prompts=['def main(', 'import ']", "eval.sample_max_tokens=8"])
    samples = SamplePrompts.from_config(cfg, BYTES, model_cfg)
    results = samples.generate(model_cfg, params, BYTES)
    expect = generator.generate([BYTES.bos_id] + BYTES.encode("def main("),  # framed as training documents
                                SamplingConfig(max_new_tokens=8, stop_ids=(BYTES.eos_id,)))
    assert results[0]["completion"] == BYTES.decode(expect.tokens) and len(results) == 2
    assert results[0]["prompt"] == "def main(" and results[0]["new_tokens"] == len(expect.tokens)
    long = load_config("configs/tiny.yaml", ["eval.sample_prompts=['ok', '" + "x" * 70 + "']"])
    with pytest.raises(ValueError, match=r"eval.sample_prompts\[1\]: prompt: 71 tokens, longer than"):
        SamplePrompts.from_config(long, BYTES, model_cfg)

def test_streamed_weights_are_read_one_layer_at_a_time_one_ahead():
    cfg = tiny_config(num_hidden_layers=4)
    params = nnx.state(build_model(cfg, cfg.vocab_size, rngs=nnx.Rngs(1)), nnx.Param)
    read = reader_from_params(params)
    plan = param_plan(cfg)
    stacked = {m.path for m in plan if m.stacked}
    log = []

    def recording(path, layer):
        log.append((path, layer))
        return read(path, layer)

    with LayerStream(recording, plan, 4, np.float32) as layers:
        layers.get(0)
        assert {layer for _, layer in log} <= {0, 1}  # layer 0, and layer 1 on the way
        for layer in (1, 2, 3):
            layers.get(layer)
    seen = [layer for _, layer in log]
    assert seen[:4 * len(stacked)] == sorted(seen[:4 * len(stacked)])  # in order, one layer at a time
    assert seen.count(1) == len(stacked) and set(seen) == {0, 1, 2, 3}  # the last started layer 0 again

    log.clear()
    gen = Generator(cfg, recording, stream_layers=True)
    assert not any(path in stacked for path, _ in log)  # built from the top-level leaves only
    log.clear()
    out = gen.generate(PROMPT, SamplingConfig(max_new_tokens=3))
    gen.close()  # waits for the read ahead of the next call's layer 0
    assert all(path in stacked and layer is not None for path, layer in log)
    calls = [layer for i, (_, layer) in enumerate(log) if i % len(stacked) == 0]
    assert calls in ([0, 1, 2, 3] * 3, [0, 1, 2, 3] * 3 + [0])  # every layer once per call, in order
    with Generator(cfg, params) as resident:
        assert resident.generate(PROMPT, SamplingConfig(max_new_tokens=3)).tokens == out.tokens


# ----------------------------------------------------------------------------- text as it comes


def test_text_stream_holds_back_incomplete_characters():
    text = "héllo wörld ✓ 日本語"
    stream = TextStream(BYTES)
    pieces = [stream.push(b) for b in text.encode()]
    assert "".join(pieces) + stream.flush() == text
    assert "\ufffd" not in "".join(pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # 'é' is two bytes: nothing until the second


def test_text_stream_of_a_bpe_tokenizer_prints_what_decoding_all_gives(tmp_path):
    texts = ["the quick brown fox jumps over the lazy dog", "héllo wörld, ça va? 日本語のテキスト"] * 20
    tok = HFTokenizer(write_hf_tokenizer(tmp_path / "tok", texts, vocab_size=300))
    prompt = tok.encode("the quick")
    new = tok.encode(" brown fox héllo ça 日本語")
    stream = TextStream(tok, context=prompt)
    printed = "".join(stream.push(t) for t in new) + stream.flush()
    assert printed == tok.decode(prompt + new)[len(tok.decode(prompt)):]


def test_a_chat_template_file_renders_the_conversation(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    chat = template_chat_format(BYTES, str(template), stop_ids=(7,))
    ids = chat.prompt_ids([{"role": "user", "content": "hi"}])
    assert BYTES.decode(ids) == "<user>hi</user><assistant>" and chat.stop_ids == (7, BYTES.eos_id)
    # The training data's renderer: the byte tokenizer's special names become its special ids.
    template.write_text("{{ bos_token }}" + CHAT_TEMPLATE)
    ids = template_chat_format(BYTES, str(template)).prompt_ids([{"role": "user", "content": "hi"}])
    assert ids[0] == BYTES.bos_id and BYTES.decode(ids[1:]) == "<user>hi</user><assistant>"
    with pytest.raises(ValueError, match="--chat: the tokenizer has no chat template; pass --chat-template FILE"):
        template_chat_format(BYTES)

# ----------------------------------------------------------------------------- the CLI


def run_cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_streams_the_continuation(params_file, model_cfg, params, capsys, monkeypatch):
    written = []
    push = TextStream.push

    def spy(self, token):  # how much stdout holds each time a new token arrives
        written.append(len(sys.stdout.getvalue()) if hasattr(sys.stdout, "getvalue") else None)
        return push(self, token)

    monkeypatch.setattr(TextStream, "push", spy)
    code, out, err = run_cli(capsys, "--checkpoint", params_file, "--prompt", "def main(", "--max-new-tokens", 12)
    assert code == 0, err
    expect = BYTES.decode(Generator(model_cfg, params).generate(PROMPT, SamplingConfig(max_new_tokens=12)).tokens)
    assert out == "def main(" + expect + "\n"
    assert len(written) == 12 and written[-1] > written[0]  # stdout grew while tokens were still coming
    assert err.startswith("note: 12 new tokens in") and err.count("\n") == 1


def test_cli_on_a_run_folder_streams_the_layers_when_the_run_did(tmp_path, params_file, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "params.safetensors").symlink_to(params_file)
    (run / "config.yaml").write_text(yaml.safe_dump({"offload": {"enabled": True, "params": "ssd"}}))
    code, out, err = run_cli(capsys, "--checkpoint", run, "--prompt", "ab", "--prompt", "cd", "--max-new-tokens", 4)
    assert code == 0, err
    assert err.count("layers read one at a time") == 2
    code, out_off, err = run_cli(capsys, "--checkpoint", run, "--prompt", "ab", "--prompt", "cd", "--max-new-tokens", 4,
                                 "--stream-layers", "off")
    assert out_off == out and "layers read" not in err
    assert out.startswith("ab") and "\n\ncd" in out


def test_cli_on_a_hugging_face_folder_with_a_chat_template(tmp_path, capsys):
    folder = make_hf_checkpoint("llama", "tiny", tmp_path / "hf", dtype="float32")
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    code, out, err = run_cli(capsys, "--checkpoint", folder, "--prompt", "the", "--max-new-tokens", 5,
                             "--dtype", "float32")
    assert code == 0, err
    assert out.startswith("the") and err.startswith("note: ")
    code, out, err = run_cli(capsys, "--checkpoint", folder, "--chat", "hi", "--chat-template", template,
                             "--max-new-tokens", 5, "--dtype", "float32", "--temperature", 0.8, "--seed", 1)
    assert code == 0, err
    assert not out.startswith("hi") and out.endswith("\n")  # a chat's prompt is not echoed
    code, out, err = run_cli(capsys, "--checkpoint", folder, "--chat", "hi")
    assert code == 2 and err.startswith("error: --chat: the tokenizer has no chat template")


def test_cli_chat_prints_the_reply_alone(tmp_path, params_file, capsys, monkeypatch):
    """--chat prints only the reply, as a chat does: not the message, not the rendered template."""
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    replies, generate = [], Generator.generate

    def spy(self, *args, **kwargs):  # what the model said
        replies.append(generate(self, *args, **kwargs))
        return replies[-1]

    monkeypatch.setattr(Generator, "generate", spy)
    code, out, err = run_cli(capsys, "--checkpoint", params_file, "--chat", "hi", "--chat-template", template,
                             "--max-new-tokens", 8)
    assert code == 0, err
    assert len(replies) == 1 and out == BYTES.decode(replies[0].tokens) + "\n"
    assert err.startswith("note: ") and err.count("\n") == 1


def test_cli_on_an_offloaded_runs_checkpoint(tmp_path, capsys):
    """A run that kept its layers on SSD, killed after its checkpoint (no params.safetensors): its
    folder and its step give the same text, sampled one layer at a time from the fp32 masters."""
    corpus = write_word_corpus(tmp_path / "corpus", docs=2, words_per_doc=200)
    run = tmp_path / "run"
    proc = scratch_run(run, corpus, "train.steps=2", "checkpoint.every_steps=2", "offload.enabled=true",
                       "offload.params=ssd", "model.remat=full", "export.save_params=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run / "params.safetensors").exists()
    outs = []
    for checkpoint, stream in ((run, "auto"), (run / "checkpoints" / "2", "auto"), (run, "off")):
        code, out, err = run_cli(capsys, "--checkpoint", checkpoint, "--prompt", "the ", "--max-new-tokens", 6,
                                 "--dtype", "float32", "--stream-layers", stream)
        assert code == 0, err
        assert ("layers read one at a time" in err) == (stream == "auto")
        outs.append(out)
    assert outs[0] == outs[1] == outs[2] and outs[0].startswith("the ")


def test_python_m_jaxascend_generate(params_file):
    proc = subprocess.run([sys.executable, "-m", "jaxascend.generate", "--checkpoint", str(params_file),
                           "--prompt", "x = ", "--max-new-tokens", "3"], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("x = ") and proc.stderr.startswith("note: 3 new tokens")


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "{tmp}/missing", "--prompt", "a"], "--checkpoint: '{tmp}/missing' does not exist"),
    (["--checkpoint", "{tmp}", "--prompt", "a"], "has no params.safetensors and no complete checkpoint"),
    (["--checkpoint", "{params}", "--prompt", "a", "--temperature", "-1"], "--temperature: must be a number >= 0"),
    (["--checkpoint", "{params}", "--prompt", "a", "--top-p", "0"], r"--top-p: must be a number in (0, 1]"),
    (["--checkpoint", "{params}", "--prompt", "a", "--top-p", "1.5"], r"--top-p: must be a number in (0, 1]"),
    (["--checkpoint", "{params}", "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens: must be an integer"),
    (["--checkpoint", "{params}", "--prompt", "a", "--seed", "-1"], "--seed: must be an integer in [0, 2**32)"),
    (["--checkpoint", "{params}", "--prompt", "a", "--temperature", "hot"], "argument --temperature: invalid float"),
    (["--checkpoint", "{params}", "--prompt", "a" * 64], "prompt: 65 tokens, longer than the model's "
                                                          "max_position_embeddings (64)"),
    (["--checkpoint", "{params}", "--prompt", ""], "--prompt: empty text"),
    (["--checkpoint", "{params}", "--chat", ""], "--chat: empty text"),
    (["--checkpoint", "{params}"], "give --prompt TEXT (one or more) or --chat TEXT"),
    (["--checkpoint", "{params}", "--prompt", "a", "--chat", "b"], "--prompt and --chat: give one or the other"),
    (["--checkpoint", "{params}", "--chat", "b"], "--chat: the tokenizer has no chat template"),
    (["--checkpoint", "{params}", "--chat", "b", "--chat-template", "{tmp}/none.jinja"], "--chat-template: cannot read"),
    (["--checkpoint", "{params}", "--prompt", "a", "--tokenizer", "{tmp}"], "has no tokenizer files"),
    (["--checkpoint", "{params}", "--prompt", "a", "--dtype", "int8"], "argument --dtype: invalid choice"),
    (["--prompt", "a"], "the following arguments are required: --checkpoint"),
])
def test_cli_errors_are_one_line(tmp_path, params_file, capsys, args, message):
    fill = {"tmp": str(tmp_path), "params": str(params_file)}
    code = None
    try:
        code = main([a.format(**fill) for a in args])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message.format(**fill) in err


def test_cli_refuses_a_tokenizer_larger_than_the_model(tmp_path, params_file, capsys):
    tok = write_hf_tokenizer(tmp_path / "tok", ["some text to learn from"] * 10, vocab_size=300)
    size = HFTokenizer(tok).vocab_size
    assert size > 259
    code, out, err = run_cli(capsys, "--checkpoint", params_file, "--prompt", "a", "--tokenizer", tok)
    assert code == 2 and err == f"error: --tokenizer: {size} tokens, more than the model's vocabulary (259); " \
                                "is it the tokenizer the run used?\n"


def test_generation_config_eos_ids_are_stop_ids(tmp_path):
    (tmp_path / text_module.GENERATION_CONFIG).write_text('{"eos_token_id": [5, 9]}')
    assert text_module.generation_stop_ids([None, str(tmp_path)]) == (5, 9)
    assert text_module.generation_stop_ids([str(tmp_path / "nothing")]) == ()
