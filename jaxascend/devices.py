"""The run's devices: what each local device is, how much memory it has and how much it uses.

    devices = read_devices()                # [DeviceMemory(platform="gpu", kind="NVIDIA H200", ...)]
    print(backend_line(devices))            # "backend: gpu, 1 device: NVIDIA H200 (139.8 GiB)"
    device_capacity()                       # DeviceCapacity(nbytes, source), or None: host RAM (CPU)
    monitor = DeviceMonitor()
    record.update(monitor.record())         # {"device_mem_bytes": ..., ...}, or {} where not reported

A device's figures come from ``device.memory_stats()`` where the backend reports them (a GPU's
``bytes_limit``, ``bytes_in_use``, ``peak_bytes_in_use``). JAX's CPU backend reports none: its
device memory is host RAM, which the plan already counts. ``JAXASCEND_DEVICE_MEM_BYTES`` (bytes,
or a size such as ``4GiB``) sets every local device's capacity; on a backend without
``memory_stats`` the bytes in use are then measured from the live arrays on each device
(``jax.live_arrays()``, the device's own memory kind), so the GPU's code path (device memory in
the plan, the metrics and the progress bar) runs on CPU in the tests. There the peak is the
largest of the readings :class:`DeviceMonitor` took (at each logging point), not a high-water mark.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import jax

from jaxascend.config import ConfigError, parse_bytes

DEVICE_MEM_ENV = "JAXASCEND_DEVICE_MEM_BYTES"
MEMORY_STATS = "memory_stats"  # the source of a figure the backend reports


@dataclass(frozen=True)
class DeviceMemory:
    """One local device and its memory, as read now."""

    platform: str  # "cpu", "gpu", "tpu"
    kind: str  # device_kind: "cpu", "NVIDIA H200"
    capacity: Optional[int]  # bytes: memory_stats' bytes_limit or JAXASCEND_DEVICE_MEM_BYTES; None: not reported
    in_use: Optional[int]  # bytes: bytes_in_use, or the live arrays' under the variable; None: not reported
    peak: Optional[int]  # bytes: peak_bytes_in_use (under the variable: the reading itself); None: not reported
    source: str  # of the capacity: "memory_stats", "JAXASCEND_DEVICE_MEM_BYTES" or "" (none)


@dataclass(frozen=True)
class DeviceCapacity:
    """What the plan's device memory is checked against: the smallest local device's capacity."""

    nbytes: int
    source: str  # "memory_stats (NVIDIA H200)" or "JAXASCEND_DEVICE_MEM_BYTES"


def format_size(n: float) -> str:
    """``"139.8 GiB"``: one decimal, in the largest unit that keeps it at least 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def injected_capacity() -> Optional[int]:
    """``JAXASCEND_DEVICE_MEM_BYTES`` in bytes, or None when unset; a bad value is a
    :class:`ConfigError` naming the variable."""
    value = os.environ.get(DEVICE_MEM_ENV)
    if value is None:
        return None
    try:
        nbytes = parse_bytes(value.strip(), DEVICE_MEM_ENV)
    except ConfigError as err:
        raise ConfigError(f"{err} (environment variable)") from None
    if nbytes <= 0:
        raise ConfigError(f"{DEVICE_MEM_ENV}: must be > 0, got {value!r} (environment variable)")
    return nbytes


def live_array_bytes(devices: Sequence[jax.Device]) -> list[int]:
    """The bytes the live arrays hold in each device's own memory kind (not ``pinned_host``):
    each array's shard on each device it is placed on (a replicated array counts on each)."""
    kinds = [device.default_memory().kind for device in devices]
    out = [0] * len(devices)
    index = {device: i for i, device in enumerate(devices)}
    for array in jax.live_arrays():
        sharding = array.sharding
        shard = math.prod(sharding.shard_shape(array.shape)) * array.dtype.itemsize
        for device in sharding.addressable_devices:
            i = index.get(device)
            if i is not None and sharding.memory_kind in (None, kinds[i]):
                out[i] += shard
    return out


def read_devices(devices: Optional[Sequence[jax.Device]] = None) -> list[DeviceMemory]:
    """The memory of each of ``devices`` (default: this process's, ``jax.local_devices()``), as
    the module doc says; raises :class:`ConfigError` for a bad ``JAXASCEND_DEVICE_MEM_BYTES``."""
    devices = list(devices if devices is not None else jax.local_devices())
    injected = injected_capacity()
    stats = [device.memory_stats() or {} for device in devices]
    measured = live_array_bytes(devices) if injected is not None and not all(stats) else [0] * len(devices)
    out = []
    for device, stat, live in zip(devices, stats, measured):
        if stat:
            capacity = injected if injected is not None else stat.get("bytes_limit")
            source = DEVICE_MEM_ENV if injected is not None else MEMORY_STATS if capacity is not None else ""
            in_use, peak = stat.get("bytes_in_use"), stat.get("peak_bytes_in_use", stat.get("bytes_in_use"))
        elif injected is not None:
            capacity, source, in_use, peak = injected, DEVICE_MEM_ENV, live, live
        else:
            capacity, source, in_use, peak = None, "", None, None
        out.append(DeviceMemory(device.platform, device.device_kind, capacity, in_use, peak, source))
    return out


