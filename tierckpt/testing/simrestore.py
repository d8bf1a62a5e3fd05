"""The restore's agreement at thousands of ranks, in one process: its real code, with the reads left out.

Every rank of a restore under ``torch.distributed`` exchanges with all the others (an ``all_gather`` on
tierckpt's gloo group, :mod:`tierckpt.restore.fallback`):

1. once, what it holds (:func:`~tierckpt.restore.fallback.what_held`): its steps, what each tier that
   fetches from other ranks reports, and the first tier holding each step;
2. per step tried, where its replicated values are read once (:mod:`tierckpt.restore.replicas`),
   whether it read its own chunks;
3. per step tried, its verdict.

:func:`simulate_restore` builds one rank's first message with the real :func:`what_held` over tiers
holding ``steps`` versions (:class:`~tierckpt.testing.simranks.NullTier`, a shared tier read once),
encodes it as the exchange does, and runs the real :func:`~tierckpt.restore.fallback.agree` over
``world`` copies of it: the CPU each rank spends agreeing, and the bytes each rank sends and
receives. ``tests/test_replicated_restore_benchmark.py`` holds its count of exchanges and the first
message's size against a real job's (:attr:`RankGroup.exchanges <tierckpt.ranks.group.RankGroup.exchanges>`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import msgpack

from tierckpt.format.lineage import Lineage
from tierckpt.restore.fallback import agree, what_held
from tierckpt.testing.simranks import NullTier
from tierckpt.tiers.base import VersionInfo

__all__ = ["RestoreCost", "simulate_restore"]

# What a rank says in exchanges 2 and 3 when it read its part (into a template: written, True).
_SAID = (True, [None, None, True])


@dataclass
class RestoreCost:
    """What the agreement of a restore of one step asks of each of ``world`` ranks."""

    world: int
    exchanges: int  # all_gathers every rank takes part in
    first_bytes: int  # one rank's first message (what it holds)
    sent: int  # bytes one rank sends, all exchanges together
    received: int  # bytes one rank receives (every rank's message, its own too)
    agree_s: float  # one rank's CPU (median) for agreeing on the candidates from every rank's first message
    read_once: bool  # whether the step's replicated values are read once between the ranks


def simulate_restore(world: int, steps: int = 8, repeats: int = 5) -> RestoreCost:
    """Every rank restoring the newest of ``steps`` versions of a shared tier (host memory empty, as
    after a restart): the exchanges of a restore whose first step verifies (the agreement's CPU: the
    median of ``repeats``)."""
    ram, shared = NullTier("ram"), NullTier("shared")
    shared.reads_replicas_once = True
    shared.committed = [VersionInfo("shared", step, 1 << 30, 0.0, lineage=Lineage(step)) for step in range(1, steps + 1)]
    first = msgpack.packb(what_held([ram, shared], [], True), use_bin_type=True)
    held = [msgpack.unpackb(first, raw=False) for _ in range(world)]
    times = []
    for _ in range(repeats):
        started = time.process_time()
        can, once, _ = agree([ram, shared], [], held)
        newest = max(set.intersection(*can))
        times.append(time.process_time() - started)
    agree_s = statistics.median(times)
    said = [len(msgpack.packb(value, use_bin_type=True)) for value in (_SAID if newest in once else _SAID[1:])]
    return RestoreCost(
        world=world, exchanges=1 + len(said), first_bytes=len(first), sent=len(first) + sum(said),
        received=world * (len(first) + sum(said)), agree_s=agree_s, read_once=newest in once,
    )
