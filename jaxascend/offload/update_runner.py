"""How a step's optimizer update runs, chosen once from the plan (``StepPlan.overlap``):

* :class:`SequentialUpdates`: the update runs on the trainer's thread right after the
  forward/backward; the step returns with the new weights in place;
* :class:`OverlappedUpdates`: the update of step t runs on a thread
  (:class:`~jaxascend.offload.overlap.BackgroundUpdate`) while step t+1's forward/backward is
  dispatched; that step waits only for the leaves outside the layer stack, and its layer scan
  reads each layer through the parameter source once step t has updated it.

Both share one interface, called by :meth:`OffloadEngine.step
<jaxascend.offload.engine.OffloadEngine.step>` in this order: :meth:`before_forward`, the
forward/backward, :meth:`after_forward`, :meth:`run`; :meth:`finish` waits for whatever runs
(a checkpoint, an export, an evaluation and closing call it), :meth:`abandon` after a failure.
"""

from __future__ import annotations

from typing import Optional, Protocol

import jax

from jaxascend.offload.compute_weights import ComputeWeights
from jaxascend.offload.overlap import BackgroundUpdate
from jaxascend.offload.ssd_adamw import ssd_adamw_state, ssd_adamw_step
from jaxascend.offload.state import OffloadedAdamState, to_default_device
from jaxascend.offload.streamed_update import StepStats
from jaxascend.offload.timeline import StepTimeline
from jaxascend.optim import AdamWSettings


def optimizer_timing(last: StepStats) -> dict:
    """The figures of a finished update, as a step reports them."""
    stream = last.seconds - last.flush_seconds
    return {"grad_flush_seconds": last.flush_seconds, "optimizer_seconds": stream,
            "optimizer_bytes": last.bytes_read + last.bytes_written, "ssd_gbps": last.ssd_gbps,
            "stream_gbps": (last.bytes_read + last.bytes_written) / stream / 1e9 if stream > 0 else 0.0}


class UpdateRunner(Protocol):
    """What the engine's step calls of an update runner (see the module doc)."""

    def before_forward(self) -> float:
        """Gets the weights the next forward takes as inputs; returns the seconds waited."""

    def after_forward(self, timing: dict, timeline: StepTimeline, started: float, ended: float) -> None:
        """The forward/backward of ``[started, ended]`` is done: takes a finished update."""

    def count_waits(self, seconds: float, timing: dict) -> None:
        """The forward/backward waited ``seconds`` for the update (its top-level leaves, then layers)."""

    def run(self, grad_scale: float, skip: bool, timing: dict, timeline: StepTimeline) -> None:
        """The update of this step (``skip``: an overflowed step, nothing is touched)."""

    def finish(self) -> None:
        """Waits for a running update and takes what it left; raises its error."""

    def abandon(self) -> None:
        """Waits for a running update without raising (another error is being reported)."""


class SequentialUpdates:
    """The update on the trainer's thread, after the forward/backward."""

    def __init__(self, state: OffloadedAdamState, weights: ComputeWeights, settings: AdamWSettings):
        self._state, self._weights, self._settings = state, weights, settings

    def before_forward(self) -> float:
        return 0.0

    def after_forward(self, timing: dict, timeline: StepTimeline, started: float, ended: float) -> None:
        pass

    def count_waits(self, seconds: float, timing: dict) -> None:
        pass  # nothing to wait for: the update ran after the previous forward/backward

    def run(self, grad_scale: float, skip: bool, timing: dict, timeline: StepTimeline) -> None:
        if not skip:  # the step emits new leaves; the old ones need not outlive it
            self._weights.release_updated()
        trace: list = []
        new_params, _ = ssd_adamw_step(self._settings, ssd_adamw_state(self._state), self._state,
                                       grad_scale=grad_scale, skip=skip, trace=trace)
        timeline.add_update(trace, {})
        if new_params is not None:
            self._weights.put_all(jax.tree.leaves(new_params, is_leaf=lambda x: x is None))
            timing.update(optimizer_timing(self._state.last_step))

    def finish(self) -> None:
        pass

    def abandon(self) -> None:
        pass


class OverlappedUpdates:
    """The update of step t on a thread beside step t+1's forward/backward."""

    def __init__(self, state: OffloadedAdamState, weights: ComputeWeights, settings: AdamWSettings):
        self._state, self._weights, self._settings = state, weights, settings
        self._running: Optional[BackgroundUpdate] = None
        self._front_taken: Optional[BackgroundUpdate] = None  # whose top-level leaves are whole already
        self._previous: Optional[BackgroundUpdate] = None  # the update the forward/backward in flight follows
        self._front_wait = 0.0

    def before_forward(self) -> float:
        previous, self._running = self._running, None
        self._previous, self._front_wait = previous, 0.0
        if previous is None:
            return 0.0
        try:  # the new embeddings, norm and head; the stack follows layer by layer
            self._front_wait = previous.wait_front()
        except BaseException:
            previous.join_quietly()
            raise
        previous.leaves = self._weights.whole(previous.leaves)  # a job: every process's slices
        self._front_taken = previous
        self._weights.put(previous.leaves)
        return self._front_wait

    def after_forward(self, timing: dict, timeline: StepTimeline, started: float, ended: float) -> None:
        previous, self._previous = self._previous, None
        if previous is None:
            return
        # Done by now: the forward has used every layer it updated.
        self._take(previous, timing)
        timeline.add_update(previous.trace, previous.layer_ready_at)
        timing["overlap_fraction"] = previous.overlap_with(started, ended)

    def count_waits(self, seconds: float, timing: dict) -> None:
        timing["optimizer_wait_seconds"] = seconds

    def run(self, grad_scale: float, skip: bool, timing: dict, timeline: StepTimeline) -> None:
        if skip:
            self._state.step(None, skip=True)  # forgets the gradients; the weights stay as they are
            return
        scalars = self._settings.scalars(self._state.updates_applied, grad_scale)
        self._weights.release_updated()  # replaced by the update's; the old ones need not outlive it
        source = self._weights.source
        if source is not None:
            # The next forward waits for each layer's update; streamed weights are handed to it in memory.
            source.gate(handover=self._weights.kind == "ssd")
        self._running = BackgroundUpdate(self._state, scalars, source=source, outputs=self._weights.host,
                                         put=to_default_device, trace=True).start()

    def finish(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            self._take(running, {})

    def abandon(self) -> None:
        for update in (self._previous, self._running):
            if update is not None:
                update.join_quietly()  # its own error, if any, explains the failure
        self._previous = self._running = None

    def _take(self, update: BackgroundUpdate, timing: dict) -> None:
        """Joins ``update`` and takes its new leaves and its figures (into ``timing``); raises its error."""
        stats = update.join()
        if update is not self._front_taken:
            update.leaves = self._weights.whole(update.leaves)
        self._front_taken = None
        self._weights.put(update.leaves)
        timing.update(optimizer_timing(stats))
