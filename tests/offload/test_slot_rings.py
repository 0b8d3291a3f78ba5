"""The durable steps' slot rings (``offload/slot_rings.py``): records of one size rotate through
their home slots and W spares; a record never overwrites itself, and whatever a crash tears, the
slot a resume reads each record from holds it whole.

The simulation plays updates over a real layout's chunks on a model disk (slot -> (chunk,
version)). Its crash is adversarial: every write issued after the last commit may be torn, the
write-behind's included, and the resume must still find every record, old or new, intact."""

import jax.numpy as jnp
import pytest

from jaxascend.offload import OffloadLayout
from jaxascend.offload.slot_rings import SPARE_PREFIX, SlotRings
from tests.offload.test_state import BLOCK, STACKED, offload_cfg, spec

TORN = ("torn", -1)


def _rings(tmp_path, spares):
    layout = OffloadLayout.plan(spec(jnp.bfloat16), offload_cfg(tmp_path), stacked=STACKED)
    chunks = layout.chunks()
    return chunks, SlotRings.plan(chunks, layout.step_order(chunks), spares, BLOCK)


def test_records_of_one_size_share_a_ring_with_its_spares(tmp_path):
    chunks, rings = _rings(tmp_path, spares=2)
    sizes = {c.state_bytes for c in chunks}
    assert sorted(r.nbytes for r in rings.rings) == sorted(sizes)
    for ring in rings.rings:
        assert ring.spares == min(2, len(ring.members))
        assert ring.size == len(ring.members) + ring.spares
        assert all(chunks[i].state_bytes == ring.nbytes for i in ring.members)
        assert all(s.region.startswith(SPARE_PREFIX) for s in ring.slots[len(ring.members):])
    # every spare slot is a region's room: whole blocks side by side, a short record its own region
    assert rings.spare_bytes == sum(r.spares * r.nbytes for r in rings.rings)
    for name, nbytes in rings.spare_regions:
        ring = next(r for r in rings.rings if name.startswith(f"{SPARE_PREFIX}/{r.nbytes}"))
        assert nbytes == (ring.spares * ring.nbytes if ring.nbytes % BLOCK == 0 else ring.nbytes)
    # before any update every record is at home, and the first W of a ring go to the spares
    homes = [(c.leaf.state_regions[c.layer], c.state_offset) for c in chunks]
    reads = [(read.region, read.offset) for read, _ in rings.locations(rings.initial_rotations())]
    assert reads == homes
    with pytest.raises(ValueError, match="offload.durable_spares: must be >= 1, got 0"):
        _rings(tmp_path, spares=0)


def test_a_commit_is_needed_only_w_places_back_in_the_ring(tmp_path):
    chunks, rings = _rings(tmp_path, spares=3)
    needs = rings.commit_needs()
    for p, i in enumerate(rings.order):
        r, k = rings.ring_of[i]
        ring = rings.rings[r]
        if k < ring.spares:
            assert needs[p] == -1
        else:
            # at least W positions back: with W >= the stream's depth it is written already
            assert rings.order[needs[p]] == ring.members[k - ring.spares] and needs[p] <= p - ring.spares


def _update(rings, disk, rotations, version, crash_at=None):
    """One update at ``rotations`` taking every record from ``version`` to ``version + 1``,
    committing as late as the rule allows (through exactly the position a write needs). Returns
    the position committed through. With ``crash_at``: stops as that position's write is issued,
    tearing it and every write issued after the position last committed (all may be in flight)."""
    locations = rings.locations(rotations)
    needs = rings.commit_needs()
    committed, issued = -1, []
    for p, i in enumerate(rings.order):
        read, write = locations[i]
        assert disk[read] == (i, version), f"position {p}: chunk {i} reads {disk[read]} from {read}"
        if needs[p] > committed:
            committed = needs[p]
            issued = [(q, slot) for q, slot in issued if q > committed]
        issued.append((p, write))
        if p == crash_at:
            for _, slot in issued:
                disk[slot] = TORN
            return committed
        disk[write] = (i, version + 1)
    return len(rings.order) - 1


@pytest.mark.parametrize("spares", [1, 2, 3, 5])
def test_a_crash_anywhere_leaves_every_record_whole_where_the_resume_reads_it(tmp_path, spares):
    chunks, rings = _rings(tmp_path, spares)
    rotations = rings.initial_rotations()
    disk = {read: (i, 0) for i, (read, _) in enumerate(rings.locations(rotations))}
    for version in range(4):  # several updates: the rings turn past their ends
        for crash_at in range(len(rings.order)):
            trial = dict(disk)
            committed = _update(rings, trial, rotations, version, crash_at)
            # the resume: committed records are new, the rest old, all intact
            for p, i in enumerate(rings.order):
                slot = rings.current(rotations, committed)[i]
                assert trial[slot] == (i, version + 1 if p <= committed else version), (version, crash_at, p)
            # and it rolls the rest forward from their old slots, to the same disk as no crash
            locations = rings.locations(rotations)
            for p, i in enumerate(rings.order[committed + 1:], start=committed + 1):
                trial[locations[i][1]] = (i, version + 1)
            clean = dict(disk)
            _update(rings, clean, rotations, version)
            live = [rings.locations(rings.advanced(rotations))[i][0] for i in range(len(chunks))]
            assert [trial[s] for s in live] == [clean[s] for s in live] == [(i, version + 1) for i in range(len(chunks))]
        _update(rings, disk, rotations, version)
        rotations = rings.advanced(rotations)


def test_no_two_chunks_write_one_slot_and_none_reads_what_an_earlier_one_wrote(tmp_path):
    """What the stream's overlap check asks of a pass, over several rotations."""
    chunks, rings = _rings(tmp_path, spares=2)
    rotations = rings.initial_rotations()
    position = {i: p for p, i in enumerate(rings.order)}
    for _ in range(7):
        locations = rings.locations(rotations)
        writer = {}
        for i, (_, write) in enumerate(locations):
            assert write not in writer
            writer[write] = position[i]
        for i, (read, _) in enumerate(locations):
            assert writer.get(read, len(chunks)) >= position[i]  # written, if at all, by a later chunk
        rotations = rings.advanced(rotations)
