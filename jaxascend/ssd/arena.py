"""The host arena: one pinned, preallocated allocation from which every staging buffer is carved.

Host memory for the optimizer step and the SSD engine stays fixed however large the model:
the whole arena is allocated once (4096-aligned, or 2 MiB-aligned and advised into transparent
huge pages with ``offload.huge_pages`` so that an ``O_DIRECT`` block leaves as one disk request;
``mlock``'ed, and registered with the CUDA runtime as pinned memory when a CUDA device is
present), every buffer is carved from it at
start-up at its exact size (rounded only to the 4096-byte I/O alignment), and the buffers are
reused every step. Plan first, then allocate::

    plan = ArenaPlan()
    plan.add("mlp", 3 * 4 * chunk_elems, count=3)       # shape class, bytes, how many
    plan.extend(SsdStore.arena_requests(cfg))           # the store's staging slots
    with HostArena(plan, cfg) as arena:                 # too small a budget: ArenaError
        slot = arena.acquire("mlp", nbytes)             # a free slot of that class
        x = arena.array(slot, np.float32)               # zero-copy numpy view
        ...
        arena.release(slot)

The arena's size is ``offload.arena_bytes`` or, when unset, exactly what the plan needs; either
way it must fit ``offload.host_memory_budget`` (when set) and the machine's RAM. If ``mlock`` is
refused (RLIMIT_MEMLOCK) the arena works unlocked and says so once in the log; ``locked`` and
``pinned`` report what happened, ``lock_status`` / ``pin_status`` say why.

``offload.pow2_buffers`` (an ablation switch, see docs/architecture.md) rounds every planned
buffer up to a power of two bytes, as allocators with power-of-two size classes (PyTorch's
pinned-memory caching allocator, behind ZeRO-Infinity's pinned buffers) do. The whole arena
is written at allocation, so the rounding costs real resident memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import numpy as np

from jaxascend.native import extension as _native
from jaxascend.config import OffloadConfig

log = logging.getLogger(__name__)

ArenaError = _native.ArenaError  # RuntimeError subclass; the message names bytes needed/available

IO_ALIGNMENT = 4096


def round_to_alignment(nbytes: int) -> int:
    """``nbytes`` rounded up to the 4096-byte I/O alignment (the only rounding the arena does)."""
    return -(-int(nbytes) // IO_ALIGNMENT) * IO_ALIGNMENT


def next_power_of_two(nbytes: int) -> int:
    """The smallest power of two >= ``nbytes`` (>= 1)."""
    return 1 << max(int(nbytes) - 1, 0).bit_length()


def format_bytes(n: int) -> str:
    """``"1048576 bytes (1.00 MiB)"``: exact, and readable."""
    mib = n / 2**20
    return f"{n} bytes ({mib / 1024:.2f} GiB)" if mib >= 1024 else f"{n} bytes ({mib:.2f} MiB)"


def physical_memory_bytes() -> int:
    """Total RAM of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class SlotRequest:
    """``count`` slots of ``nbytes`` bytes for ``shape_class`` (any tag: "attention", "mlp", ...)."""

    shape_class: str
    nbytes: int
    count: int = 1

    def __post_init__(self):
        if not isinstance(self.shape_class, str) or not self.shape_class:
            raise ValueError(f"SlotRequest.shape_class: must be a non-empty string, got {self.shape_class!r}")
        if int(self.nbytes) < 1:
            raise ValueError(f"SlotRequest.nbytes: must be >= 1, got {self.nbytes!r} ({self.shape_class!r})")
        if int(self.count) < 1:
            raise ValueError(f"SlotRequest.count: must be >= 1, got {self.count!r} ({self.shape_class!r})")

    @property
    def total_bytes(self) -> int:
        return round_to_alignment(self.nbytes) * self.count


