"""What the ranks of one tier say to each other through the group's store, and the error when some
of them did not store their part (:mod:`tierckpt.pipeline.ranked` says who says what, and when).

Under ``tier/<name>/``: ``round/<n>`` (the leader's rounds, in order: flush step S of save number A,
a *horizon*, the newest save it has dealt with, or void: a stopping follower's, which the leader
passes), ``report/<n>/<rank>`` (a follower's part of round ``n``'s version, or its error) and
``outcome/<n>`` (committed, with what retention deletes, or abandoned). Round ``n`` stages its version
as ``.tmp-<version>-<run>-<n>``, named for this run and that round.
"""

from __future__ import annotations

from typing import Any

from tierckpt.errors import RankFailureError
from tierckpt.format import version_dirname
from tierckpt.ranks.group import RankGroup
from tierckpt.tiers.base import Part


class TierChannel:
    """The store keys of one tier's decisions, reports and outcomes."""

    def __init__(self, group: RankGroup, tier: str) -> None:
        self.group = group
        self.tier = tier

    def key(self, *parts: Any) -> str:
        return "/".join(("tier", self.tier, *map(str, parts)))

    def staging(self, step: int, n: int) -> str:
        return f".tmp-{version_dirname(step)}-{self.group.run}-{n}"

    async def collect(self, n: int) -> tuple[dict[int, Part], dict[int, str]]:
        """Every follower's report of decision ``n``, waited for up to the timeout: (parts, failures)."""
        group = self.group
        keys = {r: self.key("report", n, r) for r in range(1, group.world)}
        reports: dict[int, Any] = {}
        # All reports in one request, which the store answers once the last is set (per rank, the
        # leader's requests would grow with the job: two round trips a rank, 20,000 a save at 10,000 ranks).
        got = await group.get_when_set(list(keys.values()), group.timeout_s)
        if got is not None:
            reports = dict(zip(keys, got))
        else:
            for r, key in keys.items():  # someone is missing: find out who, one by one
                if await group.has([key]):
                    reports[r] = await group.get(key)
        parts: dict[int, Part] = {}
        failures: dict[int, str] = {}
        for r in keys:
            report = reports.get(r)
            if report is None:
                failures[r] = f"did not report within {group.timeout_s:g} s (dead, hung, or slower than the timeout)"
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
