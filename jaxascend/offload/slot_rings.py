"""Where each state record lives while steps are durable: rings of equal slots that rotate.

An update rewrites every state record (master, m, v) of a step. Rewritten in place, a record
whose write a crash tears is lost: neither the old values (to redo the update from the gradient)
nor the new ones survive. So with durable steps a record never overwrites itself. Every record of
a given size (:attr:`ChunkRef.state_bytes`) belongs to one :class:`SlotRing`: its chunks, in the
step's order (``k = 0 .. N-1``), and their ``N`` home slots plus ``W`` spare slots (``M = N + W``).
A ring has one counter, its rotation ``r``::

    chunk k is read from    slot[(k + r) % M]
    and written to          slot[(k + r - W) % M]      (the old slot of chunk k - W)
    after the step          r = (r - W) % M

So chunk k's new record lands where chunk k - W's old one was, and chunks 0 .. W-1 land in the
``W`` slots that were free. The one rule that keeps every record recoverable: **chunk k's write
may be issued only once chunk k - W's new record is committed** (on disk, and a journal says so).
A commit names a position in the step's order (``committed_through``); every chunk at or before
it is read from its new slot on resume, every chunk after it from its old slot, which nothing has
touched: the only writes that reach an old slot are those of chunks W places later in its ring,
which wait for the commit. A torn write therefore only ever hits a slot no live record is in.

:meth:`SlotRings.commit_needs` gives, per step position, the position that must be committed
before that chunk's write: the update commits lazily, when it reaches such a chunk, everything
written so far. With ``W`` at least the stream's depth the chunk it needs is already written (the
write-behind is at most ``depth - 1`` chunks behind), so a commit waits for no I/O.

The spare slots are store regions of their own (:meth:`SlotRings.spare_regions`): ``W`` records
per ring, ``W = min(offload.durable_spares, N)``. A record that is not whole SSD blocks (the last,
short chunk of a layer) may only be written at a region's end, so each of its spares is a region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from jaxascend.offload.layout import ChunkRef
from jaxascend.offload.step_journal import SLOT_BYTES

SPARE_PREFIX = "durable/spare"
PARAM_SPARES = 1  # spare layers per streamed leaf whose bfloat16 master is its weights (ParamRings)


@dataclass(frozen=True)
class Slot:
    """Where one record fits: ``region`` (a store region name) at byte ``offset``."""

    region: str
    offset: int


@dataclass(frozen=True)
class SlotRing:
    """The chunks whose records are ``nbytes`` long, in step order, and the slots they rotate through."""

    nbytes: int
    members: tuple[int, ...]  # chunk indices (into the layout's chunks), in the step's order
    slots: tuple[Slot, ...]  # the members' home slots in the same order, then the spares
    spares: int  # W

    @property
    def size(self) -> int:
        """M: slots in the ring."""
        return len(self.slots)

    def read_slot(self, k: int, rotation: int) -> Slot:
        """Where member ``k``'s record is before an update at ``rotation``."""
        return self.slots[(k + rotation) % self.size]

    def write_slot(self, k: int, rotation: int) -> Slot:
        """Where the update at ``rotation`` writes member ``k``'s new record."""
        return self.slots[(k + rotation - self.spares) % self.size]

    def advanced(self, rotation: int) -> int:
        """The rotation after an update at ``rotation``."""
        return (rotation - self.spares) % self.size


@dataclass(frozen=True)
class SlotRings:
    """Every record's ring, for one layout and one step order (:meth:`plan`)."""

    rings: tuple[SlotRing, ...]
    order: tuple[int, ...]  # chunk indices in the step's order: position p -> chunk
    ring_of: tuple[tuple[int, int], ...]  # per chunk index: (ring index, member k)
    position: tuple[int, ...]  # per chunk index: its place in ``order``
    spare_regions: tuple[tuple[str, int], ...]  # (region name, bytes) to add to the store

    @classmethod
    def plan(cls, chunks: Sequence[ChunkRef], order: Sequence[int], spares: int, block_bytes: int) -> "SlotRings":
        """The rings of ``chunks`` (the layout's, each with its state region name in
        ``chunk.leaf.state_regions[chunk.layer]``) updated in ``order``, with up to ``spares``
        spare slots each."""
        if spares < 1:
            raise ValueError(f"offload.durable_spares: must be >= 1, got {spares}")
        by_size: dict[int, list[int]] = {}
        for i in order:
            by_size.setdefault(chunks[i].state_bytes, []).append(i)
        rings, regions, ring_of = [], [], [None] * len(chunks)
        for r, (nbytes, members) in enumerate(sorted(by_size.items())):
            w = min(spares, len(members))
            homes = [Slot(chunks[i].leaf.state_regions[chunks[i].layer], chunks[i].state_offset) for i in members]
            if nbytes % block_bytes == 0:  # whole blocks: the ring's spares side by side in one region
                name = f"{SPARE_PREFIX}/{nbytes}"
                regions.append((name, w * nbytes))
                extra = [Slot(name, j * nbytes) for j in range(w)]
            else:  # a short record ends its region: one region per spare
                extra = [Slot(f"{SPARE_PREFIX}/{nbytes}/{j}", 0) for j in range(w)]
                regions += [(s.region, nbytes) for s in extra]
            rings.append(SlotRing(nbytes, tuple(members), tuple(homes + extra), w))
            for k, i in enumerate(members):
                ring_of[i] = (r, k)
        if any(x is None for x in ring_of):
            missing = next(i for i, x in enumerate(ring_of) if x is None)
            raise ValueError(f"durable steps: chunk {missing} is not in the step order")
        position = [0] * len(chunks)
        for p, i in enumerate(order):
            position[i] = p
        return cls(tuple(rings), tuple(order), tuple(ring_of), tuple(position), tuple(regions))

    @property
    def spare_bytes(self) -> int:
        """Disk the spare slots add to the state."""
        return sum(n for _, n in self.spare_regions)

    def initial_rotations(self) -> tuple[int, ...]:
        """Every record in its home slot."""
        return (0,) * len(self.rings)

    def advanced(self, rotations: Sequence[int]) -> tuple[int, ...]:
        """The rotations after one update."""
        return tuple(ring.advanced(r) for ring, r in zip(self.rings, rotations))

    def locations(self, rotations: Sequence[int]) -> list[tuple[Slot, Slot]]:
        """Per chunk index: (where its record is read from, where its new record is written) in an
        update at ``rotations``."""
        out = []
        for r, k in self.ring_of:
            ring = self.rings[r]
            out.append((ring.read_slot(k, rotations[r]), ring.write_slot(k, rotations[r])))
        return out

    def current(self, rotations: Sequence[int], committed_through: int) -> list[Slot]:
        """Per chunk index: where its record is now, in an update at ``rotations`` interrupted
        after committing step positions ``0 .. committed_through`` (-1: none)."""
        return [read if self.position[i] > committed_through else write
                for i, (read, write) in enumerate(self.locations(rotations))]

    def commit_needs(self) -> list[int]:
        """Per step position p: the position that must be committed before p's write is issued
        (that of the chunk ``W`` places earlier in its ring), or -1 when its write goes to a free
        slot. The same in every update (the rotation moves slots, not the order)."""
        needs = []
        for i in self.order:
            r, k = self.ring_of[i]
            ring = self.rings[r]
            needs.append(self.position[ring.members[k - ring.spares]] if k >= ring.spares else -1)
        return needs



