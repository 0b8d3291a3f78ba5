"""A data-parallel job's offloaded state saved by P processes (each its slice of every tensor)
and restored by another number of processes: each reads its own slice from whichever saved slices
hold it (uneven sizes, zero padding); the whole tensors read back from the slices."""

import numpy as np
import pytest

from jaxascend.checkpoint import ArraySpec, IncompatibleCheckpointError, Piece, SsdArrays, checkpoint_arena_requests
from jaxascend.checkpoint.array_restore import restore_arrays
from jaxascend.checkpoint.array_save import save_item
from jaxascend.checkpoint.offloaded_item import saved_processes
from jaxascend.checkpoint.repartition import saved_tensors
from jaxascend.config import OffloadConfig
from jaxascend.ssd import ArenaPlan, HostArena, SsdStore

BLOCK = 4096
# (name, whole shape, stacked): a layer stack of 77 elements per layer and a vector of 13, neither
# a multiple of 2 or 3 processes.
TENSORS = [("master/layers/w", (2, 7, 11), True), ("master/b", (13,), False)]


def slice_of(whole: np.ndarray, stacked: bool, index: int, count: int) -> np.ndarray:
    """What process ``index`` of ``count`` holds: each layer's flat slice, zero-padded."""
    rows = whole.reshape(whole.shape[0], -1) if stacked else whole.reshape(1, -1)
    if count == 1:
        return whole
    s = -(-rows.shape[1] // count)
    out = np.zeros((rows.shape[0], s), whole.dtype)
    part = rows[:, index * s:(index + 1) * s]
    out[:, :part.shape[1]] = part
    return out if stacked else out[0]


class Process:
    """One simulated process: a store whose regions hold its slices, and the specs saying so."""

    def __init__(self, root, index: int, count: int, values=None):
        cfg = OffloadConfig(dir=str(root / f"offload-{count}-{index}"), block_bytes=BLOCK, staging_bytes=4 * BLOCK,
                            chunk_bytes=2 * BLOCK, shard_bytes=64 * BLOCK, pin_memory=False)
        self.arena = HostArena(ArenaPlan().extend(SsdStore.arena_requests(cfg))
                               .extend(checkpoint_arena_requests(cfg)), cfg)
        self.store = SsdStore(cfg, self.arena)
        specs = []
        for name, shape, stacked in TENSORS:
            piece = Piece(index, count, shape, stacked)
            local_shape = shape if count == 1 else ((shape[0], piece.slice_size) if stacked else (piece.slice_size,))
            self.store.add_region(name, 4 * int(np.prod(local_shape)))
            if values is not None:
                self.store.write(name, slice_of(values[name], stacked, index, count).astype(np.float32))
            specs.append(ArraySpec.contiguous(name, name, 0, local_shape, np.float32))
            specs[-1] = ArraySpec(name, local_shape, np.float32, specs[-1].spans, piece)
        self.arrays = SsdArrays(self.store, specs)

    def read(self, name):
        spec = next(s for s in self.arrays.specs if s.name == name)
        return self.store.read(name).view(np.float32).reshape(spec.shape)

    def close(self):
        self.store.close()
        self.arena.close()


@pytest.fixture
def whole():
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape, _ in TENSORS}


def save_job(root, item, whole, count):
    for index in range(count):
        p = Process(root, index, count, whole)
        try:
            save_item(item, p.arrays)
        finally:
            p.close()


@pytest.mark.parametrize("saved,restored", [(3, 2), (2, 3), (3, 1), (1, 2), (2, 2)])
def test_a_job_restores_its_slices_from_a_save_by_another_number_of_processes(tmp_path, whole, saved, restored):
    item = tmp_path / "offloaded"
    save_job(tmp_path, item, whole, saved)
    assert saved_processes(item) == saved
    assert (item / "process0").is_dir() == (saved > 1)
    for index in range(restored):
        p = Process(tmp_path, index, restored)
        try:
            restore_arrays(item, p.arrays)
            for name, _, stacked in TENSORS:
                np.testing.assert_array_equal(p.read(name), slice_of(whole[name], stacked, index, restored),
                                              err_msg=f"{name}, process {index} of {restored}")
        finally:
            p.close()


def test_the_whole_tensors_read_back_from_the_slices(tmp_path, whole):
    item = tmp_path / "offloaded"
    save_job(tmp_path, item, whole, 3)
    tensors = saved_tensors(item)
    w = tensors["master/layers/w"]
    assert (w.shape, w.stacked, w.count) == ((2, 7, 11), True, 3)
    for layer in (1, 0):  # backwards: the readers start over
        out = np.empty(77, np.float32)
        w.copy(out.view(np.uint8), layer, 0)
        np.testing.assert_array_equal(out, whole["master/layers/w"][layer].reshape(-1))
    out = np.empty(6, np.float32)  # a run across two slices (5 elements each)
    tensors["master/b"].copy(out.view(np.uint8), None, 3)
    np.testing.assert_array_equal(out, whole["master/b"][3:9])


def test_a_restore_that_cannot_re_split_names_both_counts(tmp_path, whole):
    item = tmp_path / "offloaded"
    save_job(tmp_path, item, whole, 2)
    p = Process(tmp_path, 0, 1)
    try:
        plain = SsdArrays(p.store, [ArraySpec(s.name, s.shape, s.dtype, s.spans) for s in p.arrays.specs])
        with pytest.raises(IncompatibleCheckpointError, match="saved by 2 process\\(es\\), this run has 1"):
            restore_arrays(item, plain)
        other = SsdArrays(p.store, [ArraySpec(s.name, s.shape, s.dtype, s.spans,
                                              Piece(0, 1, s.shape[::-1], s.piece.stacked)) for s in p.arrays.specs])
        with pytest.raises(IncompatibleCheckpointError, match="is float32\\(2, 7, 11\\) in the checkpoint"):
            restore_arrays(item, other)
    finally:
        p.close()


def test_int8_state_of_another_process_count_is_refused_before_the_run(tmp_path):
    """int8 moments are coded per block of each process's slices: resuming them with another
    number of processes is refused in one line (float32/bfloat16 state re-partitions)."""
    import json

    from jaxascend.checkpoint import IncompatibleCheckpointError, check_resume_partition
    from jaxascend.checkpoint.offloaded_item import FORMAT, PROCESSES_FILE
    from jaxascend.config import CheckpointConfig

    item = tmp_path / "ckpt" / "4" / "offloaded"
    item.mkdir(parents=True)
    (item / PROCESSES_FILE).write_text(json.dumps({"format": FORMAT, "processes": 2}))
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"))
    run_config = {"optimizer": {"state_dtype": "int8"}, "train": {"out_dir": str(tmp_path)}, "checkpoint": {}}
    with pytest.raises(IncompatibleCheckpointError, match=r"saved by 2 process\(es\), this run has 1: int8 optimizer "
                                                          r"state .* resume with 2 process\(es\)"):
        check_resume_partition(cfg, run_config, 4, 1)
    check_resume_partition(cfg, run_config, 4, 2)
    check_resume_partition(cfg, {**run_config, "optimizer": {"state_dtype": "bfloat16"}}, 4, 1)
