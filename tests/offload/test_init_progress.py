"""The init pass's progress: a line at most every interval with its rate and time left, one line at
the end (none for a short small pass), and the bytes it wrote, counted exactly, on the state."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxascend.offload import OffloadedAdamState, init_progress, initial_state
from jaxascend.offload.init_progress import InitialWrite, InitProgress
from jaxascend.optim import StateFormat
from tests.offload.test_state import BLOCK, STACKED, offload_cfg, random_tree, spec

GIB = 2**30


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    assert captured.out == ""  # the terminal is stderr
    return captured.err.splitlines()


def test_at_most_one_line_an_interval_with_rate_share_and_time_left(capsys):
    clock = FakeClock()
    progress = InitProgress(10 * GIB, interval=10, clock=clock)
    for t, n in [(5, GIB), (10, GIB), (15, GIB), (20, GIB), (21, 6 * GIB)]:
        clock.now = t
        progress.add(n)
    clock.now = 25
    written = progress.finish()
    assert lines(capsys) == [
        "writing the initial state: 2.0 of 10.0 GiB (20%), 0.21 GB/s, about 40 s left",
        "writing the initial state: 4.0 of 10.0 GiB (40%), 0.21 GB/s, about 30 s left",
        "wrote the initial state: 10.0 GiB in 25.0 s (0.43 GB/s)",
    ]
    assert written == InitialWrite(10 * GIB, 25.0)
    assert written.to_dict() == {"bytes": 10 * GIB, "seconds": 25.0, "gbps": 10 * GIB / 25 / 1e9}


def test_long_time_left_in_minutes_and_no_rate_before_any_time_passed(capsys):
    clock = FakeClock()
    progress = InitProgress(60 * GIB, interval=0, clock=clock)
    progress.add(0)
    clock.now = 30
    progress.add(GIB)
    assert lines(capsys) == ["writing the initial state: 0.0 of 60.0 GiB (0%)",
                             "writing the initial state: 1.0 of 60.0 GiB (2%), 0.04 GB/s, about 30 min left"]


def test_a_short_small_pass_is_quiet_and_still_measured(capsys):
    clock = FakeClock()
    progress = InitProgress(3 * 2**20, interval=10, clock=clock)
    clock.now = 2
    progress.add(3 * 2**20)
    clock.now = 3
    assert progress.finish() == InitialWrite(3 * 2**20, 3.0)
    assert lines(capsys) == []


def test_a_short_pass_of_a_gib_reports_its_end_only(capsys):
    clock = FakeClock()
    progress = InitProgress(GIB, interval=10, clock=clock)
    clock.now = 0.5
    progress.add(GIB)
    progress.finish()
    assert lines(capsys) == ["wrote the initial state: 1.0 GiB in 0.5 s (2.15 GB/s)"]


def test_a_disabled_reporter_prints_nothing(capsys):
    clock = FakeClock()
    progress = InitProgress(2 * GIB, enabled=False, interval=0, clock=clock)
    clock.now = 20
    progress.add(2 * GIB)
    assert progress.finish() == InitialWrite(2 * GIB, 20.0)
    assert lines(capsys) == []


class RecordingProgress(InitProgress):
    """The reporter the init pass makes, keeping every count it was given."""

    made: list["RecordingProgress"] = []

    def __init__(self, total, **kwargs):
        super().__init__(total, **kwargs)
        self.counts = []
        RecordingProgress.made.append(self)

    def add(self, nbytes):
        self.counts.append(nbytes)
        super().add(nbytes)


@pytest.fixture
def recorded(monkeypatch):
    monkeypatch.setattr(init_progress, "INTERVAL_S", 0.0)
    monkeypatch.setattr(initial_state, "InitProgress", RecordingProgress)
    RecordingProgress.made = []
    return RecordingProgress.made


def _expected_bytes(state) -> int:
    """Every chunk's record (as the stream writes it) and a streamed leaf's compute weights."""
    records = sum(c.state_bytes for c in state.layout.chunks())
    assert records == state.layout.state_bytes
    return records + state.layout.streamed_param_bytes


@pytest.mark.parametrize("streamed,master,from_reader", [
    (False, "float32", False), (True, "float32", False), (True, "float32", True), (True, "bfloat16", True)])
def test_the_init_pass_reports_every_byte_it_writes(tmp_path, capsys, recorded, streamed, master, from_reader):
    state = OffloadedAdamState.create(spec(jnp.bfloat16), offload_cfg(tmp_path), stacked=STACKED,
                                      stream_params=streamed, state=StateFormat(master=master))
    try:
        assert state.initial_write is None
        params = random_tree(0)
        written_before = state.store.stats()["bytes_written"]
        if from_reader:
            leaves = [np.asarray(x) for x in state.layout.flatten(params, "params")]
            state.init_from(lambda leaf, layer: leaves[leaf.index] if layer is None else leaves[leaf.index][layer])
        else:
            state.init(params)
        expected = _expected_bytes(state)
        assert (state.layout.streamed_param_bytes > 0) == streamed
        [progress] = recorded
        assert progress.total == sum(progress.counts) == expected
        assert state.initial_write.bytes == expected and state.initial_write.seconds > 0
        # The store wrote the same, each region's end rounded up to whole blocks on disk.
        regions = sum(leaf.layers * (2 if leaf.streamed else 1) for leaf in state.leaves)
        assert 0 <= state.store.stats()["bytes_written"] - written_before - expected < regions * BLOCK
        out = lines(capsys)
        assert len(out) == len(progress.counts) + 1  # interval 0: a line at every count, and the end
        assert all(line.startswith("writing the initial state: ") for line in out[:-1])
        assert "(100%)" in out[-2] and out[-1].startswith("wrote the initial state: ")
    finally:
        state.close()


def test_only_process_zero_prints_and_every_process_measures(tmp_path, capsys, recorded):
    state = OffloadedAdamState.create(spec(jnp.float32), offload_cfg(tmp_path), stacked=STACKED, partition_index=1)
    try:
        state.init(random_tree(0))
        assert state.initial_write.bytes == _expected_bytes(state)
        assert lines(capsys) == []
    finally:
        state.close()
