"""Pipelined streaming passes: correctness against numpy, read-ahead and write-behind really
overlap the consumer, no arena growth over repeated passes, early exits, errors; on both I/O
engines."""

import time

import numpy as np
import pytest

from jaxascend.config import OffloadConfig
from jaxascend.ssd import ArenaError, ArenaPlan, HostArena, Segment, SsdStore, StoreError
from jaxascend.ssd.store import chunk_segments, injected_faults

BLOCK = 16384
CHUNK_ELEMS = 8192  # 32 KiB of fp32 (2 blocks), 16 KiB of fp16 (1 block)
N = 100_000  # elements per tensor: 13 chunks, the last one partial


@pytest.fixture(params=["io_uring", "threads"])
def env(tmp_path, request):
    cfg = OffloadConfig(dir=str(tmp_path / "offload"), block_bytes=BLOCK, staging_bytes=4 * BLOCK,
                        chunk_bytes=2 * BLOCK, shard_bytes=16 * BLOCK, io_threads=3, stream_depth=3,
                        io_engine=request.param, queue_depth=4, pin_memory=False)
    plan = (ArenaPlan().extend(SsdStore.arena_requests(cfg))
            .add("state", 4 * CHUNK_ELEMS, count=2 * cfg.stream_depth)
            .add("grad", 2 * CHUNK_ELEMS, count=cfg.stream_depth))
    arena = HostArena(plan, cfg)
    store = SsdStore(cfg, arena)
    for name in ("w", "m"):
        store.add_region(name, 4 * N)
    store.add_region("g", 2 * N)
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(N).astype(np.float32)
    g0 = rng.standard_normal(N).astype(np.float16)
    store.write("w", w0)
    store.write("g", g0)
    with store:
        yield arena, store, w0, g0


def update_chunks(store):
    return chunk_segments(store, [("w", np.float32, "rw"), ("m", np.float32, "rw"), ("g", np.float16, "r")],
                          CHUNK_ELEMS)


def run_update(store, chunks, on_chunk=None):
    with store.stream(chunks, ["state", "state", "grad"], dtypes=[np.float32, np.float32, np.float16]) as s:
        for chunk in s:
            w, m, g = chunk.arrays
            m += g.astype(np.float32)
            w -= np.float32(0.1) * m
            if on_chunk:
                on_chunk(chunk)


def test_update_passes_match_numpy_and_do_not_grow_the_arena(env):
    arena, store, w0, g0 = env
    chunks = update_chunks(store)
    assert len(chunks) == 13 and chunks[-1][0].nbytes == 4 * (N - 12 * CHUNK_ELEMS)
    staging = arena.in_use_bytes
    run_update(store, chunks)
    high_water = arena.high_water_bytes
    for _ in range(4):
        run_update(store, chunks)
    assert arena.high_water_bytes == high_water  # steady state: no new buffers
    assert arena.in_use_bytes == staging  # every stream slot went back
    w_ref, m_ref = w0.copy(), np.zeros(N, np.float32)
    for _ in range(5):
        m_ref += g0.astype(np.float32)
        w_ref -= np.float32(0.1) * m_ref
    np.testing.assert_array_equal(store.read("m", dtype=np.float32), m_ref)
    np.testing.assert_array_equal(store.read("w", dtype=np.float32), w_ref)
    np.testing.assert_array_equal(store.read("g", dtype=np.float16), g0)  # read-only: untouched


