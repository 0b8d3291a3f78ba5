"""The host arena: exact-size carving, budget errors, slot reuse, zero-copy views, lock/pin guards."""

import logging

import numpy as np
import pytest

from jaxascend.native import extension as _native
from jaxascend.config import OffloadConfig
from jaxascend.ssd import ArenaError, ArenaPlan, HostArena, SlotRequest
from jaxascend.ssd.arena import physical_memory_bytes
from jaxascend.ssd.store import injected_faults


def _cfg(**kw):
    kw.setdefault("pin_memory", False)
    return OffloadConfig(**kw)


def test_slots_are_carved_at_exact_sizes_rounded_only_to_4096():
    plan = ArenaPlan().add("attention", 20000, count=2).add("norm", 1).add("mlp", 4096 * 3)
    with HostArena(plan, _cfg()) as arena:
        slots = arena.slots()
        assert [(s.shape_class, s.nbytes, s.capacity) for s in slots] == [
            ("attention", 20000, 20480), ("attention", 20000, 20480), ("norm", 1, 4096), ("mlp", 12288, 12288)]
        # Back to back, no power-of-two padding: 20480 (not 32768) per attention slot.
        assert [s.offset for s in slots] == [0, 20480, 40960, 45056]
        assert arena.carved_bytes == plan.total_bytes == 57344
        assert arena.capacity == plan.total_bytes  # offload.arena_bytes unset: exactly the plan
        for s in slots:
            assert arena.array(s).__array_interface__["data"][0] % 4096 == 0


def test_arena_bytes_sets_the_capacity():
    with HostArena(ArenaPlan().add("mlp", 5000), _cfg(arena_bytes="1MiB")) as arena:
        assert arena.capacity == 1 << 20
        assert arena.carved_bytes == 8192


def test_plan_larger_than_arena_bytes_names_the_bytes_needed():
    plan = ArenaPlan().add("mlp", 3 << 20, count=2).add("norm", 100)
    with pytest.raises(ArenaError, match=r"needs 6295552 bytes .*mlp: 6291456, norm: 4096.* "
                                         r"offload.arena_bytes is 4194304 bytes"):
        HostArena(plan, _cfg(arena_bytes="4MiB"))


def test_plan_over_the_host_memory_budget_is_refused():
    plan = ArenaPlan().add("embedding", 10 << 20)
    with pytest.raises(ArenaError, match=r"needs 10485760 bytes .* offload.host_memory_budget is 8388608 bytes"):
        HostArena(plan, _cfg(host_memory_budget="8MiB"))
    with pytest.raises(ArenaError, match="host_memory_budget"):
        HostArena(ArenaPlan().add("mlp", 4096), _cfg(arena_bytes="16MiB", host_memory_budget="8MiB"))


def test_plan_larger_than_ram_is_refused_before_allocating():
    ram = physical_memory_bytes()
    with pytest.raises(ArenaError, match=f"this machine has {ram} bytes"):
        HostArena(ArenaPlan().add("mlp", ram + 4096), _cfg())


def test_native_create_checks_the_plan_too():
    with pytest.raises(ArenaError, match=r"plan needs 8192 bytes .* capacity is 4096 bytes"):
        _native.Arena.create(4096, [("mlp", 4097, 1)], False, False)


def test_bad_plan_entries_are_rejected():
    with pytest.raises(ValueError, match="shape_class"):
        SlotRequest("", 10)
    with pytest.raises(ValueError, match="nbytes: must be >= 1"):
        ArenaPlan().add("mlp", 0)
    with pytest.raises(ValueError, match="count: must be >= 1"):
        ArenaPlan().add("mlp", 10, count=0)


def test_acquire_release_and_high_water_mark():
    plan = ArenaPlan().add("mlp", 8192, count=2).add("mlp", 16384).add("norm", 100)
    with HostArena(plan, _cfg()) as arena:
        a = arena.acquire("mlp", 5000)  # smallest slot that fits
        assert a.capacity == 8192
        b = arena.acquire("mlp", 8192)
        c = arena.acquire("mlp", 5000)  # the small ones are taken: the big one
        assert c.capacity == 16384
        assert arena.in_use_bytes == arena.high_water_bytes == 32768
        for s in (a, b, c):
            arena.release(s)
        assert arena.in_use_bytes == 0 and arena.high_water_bytes == 32768
        with arena.borrow("norm", 1) as n:
            assert n.shape_class == "norm"
        assert arena.high_water_bytes == 32768
        assert arena.stats()["slots"] == 4


