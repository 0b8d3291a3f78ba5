"""AdamW on SSD as an optax transformation, and the trainer's fast path.

:func:`ssd_adamw` is an optax ``GradientTransformation`` whose fp32 master weights, m and v live
on SSD in an :class:`~jaxascend.offload.state.OffloadedAdamState`; its optax state holds two
scalars. The trainer's fast path, :func:`ssd_adamw_step`, skips optax's update tree altogether.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback

from jaxascend.config import OptimizerConfig
from jaxascend.offload.state import OffloadedAdamState
from jaxascend.optim import AdamWSettings, decay_mask


class SsdAdamWState(NamedTuple):
    """optax state of :func:`ssd_adamw`: two scalars; the model-size state is on SSD."""

    count: jax.Array  # int32[]: updates applied so far (optax's ScaleByAdamState.count)
    state_id: jax.Array  # int32[]: OffloadedAdamState.state_id of the owner holding master/m/v


def _check_owner(state: OffloadedAdamState, state_id, count) -> None:
    if int(state_id) != state.state_id:
        raise ValueError(f"ssd_adamw: the optimizer state names SSD state {int(state_id)}, but this "
                         f"transformation owns SSD state {state.state_id}")
    if int(count) != state.updates_applied:
        raise ValueError(f"ssd_adamw: the optimizer state's count is {int(count)} but the SSD-resident state has "
                         f"had {state.updates_applied} updates; each update must be applied exactly once, to "
                         f"the latest optimizer state (the SSD state is not copied with the optax state)")


def _host_update(state: OffloadedAdamState, count, state_id, scalars, grads, params) -> list:
    """Runs on the host (through io_callback): gradients to SSD, the streamed step, and the
    updates ``new - params`` in float32, leaf by leaf."""
    _check_owner(state, state_id, count)
    state.write_grads(grads)
    updates: list = [None] * len(state.leaves)

    def on_leaf(leaf, new):
        old = np.asarray(params[leaf.index]).astype(np.float32, copy=False)
        updates[leaf.index] = new.astype(np.float32) - old

    state.apply_update(np.asarray(scalars, np.float32), on_leaf)
    return updates


def _leaf_decay(mask: Any, params, state: OffloadedAdamState) -> Optional[tuple[bool, ...]]:
    """``mask`` (a pytree of bools like ``params``, a function of ``params`` returning one, or
    None) as one flag per leaf of ``state``, in its leaf order."""
    if mask is None:
        return None
    flags = jax.tree.leaves(mask(params) if callable(mask) else mask)
    if len(flags) != len(state.leaves):
        raise ValueError(f"ssd_adamw: the weight decay mask has {len(flags)} leaves but the optimizer state was "
                         f"laid out for {len(state.leaves)}")
    return tuple(bool(flag) for flag in flags)


def ssd_adamw(learning_rate: Union[float, optax.Schedule], b1: float = 0.9, b2: float = 0.999,
              eps: float = 1e-8, weight_decay: float = 0.0, mask: Any = None, *,
              state: OffloadedAdamState) -> optax.GradientTransformation:
    """``optax.adamw`` with fp32 master weights, m and v on SSD, updated by the fused kernel.

    Same arithmetic as ``optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay,
    mask=mask)`` (``eps_root=0``, no Nesterov; ``mask``: a pytree of Python bools like the
    parameters, or a function of them returning one, True where the decay applies; None: every
    leaf; each leaf's kernel call gets its own decay); chain it like any optax transformation,
    e.g. after ``optax.clip_by_global_norm``. ``state`` lays out the parameters (see
    :class:`~jaxascend.offload.state.OffloadedAdamState`); ``init(params)`` writes the master
    weights from ``params`` (float32 or the compute dtype) and zero moments.

    ``update(grads, opt_state, params)`` works eagerly and under ``jit`` (the SSD work runs on
    the host through an ordered ``io_callback``): it casts ``grads`` to the compute dtype,
    writes them to SSD, streams the update, and returns float32 ``updates = new - params``
    where ``new = master.astype(compute dtype)``. What ``optax.apply_updates(params, updates)``
    then gives:

    * float16/bfloat16 params: exactly ``new`` whenever ``new - params`` is exact in float32,
      i.e. unless a parameter's exponent changes by more than 13 (fp16) / 16 (bf16) binades in
      one step (in practice: always);
    * float32 params: exactly ``new`` when ``params/2 <= new <= 2*params`` (Sterbenz); a
      parameter crossing zero may land one unit in the last place of ``max(|old|, |new|)`` away.

    The SSD state is not copied with the optax state: ``update`` must be applied once per
    step to the latest ``opt_state`` (a replayed count is an error naming both counts). Under
    ``jit`` the SSD step runs asynchronously in the callback: call ``jax.block_until_ready`` on
    the step's outputs before using ``state`` directly (reading it back, closing it).
    Materialising ``updates`` costs a float32 tree of the model's size: fine for small models;
    the trainer uses :func:`ssd_adamw_step` instead.
    """
    settings = AdamWSettings(learning_rate, b1, b2, eps, weight_decay)

    def init_fn(params):
        leaves = jax.tree.leaves(params)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):  # init under jit
            io_callback(lambda *xs: state.init(list(xs)), None, *leaves, ordered=True)
        else:
            state.init(params)
        return SsdAdamWState(count=jnp.zeros([], jnp.int32), state_id=jnp.asarray(state.state_id, jnp.int32))

    def update_fn(updates, opt_state, params=None):
        if params is None:
            raise ValueError("ssd_adamw: update(grads, opt_state, params) needs params (the update is "
                             "new - params)")
        grads = state.layout.flatten(updates, "gradients")
        param_leaves = state.layout.flatten(params, "params")
        grads = [jnp.asarray(g).astype(leaf.dtype) for g, leaf in zip(grads, state.leaves)]
        leaf_settings = dataclasses.replace(settings, decay=_leaf_decay(mask, params, state))
        scalars = leaf_settings.per_leaf(settings.hyperparams(opt_state.count).scalars())
        out_types = [jax.ShapeDtypeStruct(leaf.shape, jnp.float32) for leaf in state.leaves]
        new_updates = io_callback(functools.partial(_host_update, state), out_types, opt_state.count,
                                  opt_state.state_id, scalars, grads, param_leaves, ordered=True)
        new_state = SsdAdamWState(count=optax.safe_increment(opt_state.count), state_id=opt_state.state_id)
        return jax.tree.structure(updates).unflatten(new_updates), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def ssd_adamw_state(state: OffloadedAdamState) -> SsdAdamWState:
    """The optax state that matches ``state`` as it stands (count = its updates applied), e.g.
    after :meth:`OffloadedAdamState.restored` in a new process, where owner ids start afresh."""
    return SsdAdamWState(count=jnp.asarray(state.updates_applied, jnp.int32),
                         state_id=jnp.asarray(state.state_id, jnp.int32))


def ssd_adamw_step(settings: AdamWSettings, opt_state: SsdAdamWState, state: OffloadedAdamState, *,
                   grad_scale: float = 1.0, skip: bool = False, put: Optional[Callable] = None,
                   trace: Optional[list] = None) -> tuple[Optional[object], SsdAdamWState]:
    """The trainer's fast path: one update from the gradients already on SSD (written by the
    backward pass through ``state.gradient_sink()``); returns ``(new compute params, opt_state)``.

    No update tree and no float32 gradient copy exist: the kernel reads each chunk's 16-bit
    gradient from the arena, multiplies it by ``grad_scale`` (loss-scale unscale times the
    clip factor ``min(1, max_norm / global_norm)``), updates master/m/v in place and emits
    the compute params leaf by leaf (``put`` places each one, default ``jnp.asarray``). The
    caller may drop its old params before calling. ``skip=True`` (overflow): nothing is
    touched, the count stays, and ``(None, opt_state)`` comes back. ``trace``: see
    :meth:`OffloadedAdamState.apply_update`.
    """
    _check_owner(state, opt_state.state_id, opt_state.count)
    if skip:
        state.step(None, skip=True)
        return None, opt_state
    params = state.step(settings.scalars(int(opt_state.count), grad_scale), put=put, trace=trace)
    return params, opt_state._replace(count=optax.safe_increment(opt_state.count))


def adamw_on_ssd(cfg: OptimizerConfig, total_steps: int, state: OffloadedAdamState) -> optax.GradientTransformation:
    """:func:`adamw_in_memory`'s twin: ``clip_by_global_norm`` (if configured), then :func:`ssd_adamw`.
    ``state`` must keep its moments in ``cfg.state_dtype`` (``OffloadedAdamState.create(...,
    state=StateFormat.of(cfg.state_dtype, cfg.state_block))``)."""
    if state.layout.state.dtype != cfg.state_dtype:
        raise ValueError(f"optimizer.state_dtype is {cfg.state_dtype!r} but the SSD state keeps "
                         f"{state.layout.state.dtype} moments; create it with that format")
    s = AdamWSettings.from_config(cfg, total_steps)
    mask = None if cfg.weight_decay_mask == "all" else functools.partial(decay_mask, cfg.weight_decay_mask)
    tx = ssd_adamw(s.learning_rate, s.b1, s.b2, s.eps, s.weight_decay, mask, state=state)
    if cfg.grad_clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), tx)
    return tx
