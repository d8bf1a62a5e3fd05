"""Every rank's arrival at the construction of a Checkpointer over a group, waited for through the
job's own store, so that a rank that never comes is named in the error the others raise."""

from __future__ import annotations

import datetime
import itertools
import zlib
from typing import Sequence

import torch.distributed as dist

from tierckpt.errors import RankFailureError

# How many Checkpointers this process has constructed over each group of ranks: the same on every rank
# of the group (construction is collective over it); it names each construction's arrival keys in the
# job's store.
_CONSTRUCTIONS: dict[tuple[int, ...], itertools.count[int]] = {}


def await_arrivals(ranks: Sequence[int], me: int, timeout: datetime.timedelta) -> None:
    """Wait until every rank of ``ranks`` (global ranks; this one is ``me``) has come to construct its
    Checkpointer, through the job's own store (torch.distributed's default one).

    ``new_group`` would wait as long, but then fail with a store key in its message; this names the
    ranks that did not come (dead, hung, or not constructing at this point of their program).
    """
    n = next(_CONSTRUCTIONS.setdefault(tuple(ranks), itertools.count()))
    group = f"{len(ranks)}-{zlib.crc32(','.join(map(str, ranks)).encode()):08x}"  # the same on every rank of the group
    store = dist.PrefixStore(f"tierckpt/arrivals/{group}/{n}", dist.distributed_c10d._get_default_store())
    store.set(str(me), "1")
    try:
        store.wait([str(r) for r in ranks], timeout)
    except RuntimeError:  # DistStoreError: the timeout (or the store is gone: its host, rank 0, died)
        try:
            missing = [r for r in ranks if not store.check([str(r)])]
        except RuntimeError:
            missing = [ranks[0]]
        raise RankFailureError(
            f"rank(s) {', '.join(map(str, missing))} did not construct their Checkpointer within {timeout.total_seconds():g} s "
            "(distributed.timeout): dead, hung, or not constructing it at the same point of their program as the others",
            ranks=tuple(missing),
        ) from None