def durable_disk_bytes(layout, spares: int) -> int:
    """What durable steps add to ``layout``'s offload files: the rings' spare records (``spares``
    a ring at most), a bfloat16 master's spare layers of streamed weights (:data:`PARAM_SPARES`
    each), the journal's two slots, and with the gradients in RAM their log (``gradient_log``)."""
    chunks = layout.chunks()
    logged = layout.ram_grad_bytes  # as the planner counts gradients on SSD
    params = ParamRings.plan(layout.streamed_leaves, PARAM_SPARES).spare_bytes if layout.masters_in_params else 0
    return SlotRings.plan(chunks, layout.step_order(chunks), spares, layout.block_bytes).spare_bytes + params \
        + 2 * SLOT_BYTES + logged


PARAM_SPARE_PREFIX = "durable/param"


@dataclass(frozen=True)
class ParamRings:
    """Where each streamed leaf's layers of weights are while steps are durable and a bfloat16
    master *is* those weights (its params regions, which the forward streams): written in place,
    a torn layer would leave neither the old master (to redo the update) nor the new one. So
    they rotate too, a whole layer at a time: leaf i's ``L`` home regions and ``W`` spare ones
    (``M = L + W``) and one rotation ``r`` for all leaves (they have the same layers)::

        layer l is read from    slots[i][(l + r) % M]
        and written to          slots[i][(l + r - W) % M]    (layer l - W's old slot)
        after the step          r = (r - W) % M

    A chunk of layer l may be written only once every chunk of layer l - W of its leaf is
    committed (:meth:`DurableRecords.commit_needs`), and the forward reads a layer from its new
    slot once it is committed (the parameter source is told, :meth:`DurableRecords.watch`)."""

    leaves: tuple[int, ...]  # the streamed leaves' indices
    slots: tuple[tuple[str, ...], ...]  # per leaf (in ``leaves``' order): its L home regions, then W spares
    spares: int  # W
    layer_bytes: tuple[int, ...]  # per leaf: one layer's bytes

    @classmethod
    def plan(cls, leaves, spares: int) -> "ParamRings":
        """The rings of ``leaves`` (the layout's streamed leaves) with ``spares`` spare layers each."""
        if spares < 1:
            raise ValueError(f"durable steps: a params ring needs >= 1 spare layer, got {spares}")
        w = min(spares, min((leaf.layers for leaf in leaves), default=1))
        slots = tuple(tuple(leaf.param_regions) + tuple(f"{PARAM_SPARE_PREFIX}/{leaf.index}/{j}" for j in range(w))
                      for leaf in leaves)
        return cls(tuple(leaf.index for leaf in leaves), slots, w, tuple(leaf.grad_layer_bytes for leaf in leaves))

    @property
    def spare_regions(self) -> tuple[tuple[str, int], ...]:
        """(region name, bytes) to add to the store: each spare layer is a region of its own."""
        return tuple((name, nbytes) for ring, nbytes in zip(self.slots, self.layer_bytes)
                     for name in ring[len(ring) - self.spares:])

    @property
    def spare_bytes(self) -> int:
        return sum(n for _, n in self.spare_regions)

    def read_region(self, k: int, layer: int, rotation: int) -> str:
        """Where leaf ``leaves[k]``'s layer is before an update at ``rotation``."""
        ring = self.slots[k]
        return ring[(layer + rotation) % len(ring)]

    def write_region(self, k: int, layer: int, rotation: int) -> str:
        """Where the update at ``rotation`` writes that layer."""
        ring = self.slots[k]
        return ring[(layer + rotation - self.spares) % len(ring)]

    def advanced(self, rotation: int) -> int:
        return (rotation - self.spares) % len(self.slots[0]) if self.slots else rotation
