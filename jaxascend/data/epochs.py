"""``train.epochs``: the optimizer steps that many passes over the data take, counted before the
run from its data index.

    cfg, count, lines = with_epoch_steps(cfg, stream)   # train.steps resolved (stream: at its start)
    count.line()    # 'steps: train.epochs 1 = 592 examples in 37 batches = 37 steps'

An epoch is every document (``data.format: text``) or example of the index (``data.max_documents``
of them at most) once, in ``data.seed``'s order for that epoch; the stream runs on from one epoch
into the next without a gap. ``train.epochs: E`` covers the first ``ceil(E x n)`` of them (a
fraction is the first part of an epoch's order): the batches are those the stream yields until
the last of them is in one (a batch may end with the next epoch's first tokens or examples), and
the steps are the batches over ``train.grad_accum``, rounded up, so every batch of the epochs is
trained on once: a last step whose accumulation group the epochs do not fill takes its other
micro-batches from the stream after them. The count reads and tokenizes every document or example
once (the streams' ``batches_to_cover``), on every process of a job alike: each process reads
every global batch and trains on its rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Union

from jaxascend.config import Config, ConfigError
from jaxascend.data.example_packing import ExampleStream
from jaxascend.data.packing import BatchStream


@dataclass(frozen=True)
class EpochCount:
    """What ``train.epochs`` came to on this data."""

    epochs: float  # train.epochs as asked
    unit: str  # "documents" (data.format: text) or "examples"
    per_epoch: int  # documents or examples in one epoch
    covered: int  # those of all the epochs: ceil(epochs x per_epoch)
    batches: int  # micro-batches until the last of them is in one
    grad_accum: int  # micro-batches per optimizer step
    steps: int  # ceil(batches / grad_accum): the run's train.steps

    def line(self) -> str:
        """One line of what the epochs came to (the plan's and the trainer's ``note:``)."""
        whole, part = divmod(self.covered, self.per_epoch)
        if not part:
            items = f"{self.per_epoch} {self.unit}" if whole == 1 else f"{whole} x {self.per_epoch} {self.unit}"
        elif not whole:
            items = f"{self.covered} of {self.per_epoch} {self.unit}"
        else:
            items = f"{self.covered} {self.unit} ({self.per_epoch} an epoch)"
        text = (f"steps: train.epochs {self.epochs:g} = {items} in {_counted(self.batches, 'batch', 'batches')} = "
                f"{_counted(self.steps, 'step', 'steps')}")
        extra = self.steps * self.grad_accum - self.batches
        if self.grad_accum > 1:
            text += f" of train.grad_accum {self.grad_accum} batches"
            if extra:
                text += f" (the last step's last {extra} {'batch comes' if extra == 1 else 'batches come'} after them)"
        return text

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _counted(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def count_epochs(stream: Union[BatchStream, ExampleStream], epochs: float, grad_accum: int) -> EpochCount:
    """The batches and steps of ``epochs`` passes over ``stream``'s data (see the module doc)."""
    per_epoch = stream.num_documents if isinstance(stream, BatchStream) else stream.num_examples
    covered = max(1, math.ceil(round(epochs * per_epoch, 6)))  # 0.1 x 30 is 3.0000000000000004
    batches = stream.batches_to_cover(covered)
    return EpochCount(epochs=epochs, unit="documents" if isinstance(stream, BatchStream) else "examples",
                      per_epoch=per_epoch, covered=covered, batches=batches, grad_accum=grad_accum,
                      steps=-(-batches // grad_accum))


def with_epoch_steps(cfg: Config, stream: Optional[Union[BatchStream, ExampleStream]]
                     ) -> tuple[Config, Optional[EpochCount], tuple[str, ...]]:
    """``cfg`` with ``train.steps`` resolved from ``train.epochs`` (and ``train.epochs`` then
    None: the resolved config says the steps it runs), the count, and its ``note:`` line. Without
    ``train.epochs``: ``cfg`` as it is. ``stream`` None (the planner without the data): the steps
    stay unknown (None), said in the line. Refuses a ``train.stop_at_step`` past the steps."""
    train = cfg.train
    if train.epochs is None:
        return cfg, None, ()
    if stream is None:
        return cfg, None, (f"steps: train.epochs {train.epochs:g}: not known until the data is read (the disk part "
                           "counts the most checkpoints the run can keep)",)
    count = count_epochs(stream, train.epochs, train.grad_accum)
    if train.stop_at_step is not None and train.stop_at_step > count.steps:
        raise ConfigError(f"train.stop_at_step: {train.stop_at_step} is past the run's last step, {count.steps} "
                          f"(train.epochs {train.epochs:g})")
    resolved = dataclasses.replace(cfg, train=dataclasses.replace(train, steps=count.steps, epochs=None))
    return resolved, count, (count.line(),)
