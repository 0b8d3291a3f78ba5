"""Checkpoints of a training run: an Orbax ``CheckpointManager`` directory, crash-safe and readable
without jaxascend.

One checkpoint is one step directory, written under a temporary name and renamed when every item
is complete (Orbax's atomic finalisation), so a process killed while saving leaves only a
``<step>.orbax-checkpoint-tmp-*`` directory, which is never listed, picked or restored (and is
removed the next time the directory is opened, with ``checkpoint.cleanup_partial``)::

    <checkpoint.dir>/<step>/
      _CHECKPOINT_METADATA   Orbax's step metadata
      params/                compute params: StandardSave (OCDBT + zarr), written asynchronously
      opt_state/             optional pytree of small arrays, e.g. an optax state (StandardSave)
      offloaded/             SSD-resident fp32 master/m/v, streamed through the arena (see
                             jaxascend.checkpoint.offloaded_item): one zarr array per tensor and leaf
      rng/                   optional {"key": uint32 key data} (StandardSave)
      meta/metadata          JSON: step, the run config, and the caller's meta (data stream
                             state, loss scale, ...)

The trainer's use (``state`` an :class:`~jaxascend.offload.OffloadedAdamState`, whose regions
:func:`jaxascend.offload.specs_for_offload_layout` describes)::

    ckpt = Checkpointer(cfg.checkpoint, run_config=cfg)           # context manager
    ssd = SsdArrays(state.store, specs_for_offload_layout(state.layout),
                    slot_class=STATE_SLOT_CLASS)                 # the step's slots are idle meanwhile
    step0 = ckpt.resume_step(cfg.train.resume)                   # None: fresh start
    if step0 is not None:
        r = ckpt.restore(step0, params_like=params, opt_state_like=opt_state, ssd=ssd)
        params, opt_state = r.params, r.opt_state
        state.restored(r.meta["updates_applied"])                # the shards were rebuilt
        stream = make_batch_stream(cfg.data, tokenizer, state=r.meta["data_state"])
    ...
    if ckpt.should_save(step, cfg.train.steps):                  # after the step's SSD writes
        ckpt.save(step, params=params, opt_state=opt_state, ssd=ssd,
                  meta={"data_state": stream.state(), "updates_applied": state.updates_applied})
    ckpt.close()                                                 # waits for pending saves

Reading a checkpoint without jaxascend (arrays come back with their saved shapes and dtypes)::

    import orbax.checkpoint as ocp
    params = ocp.StandardCheckpointer().restore("run/checkpoints/100/params")
    opt = ocp.StandardCheckpointer().restore("run/checkpoints/100/offloaded")
    opt["master"]["layers"]["mlp"]["w"]                         # fp32 master weights of a leaf
    import tensorstore as ts                                    # or one array, chunk by chunk
    m = ts.open({"driver": "zarr", "kvstore": {"driver": "file",
                 "path": "run/checkpoints/100/offloaded/m.layers.mlp.w"}}).result()

A checkpoint made with another model shape, dtype or vocabulary is refused
(:class:`IncompatibleCheckpointError` naming the field and both values); a damaged file is
reported with its path (:class:`CorruptCheckpointError`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxascend.checkpoint.array_specs import SsdArrays, validate_arrays
from jaxascend.checkpoint.checksums import (ORBAX_ITEMS, leaf_name, raise_if_a_file_is_corrupt, tree_checksums,
                                            verify_checksums, write_file_checksums)
from jaxascend.checkpoint.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                                         IncompatibleCheckpointError)
from jaxascend.checkpoint.orbax_handler import SsdArraysRestore, SsdArraysSave
from jaxascend.checkpoint.resume import check_compatible, default_directory, requested_step
from jaxascend.checkpoint.step_meta import (FORMAT, META, OFFLOADED, OPT_STATE, PARAMS, RNG, as_dict, jsonable,
                                            read_meta, record_crc)
from jaxascend.config import CheckpointConfig, Config

log = logging.getLogger(__name__)

TMP_MARKER = ".orbax-checkpoint-tmp"


def saves_at(cfg: CheckpointConfig, step: int, last_step: int, steps: Optional[int] = None) -> bool:
    """Whether a run saves a checkpoint at ``step``: every ``checkpoint.every_steps`` steps and at
    ``last_step``, but for the run's end (``steps``: train.steps; a stop before it is a resume
    point) with ``checkpoint.final: false``."""
    if cfg.every_steps > 0 and step % cfg.every_steps == 0:
        return True
    return step == last_step and (cfg.final or step != steps)


@dataclasses.dataclass
class Restored:
    """What :meth:`Checkpointer.restore` hands back (the SSD arrays went straight to the store)."""

    step: int
    params: Any
    opt_state: Any  # None when not requested
    rng: Optional[np.ndarray]  # the uint32 key data given to save(), None if none was saved
    meta: dict  # save(meta=...): e.g. {"data_state": ..., "loss_scale": ...}
    config: dict  # the run config the checkpoint was made with


class Checkpointer:
    """Owner of one checkpoint directory (wraps an Orbax ``CheckpointManager``).

    ``run_config`` (a :class:`Config` or its dict) is saved with every checkpoint and compared
    with the saved one on restore; ``directory`` overrides ``cfg.dir``.
    """

    def __init__(self, cfg: CheckpointConfig, run_config: Union[Config, dict, None] = None,
                 directory: Union[str, Path, None] = None):
        self.cfg = cfg
        self.run_config = as_dict(run_config) if run_config is not None else {}
        if directory is None:
            if cfg.dir is None and not self.run_config:
                raise ValueError("Checkpointer: checkpoint.dir is unset; give run_config or directory")
            directory = cfg.dir or default_directory(self.run_config)
        self.directory = Path(directory).absolute()
        self.existed = self.directory.is_dir()
        # In a job (jax.distributed) every process saves its own slices into the same step;
        # process 0 alone tidies the directory and records the file checksums.
        self._main = jax.process_index() == 0
        partial = sorted(self.directory.glob(f"*{TMP_MARKER}*")) if self.existed and self._main else []
        if partial:
            action = "removing" if cfg.cleanup_partial else "ignoring"
            log.warning("checkpoint: %s %d half-written save(s) in %s: %s", action, len(partial), self.directory,
                        ", ".join(p.name for p in partial))
        if cfg.cleanup_partial:  # here rather than Orbax's cleanup_tmp_directories, which runs in the background
            for path in partial:
                shutil.rmtree(path)
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_last, create=True,
                                               enable_async_checkpointing=cfg.async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._saving: Optional[int] = None  # the step of a save that may still be running

    # ------------------------------------------------------------------ which steps
    def all_steps(self) -> list[int]:
        """Steps of every complete checkpoint in the directory, ascending (waits for a pending save)."""
        self.wait()
        self._manager.reload()  # read the directory: only finalised step directories count
        return sorted(self._manager.all_steps())

    def latest_step(self) -> Optional[int]:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_directory(self, step: int) -> Path:
        return self.directory / str(int(step))

    def should_save(self, step: int, last_step: int, steps: Optional[int] = None) -> bool:
        """:func:`saves_at` of this checkpointer's settings."""
        return saves_at(self.cfg, step, last_step, steps)

    def resume_step(self, resume: Union[str, int]) -> Optional[int]:
        """The step ``train.resume`` asks for: ``"none"`` -> None; ``"auto"`` -> the newest
        complete checkpoint (None if there is none); a number -> that step, or
        :class:`CheckpointNotFoundError` naming the directory and the steps it holds."""
        steps = [] if resume == "none" else self.all_steps()
        step = requested_step(self.directory, self.existed, steps, resume)
        newer = [s for s in steps if step is not None and s > step]
        if newer:
            log.warning("checkpoint: resuming from step %d while %s holds later steps %s; saving one of those "
                        "steps again will fail unless discard_after(%d) replaces them", step, self.directory,
                        newer, step)
        return step

    def discard_after(self, step: int) -> list[int]:
        """Deletes the complete checkpoints after ``step`` (a run resumed from ``step`` on
        purpose replaces them: it would otherwise fail when it reaches one); returns their steps."""
        later = [s for s in self.all_steps() if s > step]
        for s in later:
            self._manager.delete(s)
        if later:
            log.warning("checkpoint: resumed from step %d; deleted the later checkpoints %s in %s", step, later,
                        self.directory)
        return later

    # ------------------------------------------------------------------ save
    def save(self, step: int, *, params: Any, opt_state: Any = None, ssd: Optional[SsdArrays] = None,
             rng: Optional[Any] = None, meta: Optional[dict] = None) -> None:
        """Saves one checkpoint for ``step``.

        Waits for the previous save first. The SSD arrays (``ssd``: :class:`SsdArrays` or
        ``(store, arena, specs)``) are streamed before this returns, so the store may be
        modified right after; params, opt_state, rng and meta are copied to the host and, with
        ``checkpoint.async_save``, written in the background (:meth:`wait` to block).
        ``meta`` must be JSON-serialisable (numpy scalars are converted).
        """
        step = int(step)
        self.wait()
        if step in self.all_steps():
            raise CheckpointError(f"checkpoint for step {step} already exists in {self.directory}; "
                                  f"remove {self.step_directory(step)} or resume from it")
        items = {PARAMS: ocp.args.StandardSave(params)}
        if opt_state is not None:
            items[OPT_STATE] = ocp.args.StandardSave(opt_state)
        if ssd is not None:
            ssd = SsdArrays.of(ssd)
            validate_arrays(ssd)  # before Orbax starts: a bad spec must not leave a half-written step
            items[OFFLOADED] = SsdArraysSave(ssd, self.cfg.compression)
        if rng is not None:
            items[RNG] = ocp.args.StandardSave({"key": np.asarray(jax.device_get(rng))})
        # Orbax stores no checksums of array data (a garbled OCDBT file restores silently), so the
        # crc32c of every saved array leaf goes into the meta item and is checked on restore.
        checksums = {item: tree_checksums(arg.item) for item, arg in items.items()
                     if isinstance(arg, ocp.args.StandardSave)}
        record = {"format": FORMAT, "step": step, "items": sorted(items),
                  "config": jsonable(self.run_config, "config"), "meta": jsonable(meta or {}, "meta"),
                  "checksums": checksums}
        record["crc32c"] = record_crc(record)  # a garbled byte may still parse as JSON
        items[META] = ocp.args.JsonSave(record)
        self._saving = step
        with self._save_errors():
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        if not self.cfg.async_save:
            self.wait()  # records the file checksums of the complete step

    def wait(self) -> None:
        """Blocks until every pending (asynchronous) save is complete; raises its error if it failed."""
        with self._save_errors():
            self._manager.wait_until_finished()
        if self._saving is not None:
            step, self._saving = self._saving, None
            if self._main:
                write_file_checksums(self.step_directory(step))

    @contextlib.contextmanager
    def _save_errors(self):
        """A failed save (a full disk, an I/O error in Orbax's background threads) as one
        :class:`CheckpointError` naming the step, the directory and the innermost cause. The
        half-written step keeps its temporary name, so every earlier checkpoint stays usable."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as err:
            step, self._saving = self._saving, None
            raise CheckpointError(f"saving checkpoint step {step} in {self.directory} failed (the earlier "
                                  f"checkpoints are intact): {root_cause(err)}") from err

    # ------------------------------------------------------------------ restore
    def read_meta(self, step: int) -> dict:
        """The ``meta`` item of ``step`` (format, step, items, config, meta)."""
        return read_meta(self.step_directory(step))

    def restore(self, step: int, *, params_like: Any = None, opt_state_like: Any = None,
                ssd: Optional[SsdArrays] = None) -> Restored:
        """Restores ``step``: params (as ``params_like``: arrays or ``jax.ShapeDtypeStruct`` with
        shardings; numpy arrays when None), the optax state likewise when ``opt_state_like`` is
        given, and the SSD arrays straight into ``ssd``'s store regions (chunk by chunk, checksums
        checked). Refuses incompatible checkpoints before touching anything."""
        step = int(step)
        if step not in self.all_steps():
            raise CheckpointNotFoundError(f"no complete checkpoint for step {step} in {self.directory} "
                                          f"(available steps: {self.all_steps() or 'none'})")
        step_dir = self.step_directory(step)
        record = self.read_meta(step)
        check_compatible(record["config"], self.run_config, step_dir)
        saved_items = set(record["items"])
        wanted = {PARAMS: True, OPT_STATE: opt_state_like is not None, OFFLOADED: ssd is not None}
        for item, requested in wanted.items():
            if requested and item not in saved_items:
                raise IncompatibleCheckpointError(f"checkpoint {step_dir} has no {item!r} item (it holds "
                                                  f"{sorted(saved_items)}); this run needs one")
        if OFFLOADED in saved_items and ssd is None:
            raise IncompatibleCheckpointError(f"checkpoint {step_dir} holds SSD-resident optimizer state "
                                              f"({OFFLOADED!r}); pass ssd= to restore it")
        if params_like is not None:
            _check_tree_matches(step_dir / PARAMS, params_like, PARAMS)
        if opt_state_like is not None:
            _check_tree_matches(step_dir / OPT_STATE, opt_state_like, OPT_STATE)
        items = {PARAMS: _standard_restore(params_like)}
        if opt_state_like is not None:
            items[OPT_STATE] = _standard_restore(opt_state_like)
        if RNG in saved_items:
            items[RNG] = ocp.args.StandardRestore()
        if ssd is not None:
            ssd = SsdArrays.of(ssd)
            validate_arrays(ssd)  # a bad spec is the caller's error, not a corrupt checkpoint
            items[OFFLOADED] = SsdArraysRestore(ssd)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**items))
        except CheckpointError:
            raise
        except Exception as err:  # Orbax/tensorstore: the innermost error names the file
            raise_if_a_file_is_corrupt(step_dir)
            raise CorruptCheckpointError(f"checkpoint {step_dir} cannot be read: {root_cause(err)}") from err
        for item in ORBAX_ITEMS:
            if item in items:
                try:
                    verify_checksums(out[item], record.get("checksums", {}).get(item), step_dir / item)
                except CorruptCheckpointError:
                    raise_if_a_file_is_corrupt(step_dir)  # name the damaged file when it is known
                    raise
        rng = out[RNG]["key"] if RNG in items else None
        return Restored(step=step, params=out[PARAMS], opt_state=out[OPT_STATE] if OPT_STATE in items else None,
                        rng=rng, meta=record["meta"], config=record["config"])

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Waits for pending saves and closes the manager. Idempotent."""
        if self._manager is not None:
            try:
                self.wait()
            finally:
                self._manager.close()
                self._manager = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, steps={self.all_steps() if self._manager else 'closed'})"