def test_next_chunk_is_read_and_previous_written_while_the_consumer_works(env):
    """Hold each chunk for a while; meanwhile chunk k+1 must be read and chunk k-1 written."""
    arena, store, _, _ = env
    chunks = update_chunks(store)
    bytes_per_chunk_read = [sum(-(-s.nbytes // 4096) * 4096 for s in c) for c in chunks]
    bytes_per_chunk_written = [sum(-(-s.nbytes // 4096) * 4096 for s in c if s.write) for c in chunks]
    base = store.stats()
    seen = []

    def hold(chunk):
        # "Compute" while holding chunk k: wait (up to 5 s, for a loaded machine) until the read of
        # chunk k+1 and the write of chunk k-1 have completed. A pipeline that never issues them
        # keeps the counters short, and the asserts below fail.
        k = chunk.index
        want_read = sum(bytes_per_chunk_read[:k + 2])
        want_written = sum(bytes_per_chunk_written[:k]) if k >= 1 else 0
        deadline = time.monotonic() + 5.0
        while True:
            st = store.stats()
            read, written = st["bytes_read"] - base["bytes_read"], st["bytes_written"] - base["bytes_written"]
            if (read >= want_read and written >= want_written) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        seen.append((k, read, written))

    run_update(store, chunks, on_chunk=hold)
    for k, read, written in seen[:-1]:
        assert read >= sum(bytes_per_chunk_read[:k + 2]), f"chunk {k + 1} was not read ahead"
        if k >= 1:
            assert written >= sum(bytes_per_chunk_written[:k]), f"chunk {k - 1} was not written behind"


def test_write_only_and_read_only_passes(env):
    arena, store, w0, _ = env
    chunks = chunk_segments(store, [("m", np.float32, "w")], CHUNK_ELEMS)
    with store.stream(chunks, "state", dtypes=np.float32) as s:
        for chunk in s:
            chunk.arrays[0][:] = chunk.index
    expected = np.repeat(np.arange(13, dtype=np.float32), CHUNK_ELEMS)[:N]
    np.testing.assert_array_equal(store.read("m", dtype=np.float32), expected)
    seen = []
    with store.stream(chunk_segments(store, [("w", np.float32, "r")], CHUNK_ELEMS), "state", np.float32) as s:
        for chunk in s:
            seen.append(chunk.arrays[0].copy())
            chunk.arrays[0][:] = 0  # not written back
    np.testing.assert_array_equal(np.concatenate(seen), w0)
    np.testing.assert_array_equal(store.read("w", dtype=np.float32), w0)


def test_break_writes_back_the_chunk_in_hand_and_an_exception_does_not(env):
    arena, store, _, _ = env
    chunks = chunk_segments(store, [("m", np.float32, "rw")], CHUNK_ELEMS)
    staging = arena.in_use_bytes
    with store.stream(chunks, "state", np.float32) as s:
        for chunk in s:
            chunk.arrays[0][:] = 1
            if chunk.index == 2:
                break
    with pytest.raises(RuntimeError, match="consumer failed"):
        with store.stream(chunks, "state", np.float32) as s:
            for chunk in s:
                chunk.arrays[0][:] += 10  # chunk 0 (and 1) are written back, the failing one is not
                if chunk.index == 2:
                    raise RuntimeError("consumer failed")
    m = store.read("m", dtype=np.float32)
    np.testing.assert_array_equal(m[:2 * CHUNK_ELEMS], 11)
    np.testing.assert_array_equal(m[2 * CHUNK_ELEMS:3 * CHUNK_ELEMS], 1)
    np.testing.assert_array_equal(m[3 * CHUNK_ELEMS:], 0)
    assert arena.in_use_bytes == staging


def test_io_errors_in_a_pass_surface_with_the_file(env):
    arena, store, _, _ = env
    chunks = update_chunks(store)
    with injected_faults("read:7:EIO"):
        with pytest.raises(StoreError, match=r"read of \d+ bytes failed: EIO .*shard-\d+\.bin at byte offset"):
            run_update(store, chunks)
    with injected_faults("write:5:ENOSPC"):
        with pytest.raises(StoreError, match="ENOSPC"):
            run_update(store, chunks)
    staging = SsdStore.arena_requests(store.cfg)[0]
    assert arena.in_use_bytes == staging.total_bytes  # slots released after failed passes too


def test_stream_argument_errors(env):
    arena, store, _, _ = env
    with pytest.raises(ValueError, match="chunk 1 segment 0 overlap in region 'w'.* written back"):
        store.stream([[Segment("w", 0, 2 * BLOCK)], [Segment("w", BLOCK, BLOCK)]], "state")
    store.stream([[Segment("w", 0, 2 * BLOCK, write=False)], [Segment("w", 0, BLOCK, write=False)]],
                 "state").finish()  # overlapping reads are fine
    with pytest.raises(ValueError, match="depth must be in"):
        store.stream(update_chunks(store), ["state", "state", "grad"], depth=1)
    with pytest.raises(ValueError, match="chunk 0 has 1 segments, expected 2"):
        store.stream([[Segment("w", 0, BLOCK)]], ["state", "grad"])
    with pytest.raises(ValueError, match="offset 100 is not a multiple"):
        store.stream([[Segment("w", 100, BLOCK)]], "state")
    with pytest.raises(ArenaError, match="all 6 slots of shape class 'state' .* in use.*depth 4 needs 8 slots of class 'state': 2 per stage"):
        store.stream(update_chunks(store), ["state", "state", "grad"], depth=4)
    with pytest.raises(ValueError, match="not a multiple of offload.block_bytes"):
        chunk_segments(store, [("w", np.float32, "rw")], 1000)
    with pytest.raises(ValueError, match="region 'g' holds 100000 elements, expected 50000"):
        chunk_segments(store, [("g", np.float32, "r"), ("g", np.float16, "r")], 8192)


def test_copy_on_write_segments_move_each_record_one_slot_down(env):
    """A ring of 4 records and one spare slot: chunk k reads slot k + 1 and writes slot k (chunk
    0 into the spare, slot 0), each record updated on the way; reading a slot that an earlier
    chunk of the pass writes is refused (the read-ahead would see stale bytes)."""
    arena, store, _, _ = env
    rec = 4 * CHUNK_ELEMS  # bytes: two blocks
    store.add_region("ring", 5 * rec)
    x = np.arange(4 * CHUNK_ELEMS, dtype=np.float32)
    store.write("ring", x, offset=rec)  # records in slots 1..4, slot 0 free
    chunks = [[Segment("ring", (k + 1) * rec, rec, write_region="ring", write_offset=k * rec)] for k in range(4)]
    with store.stream(chunks, "state", dtypes=np.float32) as s:
        for chunk in s:
            chunk.arrays[0] += 1
            if chunk.index == 2:
                s.wait_written_through(1)  # chunks 0 and 1 are on disk now
                assert s.written_through >= 1
                np.testing.assert_array_equal(store.read("ring", 0, 2 * rec, np.float32), x[:2 * CHUNK_ELEMS] + 1)
    got = store.read("ring", 0, 5 * rec, np.float32)
    np.testing.assert_array_equal(got[:4 * CHUNK_ELEMS], x + 1)
    np.testing.assert_array_equal(got[4 * CHUNK_ELEMS:], x[3 * CHUNK_ELEMS:])  # slot 4: chunk 3's old record
    backwards = [[Segment("ring", k * rec, rec, write_region="ring", write_offset=(k + 1) * rec)] for k in range(4)]
    with pytest.raises(ValueError, match="chunk 1 reads what chunk 0 writes before it"):
        store.stream(backwards, "state")
    twice = [[Segment("ring", 0, rec, write=False)], [Segment("ring", rec, rec, write_region="ring", write_offset=0)],
             [Segment("ring", 2 * rec, rec, write_region="ring", write_offset=0)]]
    with pytest.raises(ValueError, match="both are written back"):
        store.stream(twice, "state")
