"""Restore: the newest step every rank can load and verify, loaded on every rank, or none; one
process is a group of one (:class:`Alone`). Or one step (``only``), or an error on every rank.

The candidates are the steps of the direction being trained (the versions the newest save any rank
holds descends from: :mod:`tierckpt.format.lineage`) that every rank can get from some tier, newest
first (never a version a rollback abandoned, whatever its step). A rank gets one through its own copy (host
memory, or a filesystem tier, where only globally committed versions are listed), a copy a peer
holds of its part (a peer tier), or its part on another node's directory of a node-local tier. The
ranks exchange what each can get and try the newest step common to all. On a step, each rank goes
down its tiers in order, fastest first: on each, its own copy, then what that tier can fetch of its
part from other ranks, the tier's :class:`~tierckpt.tiers.base.Recovery` (a peer sends its copy
over: :mod:`tierckpt.tiers.peer.recovery`; a rank of the node whose directory holds the part sends
it: :mod:`tierckpt.tiers.nodelocal.fetch`). With the usual order (host memory, peer, node-local
disk, shared storage) that is: its own host memory, else a peer's copy, else its node's disk, else
another node's, else the slower tiers below. No tier is named here: each answers through the tier
interface what it holds and what it can fetch.

A copy that fails verification (damaged manifest, missing file, checksum mismatch) is passed over
for the next one, on the same step; a tier holding only part of what this rank needs (one process's
host memory) is passed over too. Once each rank has tried its tiers, the ranks exchange verdicts:
only if every rank verified does any rank land the step, else all fall back together to the next
older common step. What is said about it (a warning per copy passed over for one process, one per
step naming the ranks for several) is :mod:`tierckpt.restore.verdicts`'s. A version saved by
another number of ranks, or with other placements, is read from its saved layout
(:mod:`tierckpt.restore.plan`; one version of one tier: :mod:`tierckpt.restore.read`).

The exchanges run on the group's own gloo process group, from a worker thread, while each rank's
caller waits: never on the training process group. A group of one exchanges nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import typing
from typing import Any, Callable, Protocol, Sequence

from tierckpt.errors import CorruptCheckpointError, RestoreError
from tierckpt.format.layout import after_where, where
from tierckpt.format.lineage import Lineage, head, lineage_of, user_metadata
from tierckpt.format.saved_layout import NotHere
from tierckpt.restore.landing import finish
from tierckpt.restore.order import admitted, known_damage, try_order
from tierckpt.restore.plan import Plan
from tierckpt.restore.read import in_thread, read_version
from tierckpt.restore.replicas import LeftToOwners, Swapping, first_tiers, read_once, spread
from tierckpt.restore.result import Restored, template_leaves, uncovered
from tierckpt.restore.verdicts import AloneVoice, RanksVoice, Voice
from tierckpt.tiers.base import Recovery, Tier, VersionInfo
from tierckpt.tiers.memory.tier import MemoryTier

__all__ = ["Alone", "Exchange", "agree", "restore_versions", "what_held"]


class Exchange(Protocol):
    """What the fallback needs of the ranks: who this one is, and an exchange of a value among all
    (:class:`~tierckpt.ranks.group.RankGroup`, or :class:`Alone`)."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    def all_gather(self, value: Any) -> list[Any]: ...


class Alone:
    """One process as a group of one: an exchange returns its own word."""

    rank = 0
    world = 1

    def all_gather(self, value: Any) -> list[Any]:
        return [value]


