"""The mark ``tierckpt verify`` leaves beside a version whose bytes it found damaged.

A restore that finds a copy damaged remembers it for the rest of its process only
(:attr:`tierckpt.tiers.base.Tier.found_damaged`): a read error may be a passing one (a network that
dropped, a disk that answered late), and a restore's guess must not hide a good version from every
later process. ``tierckpt verify`` is asked for by a person, reads every chunk, and prints what it
found; so what it finds is kept on storage, for every later process: a mark per version,
``.damaged-step-<12 digits>``, at the root of the tier's directory or bucket prefix (beside the
version, never inside it: a version's container holds only what its commit names). A tier reads the
marks when it opens; a marked version is then passed over by ``restore_latest()``, neither counted
nor deleted by retention, and listed as damaged (``versions()``, ``tierckpt ls`` and ``status``).

The mark names the save it is about by its creation time: a step saved again is another save, and a
mark of the earlier one says nothing of it (a tier's keeper removes such a mark when it opens, and
one whose version is gone). ``tierckpt verify`` removes the mark when the version verifies.

The mark is JSON, read with a size limit: no pickle, nothing executed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tierckpt.format.layout import version_dirname

__all__ = ["MARK_BYTES", "MARK_PREFIX", "Mark", "decode", "encode", "mark_name", "step_of"]

MARK_PREFIX = ".damaged-"
MARK_BYTES = 64 << 10  # a mark is read whole, refused beyond this
_NAME = re.compile(r"^\.damaged-step-(\d{12})$")


@dataclass(frozen=True)
class Mark:
    """What verify found: of the save created at ``created`` (unix time), ``why``; ``at``: when it looked."""

    created: float
    why: str
    at: float

    @property
    def text(self) -> str:
        """What a listing says of it."""
        return f"found damaged by tierckpt verify: {self.why}"


def mark_name(step: int) -> str:
    """The name of ``step``'s mark at the root of its tier."""
    return f"{MARK_PREFIX}{version_dirname(step)}"


def step_of(name: str) -> int | None:
    """The step whose mark ``name`` is; None: no mark's name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def encode(mark: Mark) -> bytes:
    return json.dumps({"created": mark.created, "why": mark.why, "at": mark.at}).encode()


def decode(data: bytes) -> Mark | None:
    """The mark ``data`` holds; None when it is not one (torn by a crash, or written by something else)."""
    try:
        doc = json.loads(data.decode())
        mark = Mark(float(doc["created"]), str(doc["why"]), float(doc["at"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return mark
