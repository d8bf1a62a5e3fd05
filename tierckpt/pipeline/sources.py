"""Where a tier reads the version it takes, and what the tiers above must keep for it.

Every tier below host memory is offered every captured save and selects on that stream with its own
flush policy (:mod:`tierckpt.policy`): no tier's choice depends on what another tier took. So the
version a tier takes is read from wherever it is still held, cheapest first ("stored tier" below
means a filesystem or an object tier: one that keeps committed versions a tier below can read back):

1. a stored tier above it that committed that very save and compresses it the same way (a
   compressing tier only): its stored chunks are copied as they are, and no compressor runs (zstd
   encodes at ~0.8 GB/s per thread here, an O_DIRECT read runs at 2-6 GB/s, and on few cores the
   compressor's CPU is taken from training). While such a tier is writing that very save, the tier
   waits for it (:meth:`Sources.defer`) rather than compress the same bytes a second time: not while
   a save waits for a host slot, not once the tier is overdue, and never longer than the tier's own
   last write took (:class:`~tierckpt.pipeline.flusher.Flusher`), so a stuck tier above costs it at
   most that;
2. host memory, while a slot still holds that very save;
3. else the first stored tier above it (tiers are listed fastest first) that committed it.
   A peer tier is never read back while training runs.

What keeps a waiting version somewhere (so that no tier loses a version it selected because another
tier was busy, or because another tier's policy passed it over):

- host memory keeps a snapshot that some tier waits for and that no stored tier above that tier
  holds (:attr:`~tierckpt.tiers.memory.tier.Want.ONLY_HERE`); one that such a tier holds stays while its
  slot is not needed and gives way to a save that needs it (``ELSEWHERE``);
- a stored tier's retention spares every step a tier below waits for or is writing.

Under ``newest_only`` at most one version waits per tier, so this holds at most one extra version per
tier below. "That very save": a step saved twice is two saves; a tier holding the first does not
hold the second (tokens, the snapshots' ``seq``, tell them apart).
"""

from __future__ import annotations

from typing import Callable, Sequence

from tierckpt.format.lineage import Lineage, head
from tierckpt.pipeline.flusher import Flusher, Located
from tierckpt.policy import Candidate
from tierckpt.snapshot import Snapshot
from tierckpt.tiers.base import Tier
from tierckpt.tiers.memory.tier import MemoryTier, Want