async def restore_versions(
    group: Exchange | None,
    tiers: Sequence[Tier],
    template: Any,
    staging: MemoryTier | None,
    *,
    strict: bool = True,
    cast: bool = False,
    only: int | None = None,
    listed: Sequence[Tier] | None = None,
    verify_first: bool = False,
    show_progress: bool = False,
    replicas_once: bool = True,
) -> Restored | None:
    """The newest step every rank can load and verify, loaded on every rank; None on every rank if
    none. ``group``: the ranks (None: this process alone).

    ``staging``: the memory tier whose free slots may hold the bytes staged for the template (see
    :mod:`tierckpt.restore.read`). With ``only``, that step or an error on every rank, never another
    step. ``verify_first``: no template is written before its copy verified (of several ranks, before
    every rank verified its part); else each rank lands its chunks in the template as they verify,
    and the ranks fall back together all the same. ``strict`` and ``cast``: see
    :func:`~tierckpt.restore.read.check_keys` and :func:`tierckpt.restore.plan.plan`.
    ``show_progress``: a progress bar per copy tried, when stderr is a terminal (one rank asks for it).
    ``replicas_once``: a value stored once between ranks is read from storage once between them
    where every rank agrees to (:mod:`tierckpt.restore.replicas`).

    Raises:
        NoCheckpointError: some rank can get step ``only`` from none of ``tiers``; names those ranks
            and what each of ``listed`` (default: ``tiers``) holds on this rank.
        CorruptCheckpointError: step ``only`` did not verify on some rank; names the rank (or each
            copy) and why. Also, without ``verify_first``, when no step verifies after a template was
            written.
        RestoreError: a template does not match; or a step verified that lacks template tensors an
            attempt which failed had partly written (every rank raises it).
    """
    ranks: Exchange = group if group is not None else Alone()
    listed = tiers if listed is None else listed
    voice = AloneVoice(only, listed) if ranks.world == 1 else RanksVoice(only, listed, ranks.rank)
    recoveries = [t.recovery() for t in tiers]  # how each tier gets this rank's part from other ranks, if it can
    helped = [r for r in recoveries if r is not None]
    explicit = only is not None
    held = await _exchange(ranks, what_held(tiers, helped, replicas_once))
    can, once, top = agree(tiers, helped, held, explicit=explicit)
    common = sorted(set.intersection(*can), reverse=True)
    if only is not None:
        if only not in common:
            raise voice.not_held(only, [r for r, steps in enumerate(can) if only not in steps])
        common = [only]
    attempt_on = functools.partial(
        _try, by_path=template_leaves(template), staging=staging, rank=ranks.rank, strict=strict, cast=cast, verify_first=verify_first,
        # Of several ranks, not even a verified snapshot in host memory lands before every rank verified.
        stage_all=verify_first and ranks.world > 1, show_progress=show_progress,
    )
    touched: set[str] = set()  # template keys this rank wrote into, for steps not every rank verified
    touched_ranks: set[int] = set()
    for n, step in enumerate(common):
        with contextlib.ExitStack() as held_open:
            attempt = Attempt(f"rank {ranks.rank} holds no step {step} any more")
            # The tiers in order (fastest first; one process: the newest save of the step first), each
            # with this rank's own copy on it, then the copy it can fetch from other ranks (a peer's,
            # another node's directory): every rank calls each fetch, wanting or not, so that every
            # rank serves what the others fetch from it.
            # Only copies of the direction being trained (tierckpt.format.lineage); of one step asked
            # for, an abandoned copy where no live one is held.
            order = try_order(step, tiers, ranks.world)
            allowed = admitted(step, tiers, top, explicit=explicit)
            holding = [tiers[i] for i in order if i in allowed]
            for i in order:
                tier, recovery = tiers[i], recoveries[i]
                rest = holding[holding.index(tier) + 1 :] if tier in holding else []
                after = functools.partial(_after, rest, step, tiers, common[n + 1 :], only)
                if attempt.wants and i not in allowed and tier.has_part(step) and (damaged := known_damage(step, tier, top)) is not None:
                    _pass_over_known(tier, damaged, attempt, voice, after, elsewhere=bool(rest))
                elif attempt.wants and any(t is tier for t in holding):
                    missed = await attempt_on(held_open, tier, step, attempt, owner=ranks.rank if once.get(step) == i else None)
                    if isinstance(missed, NotHere):
                        voice.not_here(missed, after)
                    elif missed is not None:
                        voice.passed_over(tier, step, missed, after, elsewhere=bool(rest))
                if once.get(step) == i:  # every rank is here, whatever it read
                    missed = await _share_replicas(ranks, attempt, tier, step)
                    if missed is not None:
                        voice.passed_over(tier, step, missed, after, elsewhere=bool(rest))
                if recovery is None:
                    continue
                try:
                    fetched = await recovery.fetch(step, attempt.wants, held_open)
                except CorruptCheckpointError as exc:
                    attempt.verdict = str(exc)
                    voice.fetch_failed(exc, [t for t in tiers[i + 1 :] if any(t is h for h in holding)])
                    continue
                if fetched is not None:
                    if admitted(step, [fetched], top, explicit=explicit and not allowed):
                        await attempt_on(held_open, fetched, step, attempt)
                    else:
                        attempt.verdict = f"the copy of step {step} that tier {tier.name!r} fetched was saved in an abandoned direction"
            # Its template keys written so far: by earlier steps, by this step's tries (a step
            # every rank leaves behind leaves what verified here written, too).
            touched |= attempt.written
            if attempt.loaded is not None and attempt.error is None:
                attempt.error = uncovered(touched, attempt.loaded[1].targets, step)
            loaded, verdict, error = attempt.loaded, attempt.verdict, attempt.error
            # One exchange per step, whatever happened here: every rank leaves the step together.
            said = None if error is None else f"{type(error).__name__}: {error}"
            verdicts = await _exchange(ranks, [None if loaded else verdict, said, bool(touched)])
            touched_ranks |= {r for r, v in enumerate(verdicts) if v[2]}
            if error is not None:
                raise error
            errors = [(r, v[1]) for r, v in enumerate(verdicts) if v[1]]
            if errors:
                raise RestoreError(f"restoring step {step} failed on rank {errors[0][0]}: {errors[0][1]}", step=step)
            if all(v[:2] == [None, None] for v in verdicts):
                assert loaded is not None
                tier, planned, (missing, unexpected) = loaded
                state = await in_thread(finish, planned.saved, planned.targets)
                saved = planned.saved.metadata
                return Restored(
                    step, state, tier.name, user_metadata(saved), missing, unexpected, read_bytes=planned.bytes_read, lineage=lineage_of(saved)
                )
        voice.step_failed(step, {r: v[0] for r, v in enumerate(verdicts) if v[0]}, common[n + 1 :], touched, touched_ranks)
    failed = voice.none_verified(touched, touched_ranks)
    if failed is not None:
        raise failed
    left = abandoned_held(held, top)
    if left:  # starting over would let retention delete them: the caller chooses
        raise voice.only_abandoned(left)
    return None


