"""The layout of a stored version on disk: format name and versions, file names, alignment, chunk size.

A version is a directory ``step-<12 digits>/`` (:func:`version_dirname`) holding ``manifest.msgpack``
and the data files. These constants are what every writer and reader agrees on; the documents that
describe a version are in :mod:`tierckpt.format.records` and :mod:`tierckpt.format.manifest`.
"""

from __future__ import annotations

import re

FORMAT_NAME = "tierckpt"
FORMAT_VERSION = 3
# A version that keeps what a differential version needs (a base, chunk digests) is written as version
# 4, which an older release refuses by its version rather than misreading.
DELTA_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
MANIFEST_FILE = "manifest.msgpack"  # a single process's manifest, or the commit marker of several ranks'
RANK_MANIFEST_FILE = "manifest-r{rank:05d}.msgpack"
DATA_FILE = "data-r{rank:05d}.bin"
ALIGN = 4096
# Independent units of hashing, compression and I/O; a multiple of ALIGN so uncompressed chunks stay
# aligned for O_DIRECT, and large enough that per-chunk overhead is noise next to the copy.
CHUNK_BYTES = 16 << 20

_DIR_RE = re.compile(r"^step-(\d{12})$")


def where(tier: str | None, step: int | None) -> str:
    """``"step 7 on tier 'nvme'"``, leaving out what is not known, for messages."""
    text = f"step {step}" if step is not None else "a version"
    return f"{text} on tier {tier!r}" if tier is not None else text


def after_where(error: BaseException, tier: str | None, step: int | None) -> str:
    """What ``error`` says, less the ``"step 7 on tier 'nvme': "`` (:func:`where`) it starts with, for
    a message that names that tier and step itself: each is named once. Its whole text otherwise."""
    text, prefix = str(error), f"{where(tier, step)}: "
    return text[len(prefix) :] if text.startswith(prefix) else text


MAX_STEP = 10**12 - 1  # version_dirname gives a step 12 digits


def checked_step(step: object) -> int:
    """``step`` if it can name a version, for ``save`` and ``restore`` alike.

    Raises:
        TypeError: ``step`` is not an int (a bool is not one either).
        ValueError: ``step`` is an int outside ``0..MAX_STEP``.
    """
    if type(step) is int and 0 <= step <= MAX_STEP:
        return step
    error = ValueError if type(step) is int else TypeError
    raise error(f"step must be an int from 0 to {MAX_STEP}, got {step!r}")


def version_dirname(step: int) -> str:
    return f"step-{step:012d}"


def parse_version_dirname(name: str) -> int | None:
    match = _DIR_RE.match(name)
    return int(match.group(1)) if match else None