def device_capacity(devices: Optional[Sequence[DeviceMemory]] = None) -> Optional[DeviceCapacity]:
    """The smallest capacity of the local devices (``devices``: as read), or None where none is
    known: the CPU backend without ``JAXASCEND_DEVICE_MEM_BYTES``, whose device memory is host RAM."""
    devices = read_devices() if devices is None else devices
    known = [d for d in devices if d.capacity is not None]
    if not known:
        return None
    smallest = min(known, key=lambda d: d.capacity)
    source = f"{MEMORY_STATS} ({smallest.kind})" if smallest.source == MEMORY_STATS else smallest.source
    return DeviceCapacity(smallest.capacity, source)


def _memory_text(device: DeviceMemory, each: bool) -> str:
    if device.capacity is None:
        return "memory: host RAM" if device.platform == "cpu" else "memory: not reported"
    size = format_size(device.capacity) + (" each" if each else "")
    return size if device.source == MEMORY_STATS else f"{size}: {device.source}"


def backend_line(devices: Optional[Sequence[DeviceMemory]] = None) -> str:
    """The run's first line: ``"backend: gpu, 1 device: NVIDIA H200 (139.8 GiB)"``, ``"backend:
    cpu, 1 device: cpu (memory: host RAM)"``; in a job of several processes, this process's
    devices and the job's (``"; process 0 of 2, 16 devices in the job"``)."""
    devices = read_devices() if devices is None else devices
    groups: dict[tuple, int] = {}
    for device in devices:
        key = (device.kind, device.capacity, device.source, device.platform)
        groups[key] = groups.get(key, 0) + 1
    described = []
    for (kind, capacity, source, platform), count in groups.items():
        one = DeviceMemory(platform, kind, capacity, None, None, source)
        described.append(f"{'' if len(groups) == 1 else f'{count} x '}{kind} ({_memory_text(one, count > 1)})")
    n = len(devices)
    line = f"backend: {jax.default_backend()}, {n} device{'s' if n != 1 else ''}: {', '.join(described)}"
    if jax.process_count() > 1:
        line += f"; process {jax.process_index()} of {jax.process_count()}, {jax.device_count()} devices in the job"
    return line


def memory_fields(devices: Sequence[DeviceMemory]) -> dict[str, int]:
    """A metrics record's device memory: ``device_mem_bytes`` and ``device_mem_peak_bytes`` (the
    largest over the local devices: the one nearest its limit in a data-parallel job, whose
    devices hold the same weights) and ``device_mem_capacity_bytes`` (the smallest); empty where
    no device reports them."""
    reported = [d for d in devices if d.in_use is not None]
    if not reported:
        return {}
    out = {"device_mem_bytes": max(d.in_use for d in reported),
           "device_mem_peak_bytes": max(d.peak if d.peak is not None else d.in_use for d in reported)}
    capacities = [d.capacity for d in reported if d.capacity is not None]
    if capacities:
        out["device_mem_capacity_bytes"] = min(capacities)
    return out


class DeviceMonitor:
    """The local devices' memory over a run: each :meth:`record` reads them again and keeps each
    device's peak as the largest of its readings and what the backend reports."""

    def __init__(self, devices: Optional[Sequence[jax.Device]] = None):
        self._devices = list(devices if devices is not None else jax.local_devices())
        self._peaks: list[int] = [0] * len(self._devices)  # per device, in self._devices' order
        self._reported = False  # some device has reported its memory

    def read(self) -> list[DeviceMemory]:
        """The devices now, each peak raised to the largest reading so far."""
        out = []
        for i, device in enumerate(read_devices(self._devices)):
            if device.in_use is not None:
                self._peaks[i] = max(self._peaks[i], device.in_use, device.peak or 0)
                self._reported = True
                device = dataclasses.replace(device, peak=self._peaks[i])
            out.append(device)
        return out

    def record(self) -> dict[str, int]:
        """:func:`memory_fields` of a reading now (empty where no device reports its memory)."""
        return memory_fields(self.read())

    def peak(self) -> Optional[int]:
        """The largest peak of any local device so far, this reading included (None: none reported)."""
        self.read()
        return max(self._peaks) if self._reported else None