def what_held(tiers: Sequence[Tier], helped: Sequence[Recovery], replicas_once: bool) -> list[Any]:
    """What this rank tells the others first: the steps it holds a part of (newest first), what each
    tier that fetches from other ranks reports, the first tier holding each step (None: it reads
    every replicated value whole), the serials of its copies of each step, the lineage of the newest
    save its tiers list (:mod:`tierckpt.format.lineage`; encoded, or None), and the serials of every
    version its tiers list, parts other ranks hold included ([step, serials])."""
    listed = [(info, tier.has_part(info.step)) for tier in tiers for info in tier.versions()]
    mine = sorted({info.step for info, own in listed if own}, reverse=True)
    serials: dict[int, set[int]] = {}  # of this rank's own parts
    anywhere: dict[int, set[int]] = {}  # of every version a tier lists (a part another rank holds too)
    for info, own in listed:
        anywhere.setdefault(info.step, set()).add(info.serial)
        if own:
            serials.setdefault(info.step, set()).add(info.serial)
    top = head(info for info, _ in listed if info.valid)
    return [
        mine, [r.report() for r in helped], first_tiers(tiers, mine) if replicas_once else None,
        [sorted(serials[s]) for s in mine], None if top is None else top.encode(),
        [[s, sorted(found)] for s, found in sorted(anywhere.items())],
    ]


