"""What the ranks of one tier say to each other through the group's store, and the error when some
of them did not store their part (:mod:`tierckpt.pipeline.ranked` says who says what, and when).

Under ``tier/<name>/``: ``round/<n>`` (the leader's rounds, in order: flush step S of save number A,
a *horizon*, the newest save it has dealt with, or void: a stopping follower's, which the leader
passes), ``report/<n>/<rank>`` (a follower's part of round ``n``'s version, or its error) and
``outcome/<n>`` (committed, with what retention deletes, or abandoned). Round ``n`` stages its version
as ``.tmp-<version>-<run>-<n>``, named for this run and that round.

A node that relays (:mod:`tierckpt.ranks.nodestore`) has the same keys in its own store, for its
ranks; its head forwards the rounds and outcomes there, and sets ``report/<n>/node/<index>`` in the
leader's store: its ranks' reports, in their order. Each rank says ``stopped/<rank>`` in its node's
store once it follows no more rounds.
"""

from __future__ import annotations

from typing import Any

from tierckpt.errors import RankFailureError
from tierckpt.format import version_dirname
from tierckpt.ranks.group import RankGroup
from tierckpt.tiers.base import Part

# A read of the next round may wait as long as the tier selects nothing; it ends when the leader
# publishes the round, or the reader stops and voids it. A read that times out prints the store
# client's warning, so this one is long (the store's clients take at most ~24 days).
ROUND_WAIT_S = 7 * 24 * 3600.0


class TierChannel:
    """The store keys of one tier's decisions, reports and outcomes."""

    def __init__(self, group: RankGroup, tier: str) -> None:
        self.group = group
        self.tier = tier
        # Where this rank reads the rounds and outcomes and sets its reports: its node's store, or the leader's.
        self.store: RankGroup = group.link.store if group.link is not None else group

    def key(self, *parts: Any) -> str:
        return "/".join(("tier", self.tier, *map(str, parts)))

    def staging(self, step: int, n: int) -> str:
        return f".tmp-{version_dirname(step)}-{self.group.run}-{n}"

    async def collect(self, n: int) -> tuple[dict[int, Part], dict[int, str]]:
        """Every follower's report of decision ``n``, waited for up to the timeout: (parts, failures)."""
        group = self.group
        through = {r: i for i, ranks in group.relayed.items() for r in ranks}
        keys: dict[Any, str] = {r: self.key("report", n, r) for r in range(1, group.world) if r not in through}
        keys.update({("node", i): self.key("report", n, "node", i) for i in group.relayed})
        said: dict[Any, Any] = {}
        # All reports in one request, which the store answers once the last is set (per rank, the
        # leader's requests would grow with the job: two round trips a rank, 20,000 a save at 10,000 ranks).
        got = await group.get_when_set(list(keys.values()), group.timeout_s)
        if got is not None:
            said = dict(zip(keys, got))
        else:
            for who, key in keys.items():  # someone is missing: find out who, one by one
                if await group.has([key]):
                    said[who] = await group.get(key)
        reports: dict[int, Any] = {r: report for r, report in said.items() if isinstance(r, int)}
        for i, ranks in group.relayed.items():
            reports.update(zip(ranks, said.get(("node", i)) or ()))
        parts: dict[int, Part] = {}
        failures: dict[int, str] = {}
        for r in range(1, group.world):
            report = reports.get(r)
            if report is None:
                who = f"its node's head (rank {group.relayed[through[r]][0]}) did not report for it" if r in through else "did not report"
                failures[r] = f"{who} within {group.timeout_s:g} s (dead, hung, or slower than the timeout)"
                continue
            if report.get("part") is not None:
                parts[r] = Part(*report["part"])
            else:
                failures[r] = str(report.get("error"))
        return parts, failures


def rank_failure(tier: str, step: int, failures: dict[int, str]) -> RankFailureError:
    """Step ``step`` of ``tier`` abandoned because the ranks in ``failures`` (with why) stored no part."""
    ranks = tuple(sorted(failures))
    said = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
    return RankFailureError(
        f"tier {tier!r}: step {step} was abandoned: rank(s) {', '.join(map(str, ranks))} did not store their part ({said})",
        tier=tier,
        step=step,
        ranks=ranks,
    )
