"""The summary's tokens/s: measured from the end of the invocation's first step (which compiles
the step functions) to the last logging point, evaluations left out, and worded so."""

import time

from jaxascend.config import load_config
from jaxascend.metrics import SteadyRate, Throughput, describe_rate
from jaxascend.trainer import run
from tests._corpus import write_word_corpus


def test_the_wording_names_the_steps_measured_and_the_compiled_one():
    assert SteadyRate(982.4, 2, 10, 1).describe() == "982 (steps 2-10; step 1 compiled)"
    assert SteadyRate(1234.0, 52, 52, 51).describe() == "1,234 (step 52; step 51 compiled)"
    assert describe_rate(None, 1) == "not measured: this run's only step (1) compiled the step functions"


def test_the_steady_rate_leaves_out_the_first_step_and_the_evaluations():
    clock = Throughput()
    clock.add(100)
    time.sleep(0.3)  # the compiling step: not counted
    clock.compiled(1)
    assert clock.steady() is None
    clock.mark(1)
    assert clock.steady() is None  # one step: nothing after the compiled one
    for step in (2, 3):
        clock.add(100)
        time.sleep(0.05)
    time.sleep(0.1)  # an evaluation at step 3, before its mark...
    clock.exclude(0.1)
    clock.mark(3)
    clock.exclude(100.0)  # ...and one after the last mark: not in the window
    rate = clock.steady()
    assert (rate.first, rate.last, rate.compiled) == (2, 3, 1)
    assert 200 / 0.3 < rate.tokens_per_s <= 200 / 0.1  # 200 tokens in 0.1 s of steps (sleeps only run long)


def test_a_run_of_one_step_says_it_cannot_measure(tmp_path, capsys):
    corpus = write_word_corpus(tmp_path / "corpus", docs=2, words_per_doc=300)
    result = run(load_config("configs/tiny.yaml", [
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32", "data.batch_size=2",
        "train.progress=false", "optimizer.warmup_steps=0", "train.steps=1", f"data.paths=[{corpus}]",
        "data.include=['*.txt']", f"train.out_dir={tmp_path / 'run'}", "export.save_params=false"]))
    assert result.tokens_per_s is None and result.tokens_per_s_steps is None and result.tokens_per_s_with_compile > 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tokens/s "))
    assert line.endswith("| not measured: this run's only step (1) compiled the step functions")