class Sources:
    """The answers above, for the pipeline's tiers (``tiers[0]`` is host memory). Engine thread only."""

    def __init__(self, memory: MemoryTier, tiers: Sequence[Tier], flushers: Callable[[], Sequence[Flusher]]) -> None:
        """``flushers()``: the flushers of ``tiers[1:]``, in order (made after this, since they read
        through it): what they wait for decides what is kept above."""
        self.memory = memory
        self.tiers = list(tiers)
        self._index = {tier.name: i for i, tier in enumerate(self.tiers)}
        # Per stored tier: step -> the token of the save it committed under that step in this process.
        self._tokens: dict[str, dict[int, int]] = {t.name: {} for t in self.tiers[1:] if t.config.type in ("filesystem", "object")}
        self._flushers = flushers

    def direction(self) -> Lineage | None:
        """The lineage of the newest save committed on a tier below host memory: retention keeps the
        versions of its direction (:func:`tierckpt.policy.retain`). A save only in host memory does not
        count yet: until a new direction's first save commits, nothing stored changes."""
        return head(v for t in self.tiers[1:] for v in t.versions() if v.valid)

    def committed(self, tier: str, candidate: Candidate) -> None:
        """``tier`` committed the save ``candidate``: it can serve it to the tiers below."""
        tokens = self._tokens.get(tier)
        if tokens is not None:
            tokens[candidate.step] = candidate.token
            held = {v.step for v in self.tiers[self._index[tier]].versions()}
            for step in [s for s in tokens if s not in held]:  # deleted by retention since: forget them
                del tokens[step]

    def _holds(self, tier: Tier, step: int, token: int) -> bool:
        """Whether ``tier`` holds save ``token`` of ``step`` now (retention may have deleted it since
        :meth:`committed` last trimmed the index)."""
        tokens = self._tokens.get(tier.name)
        return tokens is not None and tokens.get(step) == token and any(v.step == step for v in tier.versions())

    def _stored_above(self, i: int, step: int, token: int) -> Tier | None:
        """The first stored tier above tier ``i`` that holds save ``token`` of ``step``, if any."""
        return next((t for t in self.tiers[1:i] if self._holds(t, step, token)), None)

    def _same_encoding(self, i: int) -> list[tuple[int, Tier]]:
        """The stored tiers above tier ``i`` that store chunks exactly as it does, when it compresses."""
        compression = self.tiers[i].config.compression
        if compression.codec == "none":
            return []  # nothing to save: an uncompressed tier copies bytes from host memory as they are
        return [(j, t) for j, t in enumerate(self.tiers[1:i], start=1) if t.name in self._tokens and t.config.compression == compression]

    def defer(self, tier: str, candidate: Candidate) -> bool:
        """Whether ``tier`` may wait before taking ``candidate``: a tier above that compresses the same
        way is writing that very save now (and does not hold it yet), and ``tier`` will copy its stored
        chunks once it commits (or read host memory if it fails). Never while a save waits for a host
        slot. The pipeline wakes every flusher when a flush ends or a save starts waiting; the flusher
        bounds the wait."""
        if self.memory.waiting_saves:
            return False
        same = self._same_encoding(self._index[tier])
        if any(self._holds(t, candidate.step, candidate.token) for _, t in same):
            return False  # committed already: take it from there now
        return any((f := self._flushers()[j - 1]).in_flight is not None and f.in_flight.token == candidate.token for j, _ in same)

    def locate(self, tier: str, candidate: Candidate) -> Located | None:
        """Lease the version ``tier`` is about to take where it is read cheapest (see the module
        docstring); None when nothing above holds it any more (evicted from host memory: ``tier`` will
        not get it)."""
        i = self._index[tier]
        same = next((t for _, t in self._same_encoding(i) if self._holds(t, candidate.step, candidate.token)), None)
        if same is not None and (found := self._lease(same, candidate.step)) is not None:
            return found
        snapshot = self.memory.captured(candidate.token)
        if snapshot is not None:
            return Located(self.memory.name, self.memory.hold(snapshot), lambda: self.memory.read_snapshot(snapshot))
        above = self._stored_above(i, candidate.step, candidate.token)
        return None if above is None else self._lease(above, candidate.step)

    @staticmethod
    def _lease(tier: Tier, step: int) -> Located | None:
        try:
            lease = tier.lease(step)
        except KeyError:
            return None
        return Located(tier.name, lease, lambda: tier.read(step))

    def wanted(self, snapshot: Snapshot, incoming: tuple[int, int] | None) -> Want:
        """How much the tiers below want ``snapshot`` kept in host memory, given the saves still being
        captured and ``incoming`` (step, seq), a save about to take a slot."""
        newer = [Candidate(s.step, s.seq, s.seq) for s in self.memory.capturing() if s.seq > snapshot.seq]
        if incoming is not None:
            newer.append(Candidate(incoming[0], incoming[1], incoming[1]))
        want = Want.NO
        for i, flusher in enumerate(self._flushers(), start=1):
            if flusher.still_wanted(snapshot.seq, newer):
                if self._stored_above(i, snapshot.step, snapshot.seq) is None:
                    return Want.ONLY_HERE
                want = Want.ELSEWHERE
        return want

    def lost(self, snapshot: Snapshot) -> list[Flusher]:
        """The flushers that lose ``snapshot`` when host memory drops it (under ``on_full: evict``):
        those waiting for it that no stored tier above can serve."""
        return [
            f
            for i, f in enumerate(self._flushers(), start=1)
            if f.state.find(snapshot.seq) is not None and self._stored_above(i, snapshot.step, snapshot.seq) is None
        ]

    def spared(self, tier: str, step: int) -> bool:
        """Whether retention on stored tier ``tier`` must keep ``step``: a tier below waits for it or
        is writing it. A peer tier spares nothing: no tier reads from it."""
        if tier not in self._tokens:
            return False
        i = self._index[tier]
        return any(f.wants(step) for f in self._flushers()[i:])