def agree(
    tiers: Sequence[Tier], helped: Sequence[Recovery], held: Sequence[Any], *, explicit: bool = False
) -> tuple[list[set[int]], dict[int, int], Lineage | None]:
    """From every rank's :func:`what_held`, in rank order (the same on every rank): the steps each rank
    can get, by itself or with the others' help, the steps whose replicated values are read once
    (step -> tier index: :func:`~tierckpt.restore.replicas.read_once`), and the lineage of the newest
    save any rank holds (:func:`~tierckpt.format.lineage.head`).

    ``explicit``: a restore of one step asked for. Without it, a rank can get a step only where it
    holds a copy in the newest save's direction (or, through a tier that fetches, a step some rank's tiers list
    so): every rank resumes the same direction, also where one rank's tiers still hold an abandoned one."""
    tops = [Lineage.decode(h[4]) for h in held if h[4] is not None]
    top = max(tops, key=lambda lineage: lineage.serial, default=None)

    def live(step: int, serials: Sequence[int]) -> bool:
        return explicit or top is None or any(top.descends(step, x) for x in serials)

    can = [{s for s, serials in zip(h[0], h[3]) if live(s, serials)} for h in held]
    anywhere = {s for h in held for s, serials in h[5] if live(s, serials)}
    for k, helper in enumerate(helped):
        for r, steps in enumerate(helper.reachable([h[1][k] for h in held])):
            can[r] |= steps if explicit else steps & anywhere
    return can, read_once(tiers, [(h[0], h[2]) for h in held]), top


def abandoned_held(held: Sequence[Any], top: Lineage | None) -> list[int]:
    """From every rank's :func:`what_held`: the steps of versions some rank's tiers list whose
    manifest verified that ``top``'s direction left (newest first; the same on every rank)."""
    if top is None:
        return []
    return sorted({s for h in held for s, serials in h[5] if not any(top.descends(s, x) for x in serials)}, reverse=True)


async def _share_replicas(ranks: Exchange, attempt: Attempt, tier: Tier, step: int) -> CorruptCheckpointError | None:
    """After every rank tried ``tier`` for ``step`` reading only the replicated chunks it stored: if
    every rank read its own, each sends them to the others sharing their values; else each reads the
    chunks it left to the others itself. Returns this rank's copy that then did not verify."""
    left, attempt.left = attempt.left, None
    said = await _exchange(ranks, left is not None)
    if left is None:
        return None
    assert attempt.loaded is not None  # only a read that went through leaves chunks to others
    try:
        if all(said):  # a group of ranks (one process never defers): a RankGroup
            await in_thread(spread, typing.cast(Swapping, ranks), attempt.loaded[1].targets)
        else:
            await in_thread(left.read_here)
    except CorruptCheckpointError as exc:
        attempt.loaded = None
        attempt.failed(tier, step, exc)
        return exc
    return None


