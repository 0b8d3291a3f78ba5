"""The SSD shard store: round trips, checksums, injected faults, the directory lock, the
buffered fallback, argument errors, and crc32c itself; every test runs on both I/O engines."""

import errno
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxascend.native import extension as _native
from jaxascend.config import OffloadConfig
from jaxascend.ssd import ArenaError, ArenaPlan, ChecksumError, HostArena, SsdStore, StoreError, StoreLockedError
from jaxascend.ssd.store import injected_faults

BLOCK = 16384
ENGINE = "auto"  # set per test by the `engine` fixture


@pytest.fixture(autouse=True, params=["io_uring", "threads"])
def engine(request, monkeypatch):
    """Runs every test on both engines (where the kernel refuses io_uring, both are the threads)."""
    monkeypatch.setattr(sys.modules[__name__], "ENGINE", request.param)
    return request.param


def make_cfg(path, **kw):
    fields = dict(dir=str(path), block_bytes=BLOCK, staging_bytes=4 * BLOCK, chunk_bytes=4 * BLOCK,
                  shard_bytes=8 * BLOCK, io_threads=3, io_engine=ENGINE, queue_depth=4, pin_memory=False)
    fields.update(kw)
    return OffloadConfig(**fields)


def open_store(cfg, extra_plan=None):
    plan = ArenaPlan().extend(SsdStore.arena_requests(cfg)).extend(extra_plan or [])
    arena = HostArena(plan, cfg)
    return arena, SsdStore(cfg, arena)


@pytest.fixture
def store(tmp_path):
    arena, s = open_store(make_cfg(tmp_path / "offload"))
    with s:
        yield s


