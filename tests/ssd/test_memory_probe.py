"""Page-cache accounting with mincore, and the background sampler."""

import os

import numpy as np

from jaxascend.ssd import MemorySampler, page_cache_bytes
from jaxascend.ssd.memory_probe import file_page_cache_bytes


def test_written_file_is_in_page_cache_until_dropped(tmp_path):
    path = tmp_path / "f.bin"
    data = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    assert file_page_cache_bytes(str(path)) >= (8 << 20) * 0.9  # just written: cached
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert file_page_cache_bytes(str(path)) <= (8 << 20) * 0.1  # clean pages dropped on request


def test_missing_and_empty_files_count_zero(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    assert page_cache_bytes([str(tmp_path / "empty"), str(tmp_path / "missing")]) == 0


def test_sampler_tracks_peaks(tmp_path):
    path = tmp_path / "g.bin"
    path.write_bytes(b"x" * (1 << 20))
    with MemorySampler(lambda: [str(path)], interval=0.01) as sampler:
        block = np.ones(64 << 20, np.uint8)  # 64 MiB more RSS
        block.sum()
        sampler.sample()
        del block
    assert len(sampler.samples) >= 3
    assert sampler.peak_rss >= sampler.samples[0].rss + (60 << 20)
    assert sampler.peak_page_cache >= 1 << 20
    assert sampler.peak_total >= sampler.peak_rss
