"""What this machine can give a run, read when the plan is made: host memory and free disk.

    memory = available_host_memory()        # HostMemory(available=..., source="MemAvailable")
    filesystem_of("/ssd/run/offload")       # (st_dev, the nearest existing folder)

Host memory is the smaller of the kernel's ``MemAvailable`` (``/proc/meminfo``: free memory
plus what it can reclaim without swapping) and what the process's memory cgroup still allows
(v2: ``memory.max`` minus ``memory.current``; v1: ``memory.limit_in_bytes`` minus
``memory.usage_in_bytes``; the cgroup's reclaimable file pages, ``inactive_file``, are counted as
available, as the kernel reclaims them before it kills), over every level of the cgroup tree.
``JAXASCEND_MEM_AVAILABLE_BYTES`` (bytes, or a size such as ``23GiB``) replaces the reading: the
tests use it, and so can a user who shares the machine with something that has yet to start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from jaxascend.config import ConfigError, parse_bytes

MEM_AVAILABLE_ENV = "JAXASCEND_MEM_AVAILABLE_BYTES"
_UNLIMITED = 2**60  # cgroup v1 reports "no limit" as a huge page-rounded number


@dataclass(frozen=True)
class HostMemory:
    """Bytes a new allocation can take now, and where the figure comes from."""

    available: int
    source: str  # "MemAvailable", "cgroup memory.max (/sys/fs/cgroup/...)", or the variable's name


def available_host_memory() -> Optional[HostMemory]:
    """The memory this process can still take, or None where no figure can be read."""
    override = os.environ.get(MEM_AVAILABLE_ENV)
    if override is not None:
        try:
            return HostMemory(parse_bytes(override.strip(), MEM_AVAILABLE_ENV), MEM_AVAILABLE_ENV)
        except ConfigError as err:
            raise ConfigError(f"{err} (environment variable)") from None
    readings = [r for r in (_meminfo_available(), *cgroup_headroom()) if r is not None]
    return min(readings, key=lambda r: r.available) if readings else None


def _meminfo_available(path: str = "/proc/meminfo") -> Optional[HostMemory]:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return HostMemory(int(line.split()[1]) * 1024, "MemAvailable")
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_mounts(mountinfo: list[str]) -> list[tuple[int, str, Path]]:
    """(cgroup version, root inside the hierarchy, mount point) of every memory cgroup mount."""
    out = []
    for line in mountinfo:
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            out.append((2, fields[3], Path(fields[4])))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            out.append((1, fields[3], Path(fields[4])))
    return out


def _cgroup_dirs(proc: str = "/proc/self") -> list[tuple[int, Path]]:
    """(cgroup version, folder) of the process's memory cgroup and each of its parents up to the
    mount, as ``/proc/self/cgroup`` and ``/proc/self/mountinfo`` place them."""
    try:
        memberships = Path(proc, "cgroup").read_text().splitlines()
        mounts = _cgroup_mounts(Path(proc, "mountinfo").read_text().splitlines())
    except OSError:
        return []
    out = []
    for line in memberships:
        _, controllers, group = line.split(":", 2)
        version = 2 if controllers == "" else 1 if "memory" in controllers.split(",") else 0
        for mount_version, root, point in mounts:
            if mount_version != version or not group.startswith(root):
                continue
            folder = Path(os.path.normpath(point / os.path.relpath(group, root)))
            while True:  # a limit anywhere above the process applies to it
                out.append((version, folder))
                if folder == point or folder == folder.parent:
                    break
                folder = folder.parent
    return out


def cgroup_headroom(proc: str = "/proc/self") -> list[HostMemory]:
    """What each memory cgroup above the process still allows (none: no limit set)."""
    out = []
    for version, folder in _cgroup_dirs(proc):
        if version == 2:
            limit, usage = _read_int(folder / "memory.max"), _read_int(folder / "memory.current")
            name, reclaimable = "memory.max", _stat_value(folder / "memory.stat", "inactive_file")
        else:
            limit, usage = _read_int(folder / "memory.limit_in_bytes"), _read_int(folder / "memory.usage_in_bytes")
            name, reclaimable = "memory.limit_in_bytes", _stat_value(folder / "memory.stat", "total_inactive_file")
        if limit is None or usage is None or limit >= _UNLIMITED:
            continue
        out.append(HostMemory(max(limit - usage + reclaimable, 0), f"cgroup {name} ({folder})"))
    return out


def filesystem_of(directory: str) -> tuple[int, str]:
    """``(st_dev, folder)`` of the filesystem that will hold ``directory``: its nearest existing
    parent's (the folder may not exist yet)."""
    probe = os.path.abspath(os.path.expanduser(directory))
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return os.stat(probe).st_dev, probe
