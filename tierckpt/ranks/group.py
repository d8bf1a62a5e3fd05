"""The ranks one Checkpointer spans, and the two channels they coordinate over.

Made once, collectively, when the Checkpointer is constructed under ``torch.distributed`` (first every
rank waits, through the job's own store, for the others to arrive, so that a rank that never comes
is named in the error the others raise after ``distributed.timeout``):

- a **gloo process group** of its own (``new_group(backend="gloo")``) over the same ranks, used only
  for the few collectives every rank calls at the same moment from its own call (construction,
  ``restore_latest``), so nothing tierckpt does ever issues a collective on the training group (NCCL or
  otherwise), and never from a background thread;
- a **key-value store** (a ``TCPStore`` served by the leader, the group's first rank) for everything
  the engine thread coordinates while training runs: the leader's flush decisions, each rank's report
  of its part, the outcome of each version. A store needs no matching calls on every rank, and every
  wait on it has a timeout, so a dead or stuck rank costs a timeout, never a hang. With node relays
  (:mod:`tierckpt.ranks.nodestore`), a node's ranks also hold a RankGroup over their node's store.

Every store call runs on one thread of its own (a TCPStore client is one socket). A wait for keys
(:meth:`RankGroup.watch`, :meth:`RankGroup.wait_for`) blocks in the store's own ``wait`` on a client of
its own, in a daemon thread, so it ends the moment the last key is set: no polling delay on the
commit's path. A wait for values (:meth:`RankGroup.get_when_set`) is one ``multi_get`` the store
answers once every key is set: the wait and the read in one request. A wait with no end in sight
(``timeout_s=None``) polls ``check`` instead, backing off to ``poll_max_s``, so that no thread stays
blocked on a key that may never come.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable, Sequence, TypeVar

import msgpack
import torch.distributed as dist

from tierckpt.ranks.arrivals import await_arrivals
from tierckpt.ranks.nodes import group_nodes, node_identity, split_nodes
from tierckpt.errors import ConfigError
from tierckpt.ranks.tally import StoreTally

log = logging.getLogger("tierckpt")
T = TypeVar("T")  # what a blocking store call returns (RankGroup._blocking)

_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.02
_CLOSE_WAIT_S = 10.0  # the longest close() waits for waits on the store to end (see RankGroup.close)


class CoordinationLost(RuntimeError):
    """The store cannot be reached any more: the leader's process is gone (or the network is), or a
    node's head whose store its ranks use. ``rank``: whose, where another rank relayed the news."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class RankGroup:
    """This process's place among the ranks of one Checkpointer, and their channels.

    Attributes:
        rank: this process's rank in the group (0 .. world - 1); rank 0 is the leader.
        world: how many ranks the group has (> 1: one process needs no group).
        ranks: the global ranks of the group, in group order.
        run: an id of this Checkpointer's run, the same on every rank (names staging directories).
        timeout_s: how long a rank waits for the others (``distributed.timeout``).
    """

    def __init__(
        self, rank: int, world: int, ranks: Sequence[int], run: str, timeout_s: float, store: Any, pg: Any, server: Any = None,
        address: tuple[str, int] | None = None, host_rank: int = 0,
    ) -> None:
        self.rank = rank
        self.host_rank = host_rank  # whose process serves the store: the leader's, or a node's head (NodeLink)
        self.world = world
        self.ranks = tuple(ranks)
        self.run = run
        self.timeout_s = timeout_s
        self._store = store
        self._server = server  # the leader keeps the store's server alive
        self._pg = pg
        self._bulk: Any = None
        # The group positions of the ranks on each node (found only when a peer or node-local tier needs them).
        self.nodes: list[list[int]] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-store")
        self._lost: str | None = None
        # Where the store is served, for the clients that block in waits (None: waits poll), and the
        # idle ones: a client whose wait ended on its keys is used again, one that timed out is not.
        self._address = address
        self._waiters: list[Any] = []
        self._waiters_lock = threading.Lock()
        self._watches: set[concurrent.futures.Future[Any]] = set()  # not ended yet: close() waits for them
        self.tally = StoreTally()
        self.exchanges = StoreTally()  # this rank's collectives on the group's gloo group (all_gather, swap)
        self.link: Any = None  # the NodeLink of a rank whose node relays (tierckpt.ranks.nodestore; not imported: it imports this)
        self.relayed: dict[int, tuple[int, ...]] = {}  # of every such node: its index, its ranks (head first)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def lost(self) -> str | None:
        """Why the store cannot be reached any more, once a request found so."""
        return self._lost

    @classmethod
    def discover(cls, group: Any, timeout_s: float, *, bulk: bool = False, find_nodes: bool = False, nodes: int | None = None) -> RankGroup | None:
        """The ranks of ``group`` (default: the world) when ``torch.distributed`` is initialized, else None.

        Collective over ``group``: every rank of it must call this, at the same point of its program.
        A group of one process is None too: it saves as a single process does. With ``bulk`` (a peer
        or node-local tier is configured: copies and parts move between nodes), also makes the bulk group. With ``bulk`` or ``find_nodes`` (a node-local
        tier), finds which ranks share a node (:attr:`nodes`): ``nodes`` consecutive blocks of ranks if
        given, else by each rank's :func:`~tierckpt.ranks.nodes.node_identity`.
        """
        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ConfigError("Checkpointer(group=...) needs torch.distributed to be initialized first")
            return None
        group = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        if world <= 1:
            return None
        rank = dist.get_rank(group)
        if rank < 0:
            raise ConfigError("Checkpointer(group=...): this process is not a member of that group")
        ranks = dist.get_process_group_ranks(group)
        timeout = datetime.timedelta(seconds=timeout_s)
        await_arrivals(ranks, dist.get_rank(), timeout)
        pg = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
        server = None
        if rank == 0:
            # Served by the leader on a free port; the others learn where from the collective below.
            server = dist.TCPStore("0.0.0.0", 0, None, True, timeout, wait_for_workers=False)
            host = os.environ.get("MASTER_ADDR") if dist.get_rank() == 0 and os.environ.get("MASTER_ADDR") else socket.gethostname()
            where: list[Any] = [host, server.port, uuid.uuid4().hex[:12]]
        else:
            where = [None, None, None]
        dist.broadcast_object_list(where, src=ranks[0], group=pg)
        host, port, run = (str(where[0]), int(where[1]), str(where[2]))
        store = server if server is not None else dist.TCPStore(host, port, None, False, timeout)
        made = cls(rank, world, ranks, run, timeout_s, store, pg, server, address=(host, port))
        if bulk:
            made.bulk_group()
        if bulk or find_nodes:
            made.nodes = split_nodes(world, nodes) if nodes is not None else group_nodes(made.all_gather(node_identity()))
        return made

    # -- the store (from the engine thread) ---------------------------------------------------------

    async def _call(self, method: str, *args: Any) -> Any:
        if self._lost is not None:
            raise CoordinationLost(self._lost)
        fn = getattr(self._store, method)
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
            whose = "the leader (rank 0)" if self.host_rank == 0 else f"its node's head (rank {self.host_rank})"
            self._lost = f"lost contact with {whose} of the checkpointing group: {exc}"
            raise CoordinationLost(self._lost) from exc
        self.tally.record(method, args, result)
        return result

    async def put(self, key: str, value: Any) -> None:
        await self._call("set", key, msgpack.packb(value, use_bin_type=True))

    async def put_raw(self, key: str, value: bytes) -> None:
        await self._call("set", key, value)

    async def get(self, key: str) -> Any:
        return msgpack.unpackb(await self._call("get", key), raw=False)

    async def get_raw(self, key: str) -> bytes:
        """The encoded value of ``key``, set (as :meth:`fetch` answers it)."""
        return bytes(await self._call("get", key))

    async def get_if_set(self, key: str) -> bytes | None:
        """The encoded value of ``key``, or None while it is not set: a look (two requests), for when
        a read that blocks could not be had."""
        return await self.get_raw(key) if await self.has([key]) else None

    async def put_if_absent(self, key: str, value: Any) -> Any:
        """Set ``key`` to ``value`` unless it is set; returns its value now (``value`` if this call set
        it), in one request."""
        return msgpack.unpackb(await self._call("compare_set", key, "", msgpack.packb(value, use_bin_type=True)), raw=False)

    async def get_many(self, keys: Sequence[str]) -> list[Any]:
        """The values of ``keys``, every one of them set, in one request."""
        if not keys:
            return []
        return [msgpack.unpackb(v, raw=False) for v in await self._call("multi_get", list(keys))]

    async def add(self, key: str, amount: int) -> int:
        return int(await self._call("add", key, amount))

    async def delete(self, key: str) -> None:
        await self._call("delete_key", key)

    async def has(self, keys: Sequence[str]) -> bool:
        return bool(await self._call("check", list(keys)))

    async def wait_for(self, keys: Sequence[str], timeout_s: float | None, *, poll_max_s: float = _POLL_MAX_S) -> bool:
        """Whether every key was set within ``timeout_s``; it returns as soon as the last one is (see
        :meth:`watch`). ``timeout_s=None``: as long as it takes, polling with pauses of up to
        ``poll_max_s``, for waits that may idle for long and need not answer at once.

        Raises CoordinationLost when the store cannot be reached."""
        if await self.has(keys):
            return True
        if timeout_s is None or self._address is None:
            return await self._poll(keys, timeout_s, poll_max_s)
        if await asyncio.wrap_future(self.watch(keys, timeout_s)):
            return True
        return await self.has(keys)  # timed out, or the client lost the store: this call tells which

    def watch(self, keys: Sequence[str], timeout_s: float) -> concurrent.futures.Future[bool]:
        """A future that is True once every key is set, or False after ``timeout_s`` (or when the store
        cannot be reached: ask :meth:`has`, which raises then). A daemon thread blocks in the store's
        ``wait`` on a client of its own (a TCPStore client is one socket, which a wait holds), so it
        resolves the moment the last key is set. Cancelling the future before the wait starts stops
        it; a wait that started runs to its keys or its timeout. A process that exits while such a
        thread is still blocked may abort, so every wait is ended first: :meth:`close` waits for
        them, and a wait on a key that may never come is ended by its owner setting the key."""
        wait = datetime.timedelta(seconds=timeout_s)

        def call(client: Any) -> bool:
            client.wait(list(keys), wait)
            return True

        return self._blocking(call, "wait", list(keys), False)

    def fetch(self, keys: Sequence[str], timeout_s: float) -> concurrent.futures.Future[list[bytes] | None]:
        """A future of the (encoded) values of ``keys`` once every one is set, or None after
        ``timeout_s`` or when the store cannot be reached: one ``multi_get``, which the store answers
        only once every key is set, blocking a client of its own in a daemon thread as :meth:`watch`
        does. A wait and a read in one request."""
        wait = datetime.timedelta(seconds=timeout_s)

        def call(client: Any) -> list[bytes]:
            client.set_timeout(wait)
            return list(client.multi_get(list(keys)))

        return self._blocking(call, "multi_get" if len(keys) > 1 else "get", [list(keys)] if len(keys) > 1 else list(keys), None)

    def _blocking(self, call: Callable[[Any], T], method: str, args: list[Any], missed: T) -> concurrent.futures.Future[T]:
        """``call`` on an idle client of the store (see :meth:`watch`), in a daemon thread: a future of
        its result, or ``missed`` when it timed out or the store is gone. Tallied as ``method``."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                client = self._waiter()
                result = call(client)
            except (RuntimeError, OSError):  # timed out (the client is then out of step), or the store is gone
                future.set_result(missed)
                return
            except BaseException as exc:  # a bug: raised where the future is awaited, never a wait that never ends
                future.set_exception(exc)
                return
            with self._waiters_lock:
                self._waiters.append(client)
                self.tally.answer(result)
            future.set_result(result)

        with self._waiters_lock:
            self._watches.add(future)
            self.tally.record(method, args)
        future.add_done_callback(self._ended)
        threading.Thread(target=run, name="tierckpt-store-wait", daemon=True).start()
        return future

    async def get_when_set(self, keys: Sequence[str], timeout_s: float) -> list[Any] | None:
        """The values of ``keys`` once every one is set, in one request that the store answers then
        (:meth:`fetch`); None if they were not all set within ``timeout_s``.

        Raises CoordinationLost when the store cannot be reached."""
        if self._lost is not None:
            raise CoordinationLost(self._lost)
        if self._address is not None:
            got = await asyncio.wrap_future(self.fetch(keys, timeout_s))
            if got is not None:
                return [msgpack.unpackb(v, raw=False) for v in got]
        elif await self.wait_for(keys, timeout_s):
            return await self.get_many(keys)
        # Timed out, or the client lost the store: this look tells which (and takes keys set just after).
        return await self.get_many(keys) if await self.has(keys) else None

    def _ended(self, watch: concurrent.futures.Future[Any]) -> None:
        with self._waiters_lock:
            self._watches.discard(watch)

    def _waiter(self) -> Any:
        """An idle client of the store for a blocking wait, or a new one (connecting costs a round trip)."""
        with self._waiters_lock:
            if self._waiters:
                return self._waiters.pop()
        assert self._address is not None
        host, port = self._address
        return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=self.timeout_s))

    async def _poll(self, keys: Sequence[str], timeout_s: float | None, poll_max_s: float) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = _POLL_MIN_S
        while not await self.has(keys):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, poll_max_s)
        return True

    async def wait_any(self, keys: Sequence[str], timeout_s: float) -> str | None:
        """The first of ``keys`` (in their order) that is set, waited for up to ``timeout_s``; None if none was."""
        deadline = time.monotonic() + timeout_s
        delay = _POLL_MIN_S
        while True:
            for key in keys:
                if await self.has([key]):
                    return key
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    # -- collectives (every rank at once, from its own call) -----------------------------------------

    def bulk_group(self) -> Any:
        """A gloo process group of its own for bulk point-to-point transfers (the peer tier's copies),
        so that they never queue behind, or beside, a collective of the group's own. Made on the first
        call, which is collective: every rank makes it at the same point (construction)."""
        if self._bulk is None:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            self._bulk = dist.new_group(ranks=list(self.ranks), backend="gloo", timeout=timeout, use_local_synchronization=True)
        return self._bulk

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (blocking; msgpack types only)."""
        out: list[Any] = [None] * self.world
        packed = msgpack.packb(value, use_bin_type=True)
        dist.all_gather_object(out, packed, group=self._pg)
        self.exchanges.record("all_gather", [packed], out)
        return [msgpack.unpackb(v, raw=False) for v in out]

    def swap(self, sends: Sequence[tuple[int, Any]], receives: Sequence[tuple[int, Any]]) -> None:
        """Send each CPU tensor of ``sends`` to its rank and fill each of ``receives`` from its rank, all
        at once (blocking, on the group's own gloo group: each rank named calls this with the other halves)."""
        works = [dist.isend(t, self.ranks[r], group=self._pg) for r, t in sends]
        works += [dist.irecv(t, self.ranks[r], group=self._pg) for r, t in receives]
        for work in works:
            if work is not None:  # None only for a rank outside the group, which no caller names
                work.wait()

    async def leave(self) -> None:
        """Closing: the leader serves the store until every rank left (or the timeout passed); the
        others only say they leave, since the store may be gone once they look again."""
        try:
            await self.put(f"left/{self.rank}", True)
            if not self.leader:
                return
            keys = [f"left/{r}" for r in range(1, self.world)]
            if not await self.wait_for(keys, self.timeout_s):
                late = [r for r in range(1, self.world) if not await self.has([f"left/{r}"])]
                log.warning("tierckpt: rank(s) %s did not reach close() within %g s", late, self.timeout_s)
        except CoordinationLost as exc:
            log.warning("tierckpt: closing without the other ranks: %s", exc)

    def close(self) -> None:
        """Let go of the store, once every wait on it ended: a process that exits while a thread is
        blocked in the store's wait may abort. Waits end at their keys or their timeout; one that
        outlasts ``_CLOSE_WAIT_S`` is logged and left."""
        if self.link is not None:
            self.link.store.close()  # after the flushers stopped: its head's relays waited for every rank of the node
        self._executor.shutdown(wait=True)
        with self._waiters_lock:
            pending = list(self._watches)
        if pending:
            _, left = concurrent.futures.wait(pending, timeout=min(self.timeout_s, _CLOSE_WAIT_S))
            if left:
                log.warning("tierckpt: %d wait(s) on the checkpointing group's store did not end by close()", len(left))
        with self._waiters_lock:
            self._waiters.clear()
        self._store = self._server = None
