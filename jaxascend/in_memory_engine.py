"""The in-memory baseline: parameters, both AdamW moments and the gradients in host RAM.

This is how a JAX user trains today (``optax.adamw`` with fp32 parameters); jaxascend keeps it
as the reference the offloaded engine is measured and tested against.
"""

from __future__ import annotations

import contextlib

from functools import partial
from typing import Callable

import jax
import optax
from flax import nnx

from jaxascend.checkpoint import Checkpointer
from jaxascend.config import Config
from jaxascend.engine_contract import EngineReport, StepResult
from jaxascend.models import TokenBatch, as_token_batch, batch_loss, loss_sum_and_count
from jaxascend.optim import adamw_in_memory


def make_train_step(graphdef: nnx.GraphDef, rest: nnx.State, tx: optax.GradientTransformation) -> Callable:
    """One jitted optimizer step over a step's micro-batches (a :class:`TokenBatch` ``[A, B, ...]``),
    run as one batch whose layers take the ``A`` micro-batches in turn
    (:mod:`jaxascend.models.micro_batches`): their gradients summed in float32, layer by layer."""

    def loss_fn(params, batch):
        return batch_loss(nnx.merge(graphdef, params, rest), batch)

    grad_fn = jax.value_and_grad(loss_fn)

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch: TokenBatch):
        loss, grads = grad_fn(params, batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

    return step


class InMemoryEngine:
    """``step(tokens)`` runs one jitted AdamW step; nothing leaves RAM. A context manager, like
    the offloaded engine, though it owns no files. Implements :class:`jaxascend.engine_contract.Engine`."""

    name = "in-memory"
    streams_layers = False  # its parameters are one tree

    def __init__(self, cfg: Config, model: nnx.Module):
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        self.tx = adamw_in_memory(cfg.optimizer, cfg.schedule_length())
        self.opt_state = self.tx.init(self.params)
        self._step = make_train_step(self.graphdef, self.rest, self.tx)
        graphdef, rest = self.graphdef, self.rest
        self._eval = jax.jit(lambda params, batch: loss_sum_and_count(nnx.merge(graphdef, params, rest), batch))

    def resume_state(self, trainer: dict) -> None:
        pass  # resumes from checkpoints only

    def end_training(self) -> int:
        return 0  # no files to free

    def step(self, tokens, optimizer: bool = True) -> StepResult:
        """Dispatches one step over ``tokens`` (a :class:`TokenBatch` ``[A, ...]``, or plain rows
        ``int32 [A, B, T+1]``) asynchronously; the loss and norm are device scalars (no sync here)."""
        if not optimizer:
            raise ValueError("in-memory engine: a step always applies its update (optimizer=False is the "
                             "offloaded engine's compute-only step)")
        self.params, self.opt_state, stats = self._step(self.params, self.opt_state, as_token_batch(tokens))
        return StepResult(loss=stats["loss"], grad_norm=stats["grad_norm"])

    def evaluate(self, batches) -> tuple[float, int]:
        """``(sum of the counted targets' losses, their count)`` over micro-batches ``batches``,
        forward only, on the current parameters (the optimizer state is not touched)."""
        total, count = 0.0, 0
        for batch in batches:
            loss_sum, counted = jax.device_get(self._eval(self.params, batch))  # SYNC: per batch
            total += float(loss_sum)
            count += int(counted)
        return total, count

    def save_checkpoint(self, ckpt: Checkpointer, step: int, meta: dict) -> None:
        ckpt.save(step, params=self.params, opt_state=self.opt_state, meta=meta)

    def restore_checkpoint(self, ckpt: Checkpointer, step: int) -> dict:
        """Loads params and the optax state of ``step``; returns the checkpoint's meta."""
        restored = ckpt.restore(step, params_like=self.params, opt_state_like=self.opt_state)
        self.params, self.opt_state = restored.params, restored.opt_state
        return restored.meta

    def compute_weights(self) -> nnx.State:
        """The parameters to sample from (fp32 here; the sampler casts to the compute dtype)."""
        return self.params

    def export_params(self) -> nnx.State:
        """The weights to save or export: the fp32 parameters themselves here."""
        return self.params

    @contextlib.contextmanager
    def sampled_weights(self):
        """As :meth:`OffloadEngine.sampled_weights` (one process: :meth:`compute_weights`)."""
        yield self.compute_weights()

    @contextlib.contextmanager
    def exported_weights(self):
        """As :meth:`OffloadEngine.exported_weights` (one process: the parameters)."""
        yield self.export_params()

    def report(self) -> EngineReport:
        return EngineReport(engine=self.name)

    def shard_files(self) -> list[str]:
        return []

    def timeline(self) -> None:
        return None

    def __enter__(self) -> "InMemoryEngine":
        return self

    def __exit__(self, *exc) -> None:
        pass
