"""The training loop: build, loop, report.

``run(cfg)`` reads top to bottom. Host<->device synchronisation happens only where marked
``# SYNC``; everything else is dispatched asynchronously by JAX.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx

from jaxascend.config import Config, ConfigError, ModelConfig
from jaxascend.hf_config import model_config_from_hf
from jaxascend.hf_export import export_hf
from jaxascend.hf_load import load_hf_model
from jaxascend.params_file import save_params
from jaxascend.data import BatchStream
from jaxascend.metrics import MetricsLog, Progress, Throughput, format_bytes, peak_rss_bytes, rss_bytes, summary_table
from jaxascend.models import build_model, count_params
from jaxascend.optim import adamw_in_memory, learning_rate_schedule
from jaxascend.tokenizer import load_tokenizer


@dataclasses.dataclass
class TrainResult:
    """What a finished run hands back (also written to ``<out_dir>/summary.json``)."""

    steps: int
    losses: list[float]  # one per optimizer step
    num_params: int
    peak_rss_bytes: int
    tokens_per_s: float
    out_dir: str


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from logits over ``tokens[:, :-1]``."""
    labels = tokens[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def make_train_step(graphdef: nnx.GraphDef, rest: nnx.State, tx: optax.GradientTransformation,
                    grad_accum: int) -> Callable:
    """One jitted optimizer step over ``grad_accum`` micro-batches ``tokens[A, B, T+1]``.

    Gradients are accumulated in the parameter dtype (fp32 for the in-memory baseline: 4 B/param).
    """

    def loss_fn(params, tokens):
        model = nnx.merge(graphdef, params, rest)
        return next_token_loss(model(tokens[:, :-1]), tokens)

    grad_fn = jax.value_and_grad(loss_fn)

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens):
        if grad_accum == 1:
            loss, grads = grad_fn(params, tokens[0])
        else:
            def micro(acc, micro_tokens):
                loss, g = grad_fn(params, micro_tokens)
                return jax.tree.map(jnp.add, acc, g), loss

            zeros = jax.tree.map(jnp.zeros_like, params)
            grads, losses = jax.lax.scan(micro, zeros, tokens)
            grads = jax.tree.map(lambda g: g / grad_accum, grads)
            loss = losses.mean()
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

    return step


def _check_supported(cfg: Config) -> None:
    if cfg.offload.enabled:
        raise ConfigError("offload.enabled: the SSD-offloaded optimizer is not wired into the trainer yet; "
                          "set offload.enabled=false")


def resolve_model_config(cfg: Config) -> ModelConfig:
    """``cfg.model``, or the architecture read from ``model.path``'s config.json with the run's
    numerics (dtype, param_dtype, remat) on top."""
    if cfg.model.path is None:
        return cfg.model
    model_cfg = model_config_from_hf(cfg.model.path, base=cfg.model)
    if cfg.data.seq_len > model_cfg.max_position_embeddings:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds the model's max_position_embeddings="
                          f"{model_cfg.max_position_embeddings} ({cfg.model.path}/config.json)")
    return model_cfg


def tokenizer_source(cfg: Config) -> str | None:
    """The folder whose tokenizer files an export should copy (None for the byte tokenizer)."""
    if cfg.data.tokenizer == "byte":
        return None
    return cfg.model.path if cfg.data.tokenizer == "model" else cfg.data.tokenizer


def save_outputs(cfg: Config, out_dir: Path, params: nnx.State, model_cfg: ModelConfig, vocab_size: int) -> None:
    """The run's weights: ``params.safetensors`` (exportable later) and, if asked, a HF folder."""
    tok_src = tokenizer_source(cfg)
    if cfg.export.save_params:
        save_params(out_dir / "params.safetensors", params, model_cfg, vocab_size=vocab_size, tokenizer=tok_src)
    if cfg.export.enabled:
        export_hf(params, model_cfg, cfg.export.dir or out_dir / "hf", tokenizer_src=tok_src,
                  dtype=cfg.export.dtype, shard_bytes=cfg.export.shard_bytes, vocab_size=vocab_size)


