"""What a run will write to disk, grouped by the filesystem it lands on, against the free space.

    parts = run_disk_parts(cfg, offload_bytes, checkpoint_bytes, weights_bytes)
    for fs in disk_use(parts): fs.short     # bytes missing on that filesystem (<= 0: fits)

The parts: the offload shard files (``offload.dir``), the checkpoints kept at once
(``checkpoint.keep_last``, plus the one being written, as Orbax deletes the oldest only once a
save is complete; fewer when the run saves fewer times), and the end-of-run weights
(``params.safetensors`` in ``train.out_dir``, the Hugging Face export in ``export.dir``). Folders
that do not exist yet are placed on the filesystem of their nearest existing parent, and
folders on one filesystem (``os.stat().st_dev``) share its free space. What a run reuses counts
as free: the shard files already in ``offload.dir`` (a run reopens them) and the checkpoints
already in ``checkpoint.dir`` (they are among those kept).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from jaxascend.config import Config
from jaxascend.planning.machine_limits import filesystem_of


@dataclass(frozen=True)
class DiskPart:
    """Bytes one kind of file needs in the folder a config field names."""

    name: str  # "offload files", "checkpoints", "params.safetensors", "export"
    field: str  # the config field that places it: "offload.dir", "checkpoint.dir", ...
    folder: str
    nbytes: int
    reused: int = 0  # bytes of it already on disk (free for this run)
    frees_at_end: int = 0  # bytes it gives back once the last step is done (the offloaded gradients)
    at_end: bool = False  # written once the last step is done (params.safetensors, the export)


@dataclass(frozen=True)
class FilesystemUse:
    """The parts that land on one filesystem, and its free space."""

    folder: str  # the folder probed (the nearest existing one of the first part)
    free: int  # free bytes there, plus what the run reuses
    parts: tuple[DiskPart, ...]

    @property
    def shared_at_end(self) -> int:
        """Bytes of the end-of-run outputs that land in the space freed at the end (on this filesystem)."""
        return min(sum(p.frees_at_end for p in self.parts), sum(p.nbytes for p in self.parts if p.at_end))

    @property
    def need(self) -> int:
        """The high-water mark: every part, less what the outputs reuse of the space freed at the end."""
        return sum(p.nbytes for p in self.parts) - self.shared_at_end

    @property
    def short(self) -> int:
        return self.need - self.free


def checkpoints_kept(cfg: Config) -> int:
    """How many checkpoints are on disk at once: ``keep_last`` plus the one being written, or
    every save of a run that saves fewer times (``every_steps``, and one at the end). A run that
    also saves by the clock (``every_minutes``) may save at any step."""
    every, steps = cfg.checkpoint.every_steps, cfg.train.steps
    if steps is None:  # train.epochs, the data not read yet (the planner): the most a run keeps
        return cfg.checkpoint.keep_last + 1 if every > 0 or cfg.checkpoint.every_minutes > 0 else int(cfg.checkpoint.final)
    final = {steps} if cfg.checkpoint.final else set()
    if cfg.checkpoint.every_minutes > 0:
        saves = steps
    else:
        saves = len({s for s in range(every, steps + 1, every)} | final) if every > 0 else len(final)
    return min(cfg.checkpoint.keep_last + 1, saves)


def _shard_bytes(directory: str) -> int:
    """Bytes of the shard files already in ``directory`` (a run reopens and truncates them)."""
    if not os.path.isdir(directory):
        return 0
    return sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
               if name.startswith("shard-") and name.endswith(".bin"))


def _saved_steps(directory: str) -> int:
    """Complete checkpoints already in ``directory`` (Orbax names a step's folder by its number)."""
    if not os.path.isdir(directory):
        return 0
    return sum(1 for name in os.listdir(directory) if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


def run_disk_parts(cfg: Config, offload_bytes: int, checkpoint_bytes: int, weights_bytes: int,
                   export_bytes: int, grad_bytes: int = 0) -> list[DiskPart]:
    """The run's files: offload shards, the checkpoints kept, ``params.safetensors``, the export.
    ``grad_bytes``: the offloaded gradients' part of the shards, freed when the last step is done
    (unless ``offload.keep_files``), where the end-of-run outputs may land."""
    out_dir = str(cfg.train.out_dir)
    offload_dir = str(cfg.offload.dir or os.path.join(out_dir, "offload"))
    checkpoint_dir = str(cfg.checkpoint.dir or os.path.join(out_dir, "checkpoints"))
    kept = checkpoints_kept(cfg)
    saved = min(_saved_steps(checkpoint_dir), kept)
    frees = 0 if cfg.offload.keep_files else grad_bytes
    parts = [DiskPart("offload files", "offload.dir", offload_dir, offload_bytes,
                      min(_shard_bytes(offload_dir), offload_bytes), frees) if offload_bytes else None,
             DiskPart(f"checkpoints ({kept} kept at once)", "checkpoint.dir", checkpoint_dir,
                      kept * checkpoint_bytes, saved * checkpoint_bytes),
             DiskPart("params.safetensors", "train.out_dir", out_dir, weights_bytes, at_end=True)
             if cfg.export.save_params else None,
             DiskPart("export", "export.dir", str(cfg.export.dir or os.path.join(out_dir, "hf")), export_bytes,
                      at_end=True) if cfg.export.enabled else None]
    return [p for p in parts if p is not None and p.nbytes > 0]


def disk_use(parts: list[DiskPart]) -> tuple[FilesystemUse, ...]:
    """``parts`` grouped by filesystem, each group with that filesystem's free space."""
    groups: dict[int, tuple[str, list[DiskPart]]] = {}
    for part in parts:
        device, probe = filesystem_of(part.folder)
        groups.setdefault(device, (probe, []))[1].append(part)
    return tuple(FilesystemUse(probe, shutil.disk_usage(probe).free + sum(p.reused for p in group), tuple(group))
                 for probe, group in groups.values())
