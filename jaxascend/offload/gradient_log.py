"""Durable steps with the gradients in RAM (``offload.gradients: host``): their redo log on SSD.

An interrupted update is redone from its step's gradients (:mod:`~jaxascend.offload.durable_records`).
With ``offload.gradients: host`` those live in this process's memory and die with it, so each is
written to its twin region on SSD (``durable/gradlog/<region>``) as well, as it arrives: the sink
writes every layer's whole gradient to both (``ffi/offload_store_sink.cc``'s mirrors) while the
backward goes on, and ``write_grads`` writes both. The update is journaled once the store is
synced (``DurableRecords.begin``), so the log is durable with it; a resume that rolls an update
forward copies the twins back first. A twin is overwritten only once the update that needed it
has committed its layer (the sink refuses a gradient for a region until then), so the log of the
update in flight is whole wherever the roll-forward reads it. The log is written once a step and
read only by a resume: 2 B/param of SSD writes a step, where gradients on SSD cost 2 written by
the backward and 2 read by the update, and the twin regions' 2 B/param of disk.
"""

from __future__ import annotations

from jaxascend.ssd import SsdStore

LOG_PREFIX = "durable/gradlog/"


def log_regions(layout) -> list[tuple[str, int]]:
    """(name, bytes) of the log's regions: a twin of each in-memory gradient region (none unless
    ``layout.grad_store`` is host; with ``host_grad_layers``, of those layers' only)."""
    return [(LOG_PREFIX + region, nbytes) for region, nbytes in layout.grad_regions_in(ram=True)]


class GradientLog:
    """Owner of the twin regions (added to the store by the records' maker, after all others)."""

    def __init__(self, store: SsdStore, layout):
        self.store = store
        regions = log_regions(layout)
        self.pairs = [(name[len(LOG_PREFIX):], name) for name, _ in regions]
        self.nbytes = sum(nbytes for _, nbytes in regions)  # its disk

    def restore(self) -> None:
        """Each gradient region from its twin (a resume, before the update is rolled forward)."""
        for region, twin in self.pairs:
            self.store.write(region, self.store.read(twin))
