"""One saved rank's own part of a version on a filesystem tier, read by any process.

A restore gives each rank the values its own saved rank stored (:func:`~tierckpt.format.saved_layout.home_rank`),
and DTensors resharded. A state sharded by hand, with no DTensors (DeepSpeed ZeRO's flat partitions),
is resharded by its owner instead, who needs the other saved ranks' values too: :func:`read_part`
reads those of any one saved rank, every chunk verified, as export reads rank 0's.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tierckpt.export.reader import _checked, _Reader
from tierckpt.state import unflatten
from tierckpt.tiers.stored.layout import filesystem_layout

__all__ = ["read_part"]


def read_part(version: Path, rank: int, keep: Callable[[str], bool] = lambda key: True, *, threads: int = 4) -> Any:
    """The state saved rank ``rank`` stored in the committed version at ``version`` (a step directory
    of a filesystem tier): its own structure and values, its tensors as new CPU tensors (values
    stored once between ranks, ``replicated=``, read whole). A tensor whose key (``format_path``)
    ``keep`` refuses is not read: an empty tensor stands in its place. Not collective.

    Raises:
        ValueError: ``rank`` is not one of the ranks that saved the version.
        NoCheckpointError, CorruptCheckpointError: the directory is not a committed version, or a
            manifest or a chunk read does not verify (names the tier directory, the step and the key).
    """
    layout = _checked(filesystem_layout(str(version.parent), version, rank, direct=False))
    if not 0 <= rank < layout.world:
        raise ValueError(f"{version}: saved by {layout.world} rank(s); there is no rank {rank}'s part")
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tierckpt-part") as pool:
        reader = _Reader(layout, pool, threads)
        try:
            arrays = [reader.read(r).value if keep(r.key) else _placeholder(r.kind) for r in layout.records]
        finally:
            reader.close()
    return unflatten(layout.skeleton, arrays)


def _placeholder(kind: str) -> Any:
    return torch.empty(0) if kind == "torch" else np.zeros(())
