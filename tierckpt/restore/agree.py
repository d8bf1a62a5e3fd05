"""Restore by several ranks: they agree on one step, and every rank returns it, or none does.

``restore_latest`` is collective. The ranks first exchange the steps each can get from some tier (its
own host memory, or a filesystem tier, where only globally committed versions are listed), from a
peer holding a copy of its part (a peer tier), or from another node's directory of a node-local tier,
and try the newest step that every rank can get. Each rank goes down its tiers in order, fastest
first: on each, its own copy, then what that tier can fetch of its part from other ranks, the tier's
:class:`~tierckpt.tiers.base.Recovery` (a peer sends its copy over: :mod:`tierckpt.tiers.peer.recovery`;
a rank of the node whose directory holds the part sends it: :mod:`tierckpt.tiers.nodelocal.fetch`). With
the usual order (host memory, peer, node-local disk, shared storage) that is: its own host memory,
else a peer's copy, else its node's disk, else another node's, else the slower tiers below. No
tier is named here: each answers through the tier interface what it holds and what it can fetch.
Each rank reads and verifies its whole part into staging memory; the ranks then exchange verdicts,
and only if every rank verified does any rank copy into its template. If one rank's files fail their
checksums, every rank logs one warning (naming the rank, its file, and the step they fall back to)
and all fall back together to the next older common step. A version saved by another number
of ranks, or with other placements, is read from its saved layout (:mod:`tierckpt.restore.plan`).
As everywhere in the package, a warning goes to the ``tierckpt`` logger only, never also through
:func:`warnings.warn` (the rule is in :mod:`tierckpt.errors`).

The collectives run on the group's own gloo process group, from a worker thread, while each rank's
caller waits in ``restore_latest``: never on the training process group.

This module sits in the restore package, not in :mod:`tierckpt.ranks`: it is a restore that uses a
rank group, and keeping it here leaves the ranks package free of the restore.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any, Sequence

from tierckpt.errors import CorruptCheckpointError, NoCheckpointError, RestoreError
from tierckpt.format.layout import after_where
from tierckpt.format.saved_layout import NotHere
from tierckpt.ranks.group import RankGroup
from tierckpt.restore.choose import Restored, held_steps, overwritten, template_leaves, uncovered
from tierckpt.restore.landing import finish
from tierckpt.restore.read import read_version
from tierckpt.tiers.base import Tier
from tierckpt.tiers.memory.tier import MemoryTier

log = logging.getLogger("tierckpt")


async def restore_agreed(
    group: RankGroup,
    tiers: Sequence[Tier],
    template: Any,
    staging: MemoryTier | None,
    *,
    strict: bool = True,
    cast: bool = False,
    only: int | None = None,
    listed: Sequence[Tier] | None = None,
    verify_first: bool = False,
) -> Restored | None:
    """The newest step every rank can load and verify, loaded on every rank; None on every rank if none.

    With ``only``, that step or an error on every rank, never another step. ``verify_first``: no
    rank writes into its template before every rank verified its part (else each lands its chunks
    in the template as they verify, and the ranks fall back together all the same).

    Raises:
        NoCheckpointError: some rank can get the step from none of ``tiers``; names those ranks and
            what each of ``listed`` (default: ``tiers``) holds on this rank.
        CorruptCheckpointError: the step did not verify on some rank; names the rank and why. Also,
            without ``verify_first``, when no step verifies after some rank's template was written.
        RestoreError: a template does not match; or a step verified that lacks template tensors an
            attempt which failed had partly written (every rank raises it).
    """
    by_path = template_leaves(template)
    recoveries = [t.recovery() for t in tiers]  # how each tier gets this rank's part from other ranks, if it can
    helped = [r for r in recoveries if r is not None]
    mine = sorted({info.step for tier in tiers for info in tier.versions() if tier.has_part(info.step)}, reverse=True)
    held = await asyncio.to_thread(group.all_gather, [mine, [r.report() for r in helped]])
    can = [set(h[0]) for h in held]
    for k, helper in enumerate(helped):
        for r, steps in enumerate(helper.reachable([h[1][k] for h in held])):
            can[r] |= steps
    common = sorted(set.intersection(*can), reverse=True)
    if only is not None:
        if only not in common:
            lacking = [r for r, steps in enumerate(can) if only not in steps]
            raise NoCheckpointError(
                f"step {only} is not held for rank(s) {', '.join(map(str, lacking))} "
                f"(on rank {group.rank}: {held_steps(listed if listed is not None else tiers)})",
                step=only,
            )
        common = [only]
    attempt_on = functools.partial(
        _try, by_path=by_path, staging=staging, rank=group.rank, strict=strict, cast=cast, verify_first=verify_first
    )
    touched: set[str] = set()  # template keys this rank wrote into, for steps not every rank verified
    touched_ranks: set[int] = set()
    for n, step in enumerate(common):
        with contextlib.ExitStack() as held_open:
            attempt = Attempt(f"rank {group.rank} holds no step {step} any more")
            # The tiers in order (fastest first), each with this rank's own copy on it, then the copy
            # it can fetch from other ranks (a peer's, another node's directory): every rank calls each
            # fetch, wanting or not, so that every rank serves what the others fetch from it.
            holding = [t for t in tiers if t.has_part(step) and any(info.step == step for info in t.versions())]
            for i, (tier, recovery) in enumerate(zip(tiers, recoveries)):
                if attempt.wants and any(t is tier for t in holding):
                    await attempt_on(held_open, tier, step, attempt)
                if recovery is None:
                    continue
                try:
                    fetched = await recovery.fetch(step, attempt.wants, held_open)
                except CorruptCheckpointError as exc:
                    attempt.verdict = str(exc)
                    log.warning("tierckpt: %s; %s", exc, _then([t for t in tiers[i + 1 :] if any(t is h for h in holding)]))
                    continue
                if fetched is not None:
                    await attempt_on(held_open, fetched, step, attempt)
            # Its template keys written so far: by earlier steps, by this step's tries (a step
            # every rank leaves behind leaves what verified here written, too).
            touched |= attempt.written
            if attempt.loaded is not None and attempt.error is None:
                attempt.error = uncovered(touched, attempt.loaded[2], step)
            loaded, verdict, error = attempt.loaded, attempt.verdict, attempt.error
            # One exchange per step, whatever happened here: every rank leaves the step together.
            said = None if error is None else f"{type(error).__name__}: {error}"
            verdicts = await asyncio.to_thread(group.all_gather, [None if loaded else verdict, said, bool(touched)])
            touched_ranks |= {r for r, v in enumerate(verdicts) if v[2]}
            if error is not None:
                raise error
            errors = [(r, v[1]) for r, v in enumerate(verdicts) if v[1]]
            if errors:
                raise RestoreError(f"restoring step {step} failed on rank {errors[0][0]}: {errors[0][1]}", step=step)
            if all(v[:2] == [None, None] for v in verdicts):
                assert loaded is not None
                tier, read, targets, keys = loaded
                state = await asyncio.to_thread(finish, read, targets)
                return Restored(step, state, tier.name, dict(read.metadata), *keys)
        failed = {r: v[0] for r, v in enumerate(verdicts) if v[0]}
        verdict = (
            f"step {step} does not verify on rank(s) {', '.join(map(str, failed))} "
            f"({'; '.join(f'rank {r}: {why}' for r, why in failed.items())})"
        )
        if only is not None:  # that step or nothing: every rank raises the same
            raise CorruptCheckpointError(verdict + (f"; {overwritten(_ranks(touched_ranks))}" if touched_ranks else ""), step=step)
        older = f"every rank falls back to step {common[n + 1]}" if n + 1 < len(common) else "no older step is held for every rank"
        log.warning("tierckpt: %s; %s", verdict, older)
    if touched_ranks:
        raise CorruptCheckpointError(f"no step verifies on every rank; {overwritten(_ranks(touched_ranks))}")
    return None


def _ranks(ranks: set[int]) -> str:
    return f"rank(s) {', '.join(map(str, sorted(ranks)))}"


def _then(tiers: Sequence[Tier]) -> str:
    """What this rank tries after a copy failed: ``tiers``, named, if any."""
    if tiers:
        return f"trying tier(s) {', '.join(repr(t.name) for t in tiers)} next"
    return "no other tier of this rank holds it"


class Attempt:
    """How reading this rank's part of one step went: ``loaded``, or why not (``verdict``: it did not
    verify; ``error``: it cannot be loaded into the template, which every rank raises)."""

    def __init__(self, verdict: str) -> None:
        self.verdict = verdict
        self.loaded: tuple[Tier, Any, list[Any], Any] | None = None
        self.error: BaseException | None = None
        self.written: set[str] = set()  # template keys its tries wrote into, whether they verified or not

    @property
    def wants(self) -> bool:
        return self.loaded is None and self.error is None


async def _try(
    held_open: contextlib.ExitStack,
    tier: Tier,
    step: int,
    attempt: Attempt,
    *,
    by_path: dict[str, Any],
    staging: MemoryTier | None,
    rank: int,
    strict: bool,
    cast: bool,
    verify_first: bool,
) -> None:
    """Read and verify this rank's part of ``step`` from ``tier`` into ``attempt``: with
    ``verify_first`` into staging memory (nothing of the template is written), else into the template
    as chunks verify (the keys it writes are added to ``attempt.written`` first). What it holds
    (lease, files, staging slots) stays held by ``held_open``. Why it failed goes to ``attempt``:
    ``verdict`` (the part does not verify), ``error`` (it cannot load: every rank raises it), or
    nothing (this tier holds another rank's part only: a slower tier may do)."""
    try:
        try:
            held_open.enter_context(tier.lease(step))
        except KeyError:
            raise CorruptCheckpointError(f"step {step} left tier {tier.name!r} meanwhile", tier=tier.name, step=step) from None
        read, targets, keys = await read_version(
            held_open, tier, step, by_path, staging, strict=strict, cast=cast, rank=rank,
            verify_first=verify_first, stage_all=verify_first, touched=attempt.written,
        )
        attempt.loaded = (tier, read, targets, keys)
    except NotHere:  # this rank's host memory holds only its own part: a slower tier may do
        pass
    except CorruptCheckpointError as exc:
        # The verdict follows "step N does not verify on rank(s) ...": it names the tier, not the step again.
        why = f"tier {tier.name!r}: {after_where(exc, tier.name, step)}"
        attempt.verdict = why if tier.place is None else f"{why}, on {tier.place}"
    except Exception as exc:  # a template that does not match, say: raised on every rank below
        attempt.error = exc