async def _exchange(ranks: Exchange, value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order; a group of one needs no thread for it."""
    if ranks.world == 1:
        return [value]
    return await asyncio.to_thread(ranks.all_gather, value)


def _after(rest: Sequence[Tier], step: int, tiers: Sequence[Tier], later: Sequence[int], only: int | None) -> str:
    """What this rank tries after a copy of ``step`` failed: the next of ``rest`` (the tiers after it
    that hold the step), else the first tier holding the next of the ``later`` steps, named."""
    if rest:
        return f"trying {where(rest[0].name, step)} next"
    for s in later:
        tier = next((t for t in tiers if t.has_part(s) and any(info.step == s for info in t.versions())), None)
        if tier is not None:
            return f"trying {where(tier.name, s)} next"
    return f"no other copy of step {only} is left to try" if only is not None else "no other version is left to try"


class Attempt:
    """How reading this rank's part of one step went: ``loaded``, or why not (``verdict``: it did not
    verify; ``error``: it cannot be loaded into the template, which every rank raises)."""

    def __init__(self, verdict: str) -> None:
        self.verdict = verdict
        self.loaded: tuple[Tier, Plan, Any] | None = None  # the tier, the plan run, the keys check_keys found
        self.error: BaseException | None = None
        self.written: set[str] = set()  # template keys its tries wrote into, whether they verified or not
        self.left: LeftToOwners | None = None  # what the read of ``loaded`` left to the ranks storing it

    @property
    def wants(self) -> bool:
        return self.loaded is None and self.error is None

    def failed(self, tier: Tier, step: int, error: CorruptCheckpointError) -> None:
        # The verdict follows "step N does not verify on rank(s) ...": it names the tier, not the step again.
        why = f"tier {tier.name!r}: {after_where(error, tier.name, step)}"
        self.verdict = why if tier.place is None else f"{why}, on {tier.place}"


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
    stage_all: bool,
    show_progress: bool,
    owner: int | None = None,
) -> NotHere | CorruptCheckpointError | None:
    """Read and verify this rank's part of ``step`` from ``tier`` into ``attempt``: with
    ``verify_first`` into staging memory (with ``stage_all``, a snapshot in host memory too: nothing
    of the template is written), else into the template as chunks verify (the keys it writes are added to ``attempt.written`` first). What it holds
    (lease, files, staging slots) stays held by ``held_open``. Why it failed goes to ``attempt``:
    ``verdict`` (the part does not verify), ``error`` (it cannot load: every rank raises it), or
    nothing (this tier holds another rank's part only: a slower tier may do). Returns what is said
    of it: the copy that did not verify, or that this tier holds only part of what is needed.
    ``owner``: this rank, reading only the chunks of replicated values it stored
    (:mod:`tierckpt.restore.replicas`; what it left to others goes to ``attempt.left``)."""
    try:
        held_open.enter_context(tier.lease(step))
    except KeyError:  # evicted from host memory since the steps were listed: nothing to warn about
        attempt.failed(tier, step, CorruptCheckpointError(f"step {step} left tier {tier.name!r} meanwhile", tier=tier.name, step=step))
        return None
    try:
        planned, keys, attempt.left = await read_version(
            held_open, tier, step, by_path, staging, strict=strict, cast=cast, rank=rank,
            verify_first=verify_first, stage_all=stage_all, touched=attempt.written, show_progress=show_progress, owner=owner,
        )
        attempt.loaded = (tier, planned, keys)
    except NotHere as exc:  # this rank's host memory holds only its own part: a slower tier may do
        return exc
    except CorruptCheckpointError as exc:
        attempt.failed(tier, step, exc)
        _known_damaged(tier, step, exc)
        return exc
    except Exception as exc:  # a template that does not match, say: raised on every rank
        attempt.error = exc
    return None


def _pass_over_known(tier: Tier, damaged: VersionInfo, attempt: Attempt, voice: Voice, after: Callable[[], str], *, elsewhere: bool) -> None:
    """Pass over a copy known to be damaged without reading it: its damage is this rank's verdict on
    the step. Said once per process: a copy ``tierckpt verify`` marked at its first restore, one a
    restore found damaged when it was found."""
    step = damaged.step
    known = CorruptCheckpointError(f"{where(tier.name, step)}: {tier.damage_of(damaged)}", tier=tier.name, step=step)
    attempt.failed(tier, step, known)
    if (step, damaged.created) not in tier.found_damaged:
        voice.passed_over(tier, step, known, after, elsewhere=elsewhere)
        tier.found_damaged[(step, damaged.created)] = str(tier.damage_of(damaged))


def _known_damaged(tier: Tier, step: int, error: CorruptCheckpointError) -> None:
    """Remember that this copy of ``step`` did not verify: later restores of this process pass it over,
    and retention neither counts nor deletes it (tierckpt.restore.order.admitted, Flusher.doomed)."""
    info = next((v for v in tier.versions() if v.step == step), None)
    if info is not None:
        tier.found_damaged[(step, info.created)] = str(error)
