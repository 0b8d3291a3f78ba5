"""The overlapped step: the optimizer of step t runs on a thread while step t+1's forward runs.

AdamW needs the global norm and the overflow flag, so it starts only once the backward pass of
step t has finished. It then updates the chunks in the forward's order
(:meth:`~jaxascend.offload.layout.OffloadLayout.step_order`): the leaves outside the layer stack
first, then the stack layer by layer. :class:`BackgroundUpdate` runs that update on a thread
(the fused kernel and the SSD I/O release the GIL) and reports progress two ways:

* every leaf outside the stack (embeddings, final norm, head) is handed over, as a new array,
  as soon as its last chunk is done; the engine dispatches step t+1's forward/backward once it
  has all of them (:meth:`wait_front`);
* each layer of the stack is marked ready in the parameter source
  (:meth:`~jaxascend.offload.param_source.ParamSource.mark_ready`) once every stacked leaf of it
  holds its new weights: in host memory (resident weights, served by the source from the
  buffers the kernel writes) or written to SSD (streamed weights). The forward's fetch of a
  layer waits for that; streamed weights are also handed to the source in a slot as the kernel
  emits them (no SSD read for the forward, see ``ParamSource.acquire_handover``).

The arithmetic is the non-overlapped step's: same kernel, same scalars, same chunks (the order
of chunks does not change any value). The gradient sink refuses a gradient for a region the
optimizer has not read yet (:meth:`~jaxascend.offload.store_sink.StoreGradientSink.hold`), so
a broken ordering is an error, not a silent corruption.

    update = BackgroundUpdate(state, scalars, source=source, outputs=resident, put=put)
    update.start()
    waited = update.wait_front()      # the new top-level leaves: update.leaves
    ...                               # dispatch the next forward/backward
    stats = update.join()             # the update's StepStats; raises its error
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Optional

import numpy as np

from jaxascend.offload.param_source import ParamSource
from jaxascend.offload.state import OffloadedAdamState
from jaxascend.offload.streamed_update import StepStats


# XLA's CPU compute threads (Eigen's pool) by their thread name.
COMPUTE_THREAD_NAMES = ("tf_XLAEigen",)
COMPUTE_NICE = 10


def deprioritize_compute_threads(nice: int = COMPUTE_NICE) -> int:
    """Runs XLA's CPU compute threads at scheduling priority ``nice`` (Linux; no privilege needed
    to lower a priority); returns how many threads were changed.

    On a machine where the forward/backward and the optimizer share the CPU cores, the update
    is the critical path of an overlapped step (the next backward can start only once the update
    has served the last layer), and the forward only fills the time the update waits for the
    disk. Under contention the kernel then gives the cores to the update first; when nothing
    else runs, a nice value costs nothing. The change lasts for the process (taking a priority
    back up needs CAP_SYS_NICE); threads XLA starts later are caught at the next update."""
    changed = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name in COMPUTE_THREAD_NAMES and os.getpriority(os.PRIO_PROCESS, int(tid)) < nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                changed += 1
        except OSError:  # the thread ended, or the system refuses: only the speed is at stake
            continue
    return changed


class BackgroundUpdate:
    """One streamed AdamW update of ``state`` on its own thread (see the module docstring).

    ``outputs``: leaf index -> flat host array the kernel writes that leaf's new weights into
    (resident stacked weights served by ``source``); every other leaf outside the stream comes
    back through ``put`` into :attr:`leaves`. ``source``: the parameter source to mark layers
    ready in (None: nothing waits on the layers)."""

    def __init__(self, state: OffloadedAdamState, scalars: np.ndarray, *, source: Optional[ParamSource],
                 outputs: Optional[dict[int, np.ndarray]], put: Callable[[np.ndarray], object],
                 trace: bool = False):
        self._state = state
        self._scalars = scalars
        self._source = source
        self._outputs = outputs or {}
        self._put = put
        # The leaves the next forward takes as inputs: everything not served by the source.
        self._front_needed = {leaf.index for leaf in state.leaves
                              if not leaf.streamed and leaf.index not in self._outputs}
        self.leaves: dict[int, object] = {}
        self.error: Optional[BaseException] = None
        self.stats: Optional[StepStats] = None
        self.started = 0.0
        self.ended = 0.0
        self.trace: Optional[list] = [] if trace else None  # per chunk: (what, begin, end, leaf, layer)
        self.layer_ready_at: dict[int, float] = {}
        self._front = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxascend-optimizer", daemon=True)

    def start(self) -> "BackgroundUpdate":
        self.started = time.perf_counter()
        deprioritize_compute_threads()
        if not self._front_needed:
            self._front.set()
        self._thread.start()
        return self

    def _on_leaf(self, leaf, host: np.ndarray) -> None:
        if leaf.index in self._outputs:  # written in place; the source serves it
            return
        self.leaves[leaf.index] = self._put(host)
        if not self._front.is_set() and self._front_needed <= self.leaves.keys():
            self._front.set()

    def _on_layer(self, layer: int) -> None:
        self.layer_ready_at[layer] = time.perf_counter()
        if self._source is not None:
            self._source.mark_ready(layer)

    def _run(self) -> None:
        try:
            # Streamed weights go to the next forward in memory (handover) as well as to SSD.
            handover = self._source if self._source is not None and not self._outputs else None
            self.stats = self._state.apply_update(self._scalars, self._on_leaf, on_layer=self._on_layer,
                                                  outputs=self._outputs, trace=self.trace, handover=handover)
        except BaseException as err:  # reported by wait_front/join, on the trainer's thread
            self.error = err
            if self._source is not None:
                self._source.fail(f"the optimizer step failed: {type(err).__name__}: {err}")
        finally:
            self.ended = time.perf_counter()
            self._front.set()
            self._done.set()

    def wait_front(self) -> float:
        """Waits until every leaf the next forward takes as input is updated (:attr:`leaves`);
        returns the seconds waited. Raises the update's error."""
        start = time.perf_counter()
        self._front.wait()
        waited = time.perf_counter() - start
        if self.error is not None:
            self.join()
        return waited

    def join(self) -> StepStats:
        """Waits for the whole update; returns its :class:`StepStats` or raises its error."""
        self._end_handover_waits()
        self._done.wait()
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.stats

    def join_quietly(self) -> None:
        """Waits for the thread without raising (when another error is already being reported)."""
        self._end_handover_waits()
        self._done.wait()
        self._thread.join()

    def _end_handover_waits(self) -> None:
        """Joined, the update has no forward to hand layers to (after a step's backward every
        layer has been taken already): it stops waiting for one."""
        if self._source is not None and not self._done.is_set():
            self._source.end_handover_waits()

    def overlap_with(self, begin: float, end: float) -> float:
        """The fraction of this update's wall time that ran inside ``[begin, end]`` (e.g. the
        next step's forward/backward)."""
        duration = self.ended - self.started
        if duration <= 0:
            return 0.0
        return max(0.0, min(self.ended, end) - max(self.started, begin)) / duration