def test_slot_errors_say_what_is_missing():
    with HostArena(ArenaPlan().add("mlp", 8192).add("norm", 64), _cfg()) as arena:
        with pytest.raises(ArenaError, match=r"no slots of shape class 'attention' \(planned classes: 'mlp', 'norm'\)"):
            arena.acquire("attention", 10)
        with pytest.raises(ArenaError, match=r"no slot of shape class 'mlp' holds 9000 bytes .*largest: 8192"):
            arena.acquire("mlp", 9000)
        slot = arena.acquire("mlp", 10)
        with pytest.raises(ArenaError, match="all 1 slots of shape class 'mlp' .* are in use"):
            arena.acquire("mlp", 10)
        arena.release(slot)
        with pytest.raises(ValueError, match="is not acquired"):
            arena.release(slot)


def test_views_are_zero_copy_and_typed():
    with HostArena(ArenaPlan().add("mlp", 4 * 1000), _cfg()) as arena:
        (slot,) = arena.slots()
        f32 = arena.array(slot, np.float32)
        f32[:] = np.arange(1000, dtype=np.float32)
        again = arena.array(slot, np.float32, shape=(10, 100))
        assert again[3, 7] == 307.0
        assert again.__array_interface__["data"][0] == f32.__array_interface__["data"][0]
        with pytest.raises(ValueError, match="4000 bytes, not a whole number of .*V3"):
            arena.array(slot, np.dtype("V3"))


def test_views_keep_the_memory_alive_after_close():
    arena = HostArena(ArenaPlan().add("mlp", 4096), _cfg())
    view = arena.array(arena.slots()[0], np.uint32)
    arena.close()
    view[:] = 7  # still valid memory: the view owns a reference to the native arena
    assert int(view.sum()) == 7 * 1024
    with pytest.raises(ValueError, match="closed"):
        arena.acquire("mlp", 1)


def test_mlock_failure_falls_back_to_unlocked_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxascend.ssd.arena"):
        with injected_faults("mlock:1:ENOMEM"):
            arena = HostArena(ArenaPlan().add("mlp", 8192), _cfg())
    assert not arena.locked
    assert "mlock of 8192 bytes" in arena.lock_status and "ENOMEM" in arena.lock_status
    assert "RLIMIT_MEMLOCK" in arena.lock_status
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not locked" in warnings[0].getMessage()
    arena.array(arena.slots()[0])[:] = 1  # usable all the same


def test_lock_memory_false_skips_mlock():
    arena = HostArena(ArenaPlan().add("mlp", 4096), _cfg(lock_memory=False))
    assert not arena.locked and "not requested" in arena.lock_status


def test_pinning_is_guarded_without_a_cuda_device():
    cuda = _native.cuda_runtime_status()
    if cuda["device_count"] > 0:
        pytest.skip("a CUDA device is present; see test_pinning_registers_with_cuda")
    arena = HostArena(ArenaPlan().add("mlp", 4096), _cfg(pin_memory=True))
    assert not arena.pinned
    assert arena.pin_status == cuda["status"]
    assert ("no CUDA runtime found" in cuda["status"]) or ("found, but" in cuda["status"])
    off = HostArena(ArenaPlan().add("mlp", 4096), _cfg(pin_memory=False))
    assert not off.pinned and "not requested" in off.pin_status


@pytest.mark.skipif(_native.cuda_runtime_status()["device_count"] == 0,
                    reason="needs a CUDA runtime and device (cudaHostRegister path); "
                           "scripts/gpu_check.sh checks it with a DMA round trip on a GPU machine")
def test_pinning_registers_with_cuda():
    arena = HostArena(ArenaPlan().add("mlp", 1 << 20), _cfg(pin_memory=True))
    assert arena.pinned, arena.pin_status
    assert "cudaHostRegister" in arena.pin_status


def test_next_power_of_two():
    from jaxascend.ssd.arena import next_power_of_two

    assert [next_power_of_two(n) for n in (1, 2, 3, 4096, 4097)] == [1, 2, 4, 4096, 8192]
