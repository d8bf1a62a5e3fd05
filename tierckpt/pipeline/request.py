"""Turning one ``save()`` call into a :class:`SaveRequest`, on the caller's thread.

Everything that can reject a save does it here, before the engine is asked for anything: a bad step
or metadata, a value that cannot be stored, a bad ``replicated``. What the pipeline then gets is the
state read once (:func:`~tierckpt.state.survey`) and laid out in a host slot (the
:class:`~tierckpt.snapshot.LayoutCache`, which skips the planning when the layout is the last one).
"""

from __future__ import annotations

import gc
from typing import Any, Mapping, Sequence

import msgpack

from tierckpt.capture.views import moment
from tierckpt.format.layout import checked_step
from tierckpt.format.lineage import KEY as LINEAGE
from tierckpt.pipeline.saves import SaveRequest
from tierckpt.snapshot import LayoutCache
from tierckpt.state import survey


def save_request(
    step: int, state: Any, metadata: Mapping[str, Any] | None, replicated: Sequence[Any], layouts: LayoutCache, *, began: float = 0.0
) -> SaveRequest:
    """The request that saves ``state`` as version ``step`` (``began``: when the call began, ``time.monotonic()``).

    Raises:
        TypeError: ``step`` is not an int, or ``metadata`` holds a value msgpack cannot encode.
        ValueError: ``step`` is outside ``0..MAX_STEP``, ``replicated`` names no value of ``state``, or
            ``metadata`` uses tierckpt's own key (:data:`tierckpt.format.lineage.KEY`).
        UnsupportedStateError: a value in ``state`` cannot be stored.
    """
    checked_step(step)
    meta = dict(metadata or {})
    if LINEAGE in meta:
        raise ValueError(f"metadata key {LINEAGE!r} is tierckpt's own (which save this is): use another key")
    try:
        msgpack.packb(meta, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"metadata must hold only msgpack types (str, int, float, bool, None, bytes, lists, dicts): {exc}") from exc
    # Python's collector is paused until the survey is gone (survey() pauses it for its walk alone): run
    # in between, it would find the survey's thousands of objects alive and move them to an older
    # generation, which only costlier collections look at again, though they go when this returns.
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        found = survey(state)
        entries, nbytes = layouts.entries(found, replicated)
        request = SaveRequest(step, found.values, entries, nbytes, found.skeleton, meta, moment(found), began)
        del found  # its rows: a tuple and a torch.Size a tensor
    finally:
        if paused:
            gc.enable()
    return request