def run(cfg: Config) -> TrainResult:
    """Trains ``cfg.train.steps`` optimizer steps and writes metrics and a summary to ``out_dir``."""
    _check_supported(cfg)
    out_dir = Path(cfg.train.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    # Build: tokenizer, data, model, optimizer.
    model_cfg = resolve_model_config(cfg)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.path)
    stream = BatchStream(cfg.data, tokenizer)
    vocab_size = model_cfg.vocab_size or tokenizer.vocab_size
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size: {vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({tokenizer.vocab_size})")
    if cfg.model.path is not None:
        model = load_hf_model(cfg.model.path, model_cfg)  # tensor by tensor, cast to param_dtype
    else:
        model = build_model(model_cfg, vocab_size, rngs=nnx.Rngs(cfg.train.seed))
    num_params = count_params(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    del model
    tx = adamw_in_memory(cfg.optimizer, cfg.train.steps)
    opt_state = tx.init(params)
    schedule = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    train_step = make_train_step(graphdef, rest, tx, cfg.train.grad_accum)
    tokens_per_step = cfg.train.grad_accum * cfg.data.batch_size * cfg.data.seq_len

    # Loop.
    losses: list[float] = []
    pending: list[dict[str, jax.Array]] = []
    throughput = Throughput()
    progress = Progress(cfg.train.steps, enabled=cfg.train.progress)
    with MetricsLog(out_dir) as log:
        for step in range(1, cfg.train.steps + 1):
            tokens = np.stack([next(stream) for _ in range(cfg.train.grad_accum)])
            params, opt_state, stats = train_step(params, opt_state, tokens)
            pending.append(stats)
            throughput.add(tokens_per_step)
            if step % cfg.train.log_every and step != cfg.train.steps:
                progress.update(1)
                continue
            fetched = jax.device_get(pending)  # SYNC: waits for the steps dispatched since the last log
            pending.clear()
            losses.extend(float(s["loss"]) for s in fetched)
            record = _log_record(step, fetched[-1], schedule, throughput, stream)
            log.write(record)
            progress.update(1, record)
    progress.close()
    save_outputs(cfg, out_dir, params, model_cfg, vocab_size)  # fp32 master weights in this path

    result = TrainResult(steps=cfg.train.steps, losses=losses, num_params=num_params,
                         peak_rss_bytes=peak_rss_bytes(),
                         tokens_per_s=cfg.train.steps * tokens_per_step / throughput.elapsed(),
                         out_dir=str(out_dir))
    (out_dir / "summary.json").write_text(json.dumps(dataclasses.asdict(result), indent=1))
    print(_summary(result))
    return result


def _log_record(step: int, stats: dict[str, Any], schedule: optax.Schedule, throughput: Throughput,
                stream: BatchStream) -> dict[str, Any]:
    return {
        "step": step,
        "loss": float(stats["loss"]),
        "grad_norm": float(stats["grad_norm"]),
        # The schedule is evaluated at the count used for this step's update (0-based).
        "learning_rate": float(schedule(step - 1)),
        "tokens_per_s": throughput.rate(),
        "elapsed_s": throughput.elapsed(),
        "rss_bytes": rss_bytes(),
        "peak_rss_bytes": peak_rss_bytes(),
        "data_state": stream.state(),
    }


def _summary(r: TrainResult) -> str:
    return summary_table([
        ("steps", str(r.steps)),
        ("parameters", f"{r.num_params:,}"),
        ("loss first -> last", f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f}"),
        ("tokens/s", f"{r.tokens_per_s:,.0f}"),
        ("peak host memory (RSS)", format_bytes(r.peak_rss_bytes)),
        ("outputs", r.out_dir),
    ])
