"""The two I/O engines behind the shard store: io_uring against numpy (odd sizes, many regions,
concurrent tickets, a deep queue), the same bytes from both engines, counters, the fallback to
the thread engine when io_uring is refused (reported once), and the engine's config fields.
(The store's fault-injection and checksum tests in test_store.py run on both engines.)"""

import logging
import threading

import numpy as np
import pytest

from jaxascend.native import extension as _native
from jaxascend.config import ConfigError, OffloadConfig
from jaxascend.ssd import ArenaPlan, ChecksumError, HostArena, Segment, SsdStore, StoreError, clear_faults, inject_fault
from jaxascend.ssd.store import injected_faults

BLOCK = 16384


def make_cfg(path, **kw):
    fields = dict(dir=str(path), block_bytes=BLOCK, staging_bytes=4 * BLOCK, chunk_bytes=4 * BLOCK,
                  shard_bytes=64 * BLOCK, io_threads=3, io_engine="io_uring", queue_depth=8, pin_memory=False)
    fields.update(kw)
    return OffloadConfig(**fields)


def open_store(cfg, extra_plan=None):
    plan = ArenaPlan().extend(SsdStore.arena_requests(cfg)).extend(extra_plan or [])
    arena = HostArena(plan, cfg)
    return arena, SsdStore(cfg, arena)