def random_bytes(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def block_file_offset(region, block):
    """(shard path, file offset) of `block` of `region`, from the layout the store reports."""
    off = block * BLOCK
    extent = [e for e in region.extents if e.region_offset <= off][-1]
    return extent.shard_path, extent.file_offset + off - extent.region_offset


# ------------------------------------------------------------------------- round trips
ODD_SIZES = [1, 4095, 4097, BLOCK - 1, BLOCK + 1, 100_003, 300_001]


def test_round_trip_of_odd_sizes_across_shards(store):
    data = {n: random_bytes(n, seed=n) for n in ODD_SIZES}
    for n, d in data.items():
        store.add_region(f"r{n}", n)
        store.write(f"r{n}", d)
    for n, d in data.items():
        np.testing.assert_array_equal(store.read(f"r{n}"), d)
    big = store.region("r300001")
    assert len({e.shard_path for e in big.extents}) >= 2  # spans shard files at block boundaries
    assert all(e.region_offset % BLOCK == 0 and e.file_offset % 4096 == 0 for e in big.extents)
    # Block-aligned partial reads, and typed reads.
    np.testing.assert_array_equal(store.read("r300001", offset=2 * BLOCK, nbytes=3 * BLOCK),
                                  data[300_001][2 * BLOCK:5 * BLOCK])
    np.testing.assert_array_equal(store.read("r300001", offset=18 * BLOCK), data[300_001][18 * BLOCK:])
    stats = store.stats()
    assert stats["bytes_written"] >= sum(ODD_SIZES) and stats["read_errors"] == stats["write_errors"] == 0
    assert stats["direct_io"] and stats["max_inflight"] >= 1 and stats["read_gbps"] > 0


def test_typed_arrays_and_partial_writes(store):
    store.add_region("m", 4 * 10_000)
    x = np.linspace(-1, 1, 10_000, dtype=np.float32)
    store.write("m", x)
    store.write("m", np.full(BLOCK // 4, 7, np.float32), offset=BLOCK)  # overwrite block 1 only
    y = store.read("m", dtype=np.float32)
    expected = x.copy()
    expected[BLOCK // 4:BLOCK // 2] = 7
    np.testing.assert_array_equal(y, expected)
    out = np.empty(10_000, np.float32)
    assert store.read("m", out=out) is out
    np.testing.assert_array_equal(out, expected)


def test_fresh_region_reads_zeros(store):
    store.add_region("fresh", 50_000)
    assert not store.read("fresh").any()


def test_zero_copy_slot_io(tmp_path):
    cfg = make_cfg(tmp_path / "d")
    arena, store = open_store(cfg, [ArenaPlan().add("state", 3 * BLOCK).requests[0]])
    with store:
        store.add_region("w", 3 * BLOCK - 100)
        slot = arena.acquire("state", 3 * BLOCK)
        arena.array(slot)[:] = random_bytes(3 * BLOCK, 1)
        store.write_from("w", slot)  # nbytes defaults to what fits: the region's 3*BLOCK-100
        expected = arena.array(slot)[:3 * BLOCK - 100].copy()
        arena.array(slot)[:] = 0
        store.read_into("w", slot)
        np.testing.assert_array_equal(arena.array(slot)[:3 * BLOCK - 100], expected)
        np.testing.assert_array_equal(store.read("w"), expected)
        arena.release(slot)


def test_async_write_then_flush(store):
    store.add_region("g", 5 * BLOCK)
    data = random_bytes(5 * BLOCK, 2)
    store.write("g", data, wait=False)
    store.flush()
    np.testing.assert_array_equal(store.read("g"), data)


def test_in_memory_regions_read_and_write_like_disk_ones_and_touch_no_disk(tmp_path):
    """An in-memory region (the gradients in RAM) beside disk ones: the same copies, slot I/O and
    streamed passes, zeros when fresh, no shard space and no disk bytes counted."""
    cfg = make_cfg(tmp_path / "d")
    arena, store = open_store(cfg, ArenaPlan().add("state", 3 * BLOCK).add("seg", BLOCK, 4).requests)
    with store:
        store.add_region("disk", 3 * BLOCK)
        ram = store.add_region("ram", 3 * BLOCK - 100, in_memory=True)
        assert ram.in_memory and ram.extents == () and not store.region("disk").in_memory
        assert not store.read("ram").any()
        before = store.stats()
        data = random_bytes(3 * BLOCK - 100, 5)
        store.write("ram", data, wait=False)
        np.testing.assert_array_equal(store.read("ram"), data)
        store.write("ram", np.full(BLOCK, 9, np.uint8), offset=BLOCK)
        expected = data.copy()
        expected[BLOCK:2 * BLOCK] = 9
        np.testing.assert_array_equal(store.read("ram", offset=BLOCK, nbytes=BLOCK), expected[BLOCK:2 * BLOCK])
        slot = arena.acquire("state", 3 * BLOCK)
        store.read_into("ram", slot)
        np.testing.assert_array_equal(arena.array(slot)[:3 * BLOCK - 100], expected)
        arena.array(slot)[:] = random_bytes(3 * BLOCK, 6)
        store.write_from("ram", slot)
        np.testing.assert_array_equal(store.read("ram"), arena.array(slot)[:3 * BLOCK - 100])
        arena.release(slot)
        after = store.stats()
        assert (after["bytes_read"], after["bytes_written"]) == (before["bytes_read"], before["bytes_written"])
        # a streamed pass reads and writes it back in place, beside a disk region
        store.write("disk", random_bytes(3 * BLOCK, 7))
        from jaxascend.ssd import Segment

        chunks = [[Segment("disk", c * BLOCK, BLOCK), Segment("ram", c * BLOCK, BLOCK if c < 2 else BLOCK - 100)]
                  for c in range(3)]
        with store.stream(chunks, "seg", depth=2) as s:
            for chunk in s:
                chunk.arrays[1][:] = chunk.arrays[0][:len(chunk.arrays[1])]
        np.testing.assert_array_equal(store.read("ram"), store.read("disk")[:3 * BLOCK - 100])
        with pytest.raises(ValueError, match="exceed the region's"):
            store.read("ram", offset=3 * BLOCK, nbytes=BLOCK)
    shard_bytes = sum(os.path.getsize(os.path.join(cfg.dir, f)) for f in os.listdir(cfg.dir) if f.startswith("shard"))
    assert shard_bytes == 3 * BLOCK  # the disk region's only


# ------------------------------------------------------------------------- integrity
def test_flipped_byte_is_detected_with_file_and_offset(store):
    store.add_region("pad", 3 * BLOCK)
    store.add_region("m", 5 * BLOCK)
    store.write("m", random_bytes(5 * BLOCK, 3))
    path, block_start = block_file_offset(store.region("m"), 2)
    with open(path, "r+b") as f:
        f.seek(block_start + 1234)
        byte = f.read(1)
        f.seek(block_start + 1234)
        f.write(bytes([byte[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())
    with pytest.raises(ChecksumError) as info:
        store.read("m")
    msg = str(info.value)
    assert f"crc32c mismatch in {path} at byte offset {block_start}" in msg
    assert "region 'm', block 2" in msg and info.value.errno == errno.EBADMSG
    # Blocks before the damaged one are still fine.
    store.read("m", nbytes=2 * BLOCK)


def test_injected_write_failure_keeps_earlier_data(store):
    store.add_region("a", 3 * BLOCK)
    store.add_region("b", 3 * BLOCK)
    a, b = random_bytes(3 * BLOCK, 4), random_bytes(3 * BLOCK, 5)
    store.write("a", a)
    store.write("b", b)
    with injected_faults("write:1:EIO"):
        with pytest.raises(StoreError) as info:
            store.write("a", random_bytes(3 * BLOCK, 6))
    assert info.value.errno == errno.EIO
    assert "write of 16384 bytes failed: EIO" in str(info.value) and "shard-00000.bin at byte offset" in str(info.value)
    np.testing.assert_array_equal(store.read("b"), b)
    # The failed block kept its old data and checksum; the others took the new data whole.
    got = store.read("a").reshape(3, BLOCK)
    new = random_bytes(3 * BLOCK, 6).reshape(3, BLOCK)
    old = a.reshape(3, BLOCK)
    assert sum((g == o).all() for g, o in zip(got, old)) == 1
    assert all((g == o).all() or (g == n).all() for g, o, n in zip(got, old, new))


def test_injected_enospc_names_the_file_and_operation(store):
    store.add_region("v", 4 * BLOCK)
    v = random_bytes(4 * BLOCK, 7)
    store.write("v", v)
    with injected_faults("write:2:ENOSPC"):
        with pytest.raises(StoreError, match=r"ENOSPC \(No space left on device\), writing .*shard-0000\d\.bin "
                                             r"at byte offset \d+ \(region 'v', block \d\)") as info:
            store.write("v", random_bytes(4 * BLOCK, 8))
    assert info.value.errno == errno.ENOSPC
    store.read("v")  # every block is readable: old or new, never torn
    store.write("v", v)  # and the store still works
    np.testing.assert_array_equal(store.read("v"), v)


def test_short_write_is_an_error_and_the_torn_block_is_caught(store):
    store.add_region("t", BLOCK)
    store.write("t", random_bytes(BLOCK, 9))
    with injected_faults("write:1:SHORT"):
        with pytest.raises(StoreError, match=r"short write: wrote 8192 of 16384 bytes to .*shard-00000.bin"):
            store.write("t", random_bytes(BLOCK, 10))
    with pytest.raises(ChecksumError, match="region 't', block 0"):
        store.read("t")


def test_injected_read_errors(store):
    store.add_region("r", 2 * BLOCK)
    store.write("r", random_bytes(2 * BLOCK, 11))
    with injected_faults("read:2:EIO"):
        with pytest.raises(StoreError, match=r"read of 16384 bytes failed: EIO .*reading .*shard-00000.bin"):
            store.read("r")
    with injected_faults("read:1:SHORT"):
        with pytest.raises(StoreError, match="short read: got 8192 of 16384 bytes from"):
            store.read("r")
    np.testing.assert_array_equal(store.read("r"), random_bytes(2 * BLOCK, 11))


def test_async_write_error_surfaces_on_flush(store):
    store.add_region("g", 2 * BLOCK)
    with injected_faults("write:1:EIO"):
        store.write("g", random_bytes(2 * BLOCK), wait=False)
        with pytest.raises(StoreError, match="EIO"):
            store.flush()


def test_no_space_when_reserving_a_region(store):
    with injected_faults("fallocate:1:ENOSPC"):
        with pytest.raises(StoreError, match=r"cannot reserve \d+ bytes for region 'huge' in .*shard-00000.bin"):
            store.add_region("huge", 3 * BLOCK)
    store.add_region("huge", 3 * BLOCK)  # the failed attempt left no half-made region behind


def _run_python(code, env_extra, tmp_path):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)


def test_fault_injection_from_the_environment(tmp_path):
    code = f"""
        import numpy as np, errno
        from jaxascend.ssd.arena import ArenaPlan, HostArena
        from jaxascend.config import OffloadConfig
        from jaxascend.ssd.store import SsdStore, StoreError
        cfg = OffloadConfig(dir="d", block_bytes={BLOCK}, staging_bytes={BLOCK}, chunk_bytes={BLOCK},
                            shard_bytes={BLOCK}, pin_memory=False)
        with HostArena(ArenaPlan().extend(SsdStore.arena_requests(cfg)), cfg) as a, SsdStore(cfg, a) as s:
            s.add_region("x", {3 * BLOCK})
            try:
                s.write("x", np.ones({3 * BLOCK}, np.uint8))
            except StoreError as e:
                print("errno", e.errno)
    """
    out = _run_python(code, {"JAXASCEND_FAULT": "write:3:ENOSPC"}, tmp_path)
    assert out.stdout.strip() == f"errno {errno.ENOSPC}", out.stderr
    bad = _run_python(code, {"JAXASCEND_FAULT": "write:three:ENOSPC"}, tmp_path)
    assert "JAXASCEND_FAULT" in bad.stderr and "N must be an integer" in bad.stderr


def test_bad_fault_specs_are_rejected():
    with pytest.raises(ValueError, match="unknown operation 'seek'"):
        _native.arm_fault("seek:1:EIO")
    with pytest.raises(ValueError, match="unknown error 'EWHAT'"):
        _native.arm_fault("read:1:EWHAT")


# ------------------------------------------------------------------------- lock
def test_second_opener_is_refused_with_the_holders_pid(tmp_path):
    cfg = make_cfg(tmp_path / "locked")
    arena, first = open_store(cfg)
    with first:
        with pytest.raises(StoreLockedError, match=rf"offload directory {tmp_path / 'locked'} is in use by "
                                                   rf"process {os.getpid()}"):
            SsdStore(cfg, arena)
        code = f"""
            from jaxascend.ssd.arena import ArenaPlan, HostArena
            from jaxascend.config import OffloadConfig
            from jaxascend.ssd.store import SsdStore, StoreLockedError
            cfg = OffloadConfig(dir={str(cfg.dir)!r}, block_bytes={BLOCK}, staging_bytes={4 * BLOCK},
                                chunk_bytes={4 * BLOCK}, shard_bytes={8 * BLOCK}, pin_memory=False)
            try:
                SsdStore(cfg, HostArena(ArenaPlan().extend(SsdStore.arena_requests(cfg)), cfg))
            except StoreLockedError as e:
                print("refused:", e)
        """
        out = _run_python(code, {}, tmp_path)
        assert f"is in use by process {os.getpid()}" in out.stdout, out.stderr
    # Closed: the lock is released, and nothing was deleted.
    assert (tmp_path / "locked" / "shard-00000.bin").exists()
    with SsdStore(cfg, arena) as again:
        assert again.handle != first.handle


# ------------------------------------------------------------------------- fallback
def test_forced_buffered_fallback_round_trips(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="jaxascend.ssd.store"):
        arena, store = open_store(make_cfg(tmp_path / "b", direct_io=False))
    with store:
        assert not store.direct_io and "offload.direct_io is false" in store.io_mode_status
        store.add_region("x", 100_003)
        data = random_bytes(100_003, 12)
        store.write("x", data)
        np.testing.assert_array_equal(store.read("x"), data)
    assert sum("buffered I/O" in r.getMessage() for r in caplog.records) == 1


def test_refused_o_direct_falls_back_and_warns_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxascend.ssd.store"):
        with injected_faults("open_direct:1:EINVAL"):
            arena, store = open_store(make_cfg(tmp_path / "t"))
    with store:
        assert not store.direct_io and "O_DIRECT refused" in store.io_mode_status
        store.add_region("x", 20 * BLOCK)  # several shards, all buffered, no more warnings
        data = random_bytes(20 * BLOCK, 13)
        store.write("x", data)
        np.testing.assert_array_equal(store.read("x"), data)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "EINVAL" in warnings[0].getMessage()


def _is_tmpfs(path):
    try:
        with open("/proc/mounts") as f:
            return any(line.split()[1] == path and line.split()[2] == "tmpfs" for line in f)
    except OSError:
        return False


@pytest.mark.skipif(not _is_tmpfs("/dev/shm"), reason="needs /dev/shm on tmpfs to see a real O_DIRECT refusal")
def test_tmpfs_refuses_o_direct_for_real(tmp_path):
    import tempfile
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        arena, store = open_store(make_cfg(os.path.join(shm, "offload")))
        with store:
            if store.direct_io:
                pytest.skip("/dev/shm accepts O_DIRECT on this kernel")
            assert "EINVAL" in store.io_mode_status
            store.add_region("x", 3 * BLOCK)
            store.write("x", random_bytes(3 * BLOCK))
            np.testing.assert_array_equal(store.read("x"), random_bytes(3 * BLOCK))


# ------------------------------------------------------------------------- argument errors
def test_bad_requests_have_clear_messages(store):
    store.add_region("w", 3 * BLOCK + 5)
    with pytest.raises(ValueError, match="no region named 'nope'"):
        store.read("nope")
    with pytest.raises(ValueError, match="offset 4096 is not a multiple of the block size 16384"):
        store.read("w", offset=4096, nbytes=BLOCK)
    with pytest.raises(ValueError, match=r"bytes \[16384, 65536\) exceed the region's 49157 bytes"):
        store.read("w", offset=BLOCK, nbytes=3 * BLOCK)
    with pytest.raises(ValueError, match="length 1000 is not a multiple of the block size 16384 and does not end"):
        store.write("w", np.zeros(1000, np.uint8))
    with pytest.raises(ValueError, match="a region named 'w' already exists"):
        store.add_region("w", 10)
    with pytest.raises(ValueError, match="nbytes must be >= 1"):
        store.add_region("empty", 0)


def test_store_needs_staging_slots_in_the_plan(tmp_path):
    cfg = make_cfg(tmp_path / "s")
    arena = HostArena(ArenaPlan().add("mlp", 4096), cfg)
    with pytest.raises(ArenaError, match="no slots of shape class 'ssd_staging'.*needs 2 'ssd_staging' slots"):
        SsdStore(cfg, arena)


def test_closed_store_refuses_io_and_close_is_idempotent(tmp_path):
    arena, store = open_store(make_cfg(tmp_path / "c"))
    store.add_region("x", BLOCK)
    store.close()
    store.close()
    assert store.closed
    with pytest.raises(ValueError, match="closed"):
        store.write("x", np.zeros(BLOCK, np.uint8))
    assert arena.in_use_bytes == 0  # the staging slots went back to the arena


# ------------------------------------------------------------------------- crc32c
def test_crc32c_known_value_and_implementations_agree():
    check = np.frombuffer(b"123456789", np.uint8)
    assert _native.crc32c(check) == 0xE3069283
    assert _native.crc32c(check, implementation="software") == 0xE3069283
    data = random_bytes(100_000, 14)
    sw = [_native.crc32c(data[i:], implementation="software") for i in (0, 1, 7)]
    assert [_native.crc32c(data[i:]) for i in (0, 1, 7)] == sw
    if _native.crc32c_hardware_available():
        assert [_native.crc32c(data[i:], implementation="hardware") for i in (0, 1, 7)] == sw
    # Chaining, like zlib.crc32.
    assert _native.crc32c(data[40_000:], _native.crc32c(data[:40_000])) == sw[0]


# ------------------------------------------------------------------------- config
def test_offload_config_validates_the_engine_sizes():
    from jaxascend.config import ConfigError
    cfg = OffloadConfig(block_bytes="64KiB", chunk_bytes="1MiB", shard_bytes="4MiB", staging_bytes="128KiB")
    assert (cfg.block_bytes, cfg.chunk_bytes, cfg.shard_bytes, cfg.staging_bytes) == (65536, 1 << 20, 4 << 20, 131072)
    with pytest.raises(ConfigError, match="offload.block_bytes: must be a multiple of 4096, got 5000"):
        OffloadConfig(block_bytes=5000)
    with pytest.raises(ConfigError, match=r"offload.chunk_bytes: must be a multiple of offload.block_bytes=1048576"):
        OffloadConfig(chunk_bytes="1536KiB")
    with pytest.raises(ConfigError, match=r"offload.shard_bytes: must be >= 1048576"):
        OffloadConfig(shard_bytes="512KiB")
    with pytest.raises(ConfigError, match=r"offload.stream_depth: must be >= 2 and <= 64, got 1"):
        OffloadConfig(stream_depth=1)
    with pytest.raises(ConfigError, match=r"offload.staging_slots"):
        OffloadConfig(staging_slots=0)


def test_kept_files_reopen_with_what_a_run_wrote_and_adopt_its_checksums(tmp_path):
    """keep_files (durable steps): the same regions, added in the same order, read back what the
    last store wrote; a block's crc32c is adopted on its first read, then checked as always."""
    cfg = make_cfg(tmp_path / "offload")
    sizes = {"a": 5 * BLOCK + 100, "b": 9 * BLOCK, "c": 3 * BLOCK + 7}  # across shards of 8 blocks
    data = {name: random_bytes(n, seed=k) for k, (name, n) in enumerate(sizes.items())}
    arena, s = open_store(cfg)
    with s:
        for name, n in sizes.items():
            s.add_region(name, n)
            s.write(name, data[name])
        s.sync()
    arena2 = HostArena(ArenaPlan().extend(SsdStore.arena_requests(cfg)), cfg)
    with SsdStore(cfg, arena2, keep_files=True) as kept:
        for name, n in sizes.items():
            kept.add_region(name, n)
        for name in sizes:
            np.testing.assert_array_equal(kept.read(name), data[name])
        kept.write("b", random_bytes(BLOCK, seed=9), offset=2 * BLOCK)
        np.testing.assert_array_equal(kept.read("b", 2 * BLOCK, BLOCK), random_bytes(BLOCK, seed=9))
        path = kept.region("a").extents[0].shard_path
        with open(path, "r+b") as f:  # flip a byte of a block whose crc is now known
            f.seek(kept.region("a").extents[0].file_offset + 10)
            byte = f.read(1)
            f.seek(kept.region("a").extents[0].file_offset + 10)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(ChecksumError, match="crc32c mismatch"):
            kept.read("a", 0, BLOCK)
    arena3 = HostArena(ArenaPlan().extend(SsdStore.arena_requests(cfg)), cfg)
    with SsdStore(cfg, arena3) as fresh:  # without keep_files: truncated, as a new run's
        fresh.add_region("b", sizes["b"])
        assert not fresh.read("b").any()