# ----------------------------------------------------------------------------- helpers


def root_cause(err: BaseException) -> str:
    """The innermost error of a chain (tensorstore's, which names the file), on one line."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:600]}"


def _standard_restore(like: Any) -> ocp.args.StandardRestore:
    if like is None:
        return ocp.args.StandardRestore()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else x, like)
    return ocp.args.StandardRestore(abstract)


def _check_tree_matches(item_dir: Path, like: Any, what: str) -> None:
    """Refuses a restore whose leaves, shapes or dtypes differ from the saved item."""
    try:
        saved_tree = ocp.StandardCheckpointHandler().metadata(item_dir).tree
    except Exception as err:  # a garbled/truncated _METADATA or OCDBT manifest: the cause names it
        raise_if_a_file_is_corrupt(item_dir.parent)
        raise CorruptCheckpointError(f"checkpoint item {item_dir} cannot be read: {root_cause(err)}") from err
    saved = {leaf_name(p): (tuple(m.shape), np.dtype(m.dtype))
             for p, m in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
    current = {leaf_name(p): (tuple(np.shape(x)), np.dtype(x.dtype))
               for p, x in jax.tree_util.tree_flatten_with_path(like)[0]}
    missing, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or extra:
        raise IncompatibleCheckpointError(f"checkpoint {item_dir} holds other {what} leaves than this run: not in "
                                          f"the checkpoint: {missing[:5] or 'none'}; only in the checkpoint: "
                                          f"{extra[:5] or 'none'}")
    for name, (shape, dtype) in current.items():
        if saved[name] != (shape, dtype):
            s_shape, s_dtype = saved[name]
            raise IncompatibleCheckpointError(f"checkpoint {item_dir}: {what} leaf {name!r} is {s_dtype}{s_shape} "
                                              f"in the checkpoint, {dtype}{shape} in this run")