def random_bytes(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _io_uring_refusal(tmp_path_factory):
    """'' when this kernel lets the store use io_uring, else the store's reason."""
    arena, store = open_store(make_cfg(tmp_path_factory.mktemp("probe")))
    with store:
        return "" if store.io_engine == "io_uring" else store.io_engine_status


@pytest.fixture(scope="module")
def uring(tmp_path_factory):
    reason = _io_uring_refusal(tmp_path_factory)
    if reason:
        pytest.skip(f"io_uring is refused here, so the store runs the threads: {reason}")


@pytest.fixture
def store(tmp_path, uring):
    arena, s = open_store(make_cfg(tmp_path / "offload"))
    with s:
        assert s.io_engine == "io_uring" and s.io_engine_status == "io_uring, queue depth 8"
        yield s


# ------------------------------------------------------------------------- io_uring vs numpy
def test_odd_sizes_and_many_regions_round_trip(store):
    rng = np.random.default_rng(1)
    sizes = [1, 4095, 4096, 4097, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17] + list(rng.integers(1, 40 * BLOCK, 40))
    data = {}
    for i, n in enumerate(sizes):
        store.add_region(f"r{i}", int(n))
        data[f"r{i}"] = random_bytes(int(n), seed=i)
        store.write(f"r{i}", data[f"r{i}"], wait=False)  # many requests queued at once
    store.flush()
    assert store.stats()["shards"] >= 2  # regions cross shard files
    for name, d in data.items():
        np.testing.assert_array_equal(store.read(name), d)
    stats = store.stats()
    assert stats["io_engine"] == "io_uring" and stats["read_errors"] == stats["write_errors"] == 0
    blocks = sum(-(-int(n) // BLOCK) for n in sizes)
    assert stats["write_requests"] == stats["read_requests"] == blocks
    assert stats["bytes_read"] == stats["bytes_written"] == sum(-(-int(n) // 4096) * 4096 for n in sizes)


def test_concurrent_tickets_from_many_threads(tmp_path, uring):
    """Eight Python threads, each with its own slot (its own ticket), write and read back at once."""
    cfg = make_cfg(tmp_path / "c", queue_depth=4)
    n_threads, nbytes = 8, 5 * BLOCK + 123
    arena, store = open_store(cfg, ArenaPlan().add("io", 6 * BLOCK, count=n_threads).requests)
    errors = []

    def worker(k):
        try:
            slot = arena.acquire("io", nbytes)
            for rep in range(6):
                expected = random_bytes(nbytes, seed=100 * k + rep)
                arena.array(slot)[:nbytes] = expected
                store.write_from(f"t{k}", slot, nbytes=nbytes)
                arena.array(slot)[:] = 0
                store.read_into(f"t{k}", slot, nbytes=nbytes)
                np.testing.assert_array_equal(arena.array(slot)[:nbytes], expected)
            arena.release(slot)
        except Exception as e:  # reported by the main thread below
            errors.append(e)

    with store:
        for k in range(n_threads):
            store.add_region(f"t{k}", nbytes)
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert store.stats()["max_inflight"] > 4  # more submitted than the ring holds: the rest waited


def test_a_stream_pass_matches_numpy_at_queue_depth_one(tmp_path, uring):
    cfg = make_cfg(tmp_path / "s", queue_depth=1, chunk_bytes=2 * BLOCK, stream_depth=4)
    arena, store = open_store(cfg, ArenaPlan().add("state", 2 * BLOCK, count=4).requests)
    n = 20 * BLOCK // 4 + 7
    x = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    with store:
        store.add_region("x", 4 * n)
        store.write("x", x)
        chunks = [[Segment("x", off, min(2 * BLOCK, 4 * n - off))] for off in range(0, 4 * n, 2 * BLOCK)]
        with store.stream(chunks, "state", dtypes=np.float32) as s:
            for chunk in s:
                chunk.arrays[0] *= 2
        np.testing.assert_array_equal(store.read("x", dtype=np.float32), 2 * x)


def test_both_engines_write_the_same_bytes(tmp_path, uring):
    data = random_bytes(7 * BLOCK + 999, seed=3)
    files = {}
    for engine in ("io_uring", "threads"):
        arena, store = open_store(make_cfg(tmp_path / engine, io_engine=engine))
        with store:
            assert store.io_engine == engine
            store.add_region("x", data.size)
            store.write("x", data)
            np.testing.assert_array_equal(store.read("x"), data)
            files[engine] = open(store.region("x").extents[0].shard_path, "rb").read()
    assert files["io_uring"] == files["threads"]


def test_crc_mismatch_is_caught_by_the_ring(store):
    store.add_region("m", 4 * BLOCK)
    store.write("m", random_bytes(4 * BLOCK, 4))
    extent = store.region("m").extents[0]
    with open(extent.shard_path, "r+b") as f:
        f.seek(extent.file_offset + 3 * BLOCK + 5)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    with pytest.raises(ChecksumError, match=r"crc32c mismatch in .*shard-00000.bin at byte offset \d+ "
                                            r"\(region 'm', block 3\), 16384 bytes"):
        store.read("m")
    store.read("m", nbytes=3 * BLOCK)  # the blocks before it are fine


def test_first_error_of_a_ticket_and_the_store_keeps_working(store):
    store.add_region("e", 6 * BLOCK)
    data = random_bytes(6 * BLOCK, 5)
    store.write("e", data)
    with injected_faults("read:2:EIO,write:4:ENOSPC"):
        with pytest.raises(StoreError, match=r"read of 16384 bytes failed: EIO"):
            store.read("e")
        with pytest.raises(StoreError, match=r"ENOSPC \(No space left on device\), writing"):
            store.write("e", random_bytes(6 * BLOCK, 6))
    stats = store.stats()
    assert stats["read_errors"] == 1 and stats["write_errors"] == 1 and stats["inflight"] == 0
    got = store.read("e").reshape(6, BLOCK)  # each block old or new, never torn
    assert all((g == o).all() or (g == n).all()
               for g, o, n in zip(got, data.reshape(6, BLOCK), random_bytes(6 * BLOCK, 6).reshape(6, BLOCK)))


def test_buffered_mode_through_the_ring(tmp_path, uring):
    for drop in (True, False):
        arena, store = open_store(make_cfg(tmp_path / f"b{drop}", direct_io=False, drop_page_cache=drop))
        with store:
            assert store.io_engine == "io_uring" and not store.direct_io
            store.add_region("x", 9 * BLOCK + 1)
            data = random_bytes(9 * BLOCK + 1, 7)
            store.write("x", data)
            np.testing.assert_array_equal(store.read("x"), data)


# ------------------------------------------------------------------------- fallback
@pytest.mark.parametrize("asked, level", [("io_uring", logging.WARNING), ("auto", logging.INFO)])
def test_refused_io_uring_falls_back_to_threads_and_says_so_once(tmp_path, caplog, asked, level):
    with caplog.at_level(logging.INFO, logger="jaxascend.ssd.store"):
        with injected_faults("io_uring_setup:1:EPERM"):
            arena, store = open_store(make_cfg(tmp_path / "f", io_engine=asked))
    with store:
        assert store.io_engine == "threads"
        assert store.io_engine_status == (
            f"threads, 3 pread/pwrite workers (offload.io_engine is {asked}, but io_uring_setup failed: "
            "EPERM (Operation not permitted) (injected))")
        store.add_region("x", 5 * BLOCK + 3)
        data = random_bytes(5 * BLOCK + 3, 8)
        store.write("x", data)
        np.testing.assert_array_equal(store.read("x"), data)
        assert store.stats()["io_engine"] == "threads"
    reports = [r for r in caplog.records if "io_uring" in r.getMessage()]
    assert len(reports) == 1 and reports[0].levelno == level


def test_threads_by_choice_log_nothing(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="jaxascend.ssd.store"):
        arena, store = open_store(make_cfg(tmp_path / "t", io_engine="threads"))
    with store:
        assert store.io_engine == "threads" and "offload.io_engine is threads" in store.io_engine_status
    assert not [r for r in caplog.records if "io_uring" in r.getMessage()]


def test_fallback_from_the_environment_fault_spec():
    inject_fault("io_uring_setup:1:ENOSYS")  # the spec parser knows the op and ENOSYS
    clear_faults()
    with pytest.raises(ValueError, match=r"unknown operation 'uring'.*io_uring_setup"):
        _native.arm_fault("uring:1:EPERM")


# ------------------------------------------------------------------------- config
def test_engine_config_fields_are_validated():
    cfg = OffloadConfig()
    assert (cfg.io_engine, cfg.queue_depth) == ("auto", 8)
    with pytest.raises(ConfigError, match=r"offload.io_engine: 'uring' is not one of auto, io_uring, threads"):
        OffloadConfig(io_engine="uring")
    with pytest.raises(ConfigError, match=r"offload.queue_depth: must be >= 1 and <= 256, got 0"):
        OffloadConfig(queue_depth=0)
    with pytest.raises(ConfigError, match=r"offload.queue_depth: must be >= 1 and <= 256, got 300"):
        OffloadConfig(queue_depth=300)
    with pytest.raises(ConfigError, match=r"offload.block_bytes: must be >= 4096 and <= 1073741824"):
        OffloadConfig(block_bytes="2GiB")


def test_native_store_options_are_validated(tmp_path):
    cfg = make_cfg(tmp_path / "n")
    arena = HostArena(ArenaPlan().extend(SsdStore.arena_requests(cfg)), cfg)
    for field, value, message in [("io_engine", "aio", "io_engine must be auto, io_uring or threads, got 'aio'"),
                                  ("queue_depth", 0, r"queue_depth must be in \[1, 256\], got 0")]:
        options = _native.StoreOptions()
        options.dir = str(tmp_path / "n")
        options.block_bytes, options.shard_bytes, options.staging_bytes = BLOCK, 64 * BLOCK, 4 * BLOCK
        setattr(options, field, value)
        with pytest.raises(ValueError, match=message):
            _native.ShardStore.open(options, arena.native)