@dataclass
class ArenaPlan:
    """Every buffer the arena will hold, decided before anything is allocated."""

    requests: list[SlotRequest] = field(default_factory=list)

    def add(self, shape_class: str, nbytes: int, count: int = 1) -> "ArenaPlan":
        """Adds ``count`` slots of ``nbytes`` for ``shape_class``; returns the plan (chainable)."""
        self.requests.append(SlotRequest(shape_class, int(nbytes), int(count)))
        return self

    def extend(self, requests: Iterable[SlotRequest]) -> "ArenaPlan":
        self.requests.extend(requests)
        return self

    @property
    def total_bytes(self) -> int:
        return sum(r.total_bytes for r in self.requests)

    def rounded_to_power_of_two(self) -> "ArenaPlan":
        """The same slots, each rounded up to a power of two bytes (the ``pow2_buffers`` ablation)."""
        return ArenaPlan([SlotRequest(r.shape_class, next_power_of_two(r.nbytes), r.count) for r in self.requests])

    def bytes_by_class(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.requests:
            out[r.shape_class] = out.get(r.shape_class, 0) + r.total_bytes
        return out


@dataclass(frozen=True)
class Slot:
    """One carved buffer: ``nbytes`` as planned, ``capacity`` rounded up to 4096."""

    id: int
    shape_class: str
    offset: int
    nbytes: int
    capacity: int


def arena_shortfall(plan: ArenaPlan, cfg: OffloadConfig) -> Optional[str]:
    """Why ``offload.arena_bytes`` cannot hold ``plan`` (None: it can, or it is unset): the
    check :class:`HostArena` makes before allocating, for the run planner to make first."""
    if cfg.arena_bytes is None:
        return None
    needed, capacity = plan.total_bytes, round_to_alignment(cfg.arena_bytes)
    if needed <= capacity:
        return None
    by_class = ", ".join(f"{k}: {v}" for k, v in sorted(plan.bytes_by_class().items())) or "empty plan"
    largest = max(plan.requests, key=lambda r: round_to_alignment(r.nbytes))
    return (f"offload.arena_bytes: the arena plan needs {format_bytes(needed)} ({by_class}; the largest slot "
            f"{largest.shape_class!r}, {format_bytes(round_to_alignment(largest.nbytes))}) but offload.arena_bytes is "
            f"{format_bytes(capacity)}; raise offload.arena_bytes or shrink offload.chunk_bytes")


def resolve_capacity(plan: ArenaPlan, cfg: OffloadConfig) -> int:
    """The arena size for ``plan`` under ``cfg``; raises :class:`ArenaError` when it cannot fit."""
    needed = plan.total_bytes
    by_class = ", ".join(f"{k}: {v}" for k, v in sorted(plan.bytes_by_class().items())) or "empty plan"
    shortfall = arena_shortfall(plan, cfg)
    if shortfall is not None:
        raise ArenaError(shortfall)
    capacity = max(needed, IO_ALIGNMENT) if cfg.arena_bytes is None else round_to_alignment(cfg.arena_bytes)
    budget = cfg.host_memory_budget
    if budget is not None and capacity > budget:
        raise ArenaError(
            f"arena needs {format_bytes(capacity)} ({by_class}) but offload.host_memory_budget is "
            f"{format_bytes(budget)}; raise the budget or shrink offload.chunk_bytes")
    ram = physical_memory_bytes()
    if capacity > ram:
        raise ArenaError(f"arena needs {format_bytes(capacity)} but this machine has {format_bytes(ram)} of RAM")
    return capacity


class HostArena:
    """Owner of the native arena: carves ``plan`` at construction, hands out slots, reports usage."""

    def __init__(self, plan: ArenaPlan, cfg: Optional[OffloadConfig] = None):
        cfg = cfg if cfg is not None else OffloadConfig()
        if cfg.pow2_buffers:
            plan = plan.rounded_to_power_of_two()
        capacity = resolve_capacity(plan, cfg)
        self._native = _native.Arena.create(
            capacity, [(r.shape_class, int(r.nbytes), int(r.count)) for r in plan.requests],
            lock_memory=cfg.lock_memory, pin_memory=cfg.pin_memory, huge_pages=cfg.huge_pages)
        self._slots = [Slot(*row) for row in self._native.slots()]
        if cfg.lock_memory and not self._native.locked:
            log.warning("host arena: %s", self._native.lock_status)
        log.info("host arena: %s carved into %d slots; lock: %s; pin: %s; huge pages: %s", format_bytes(capacity),
                 len(self._slots), self._native.lock_status, self._native.pin_status,
                 self._native.huge_page_status)

    # ------------------------------------------------------------------ reporting
    @property
    def native(self):
        """The ``jaxascend._native.Arena`` (for the SSD store and native kernels)."""
        if self._native is None:
            raise ValueError("host arena is closed")
        return self._native

    @property
    def capacity(self) -> int:
        return self.native.capacity

    @property
    def carved_bytes(self) -> int:
        """Bytes of all planned slots (fixed after construction)."""
        return self.native.carved_bytes

    @property
    def in_use_bytes(self) -> int:
        """Bytes of the slots currently acquired."""
        return self.native.in_use_bytes

    @property
    def high_water_bytes(self) -> int:
        """The most bytes ever acquired at once."""
        return self.native.high_water_bytes

    @property
    def locked(self) -> bool:
        return self.native.locked

    @property
    def pinned(self) -> bool:
        return self.native.pinned

    @property
    def lock_status(self) -> str:
        return self.native.lock_status

    @property
    def pin_status(self) -> str:
        return self.native.pin_status

    @property
    def huge_page_status(self) -> str:
        """Whether the arena was advised into 2 MiB transparent huge pages (fewer, larger disk requests)."""
        return self.native.huge_page_status

    def stats(self) -> dict:
        return {
            "capacity": self.capacity, "carved_bytes": self.carved_bytes, "in_use_bytes": self.in_use_bytes,
            "high_water_bytes": self.high_water_bytes, "locked": self.locked, "pinned": self.pinned,
            "slots": len(self._slots),
        }

    # ------------------------------------------------------------------ slots
    def slots(self, shape_class: Optional[str] = None) -> list[Slot]:
        """Every carved slot, or those of one shape class."""
        return [s for s in self._slots if shape_class is None or s.shape_class == shape_class]

    def acquire(self, shape_class: str, nbytes: int) -> Slot:
        """The smallest free slot of ``shape_class`` holding ``nbytes``; :class:`ArenaError` if none."""
        return self._slots[self.native.acquire(shape_class, int(nbytes))]

    def release(self, slot: Slot) -> None:
        self.native.release(slot.id)

    @contextlib.contextmanager
    def borrow(self, shape_class: str, nbytes: int) -> Iterator[Slot]:
        """``with arena.borrow("mlp", n) as slot:`` acquires and always releases."""
        slot = self.acquire(shape_class, nbytes)
        try:
            yield slot
        finally:
            self.release(slot)

    def array(self, slot: Slot, dtype=np.uint8, shape=None) -> np.ndarray:
        """A zero-copy numpy view of ``slot`` (its planned nbytes) as ``dtype``, optionally reshaped."""
        view = self.native.view(slot.id)
        dtype = np.dtype(dtype)
        if slot.nbytes % dtype.itemsize:
            raise ValueError(f"slot {slot.id} ({slot.shape_class!r}) holds {slot.nbytes} bytes, "
                             f"not a whole number of {dtype} elements")
        out = view.view(dtype)
        return out if shape is None else out.reshape(shape)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Drops this owner's reference: the memory is freed (unpinned, unlocked) as soon as no
        store, stream or numpy view still uses it. Idempotent."""
        self._native = None

    @property
    def closed(self) -> bool:
        return self._native is None

    def __enter__(self) -> "HostArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "HostArena(closed)"
        return (f"HostArena(capacity={self.capacity}, carved={self.carved_bytes}, in_use={self.in_use_bytes}, "
                f"high_water={self.high_water_bytes}, locked={self.locked}, pinned={self.pinned})")
