"""What a restore returns, and the words its errors share, for one process and several ranks alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from tierckpt.errors import RestoreError
from tierckpt.format.lineage import Lineage
from tierckpt.restore.read import some_keys
from tierckpt.state import Leaf, flatten, format_path
from tierckpt.tiers.base import Tier

__all__ = ["Restored", "held_steps", "overwritten", "template_leaves", "uncovered"]


@dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore_latest` returns."""

    step: int
    state: Any
    tier: str  # the tier it was read from
    metadata: dict[str, Any] = field(default_factory=dict)
    # With a template: its array keys the version lacks (left as they were; only with strict=False),
    # and the version's keys the template lacks (new arrays in ``state``).
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()
    # The stored bytes this rank read (from the tier's files or objects, or host memory): of a value
    # replicated across ranks, only the chunks it stored, when the others sent theirs
    # (tierckpt.restore.replicas).
    read_bytes: int = 0
    # Which save it is and which saves it descends from (tierckpt.format.lineage): the next save
    # descends from it. None: saved before lineages were recorded.
    lineage: Lineage | None = field(default=None, repr=False)

    @property
    def serial(self) -> int:
        """The number of the ``save()`` call that made it, across restarts (0: saved before serials were recorded)."""
        return 0 if self.lineage is None else self.lineage.serial


def template_leaves(template: Any) -> dict[str, Leaf]:
    if template is None:
        return {}
    return {format_path(leaf.path): leaf for leaf in flatten(template)[1]}


def overwritten(whose: set[str] | str) -> str:
    """Says that copies which failed wrote into the template: ``whose`` keys, or whose template."""
    what = some_keys(sorted(whose)) if isinstance(whose, set) else f"on {whose}"
    return (
        f"the template was partly overwritten by the copies that failed ({what}); restore into a new "
        "template, or pass verify_first=True to keep a template as it is until a version verifies"
    )


def uncovered(touched: set[str], targets: Sequence[Any], step: int) -> RestoreError | None:
    """The error for template keys a failed attempt wrote and the version restored does not write
    again (only without ``strict``: its keys lack them), or None."""
    left = touched - {t.record.key for t in targets if t.template}
    if not left:
        return None
    return RestoreError(
        f"step {step} verified, but lacks template tensors that a copy which failed verification had "
        f"partly overwritten: {some_keys(sorted(left))} (restore with verify_first=True, or rebuild the template)",
        step=step,
    )


def held_steps(tiers: Sequence[Tier]) -> str:
    """What each tier holds, for an error message: ``ram: 8, 10; nvme: 4, 8, 10; pfs: none``."""
    return "; ".join(f"{t.name}: {_steps([info.step for info in t.versions()])}" for t in tiers)


def _steps(steps: list[int], limit: int = 8) -> str:
    steps = sorted(set(steps))
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[-limit:]))
    return shown if len(steps) <= limit else f"{len(steps) - limit} older, {shown}"
