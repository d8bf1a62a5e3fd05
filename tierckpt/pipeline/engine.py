"""The engine: the library's own thread running its own event loop (uvloop when installed).

The training loop may be plain synchronous code that never yields; flushing still progresses here.
Callers on any thread or any event loop reach the engine through ``run_coroutine_threadsafe``: never a
nested or patched loop. :func:`sync_twin` makes the blocking twin of an API's coroutine method.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Any, Callable, Concatenate, Coroutine, ParamSpec, TypeVar

from tierckpt.errors import ClosedError

T = TypeVar("T")
S = TypeVar("S")
P = ParamSpec("P")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop is optional on platforms without wheels
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Engine:
    """Owns one thread and one event loop for the lifetime of a Checkpointer."""

    def __init__(self, name: str = "tierckpt-engine") -> None:
        self.loop = _new_loop()
        self._ready = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    def in_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise ClosedError("the Checkpointer is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the engine and block the calling thread for its result."""
        if self.in_engine_thread():
            coro.close()
            raise RuntimeError("a synchronous tierckpt call was made from the engine thread itself")
        return self.submit(coro).result()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the engine and await its result from whatever loop the caller is on."""
        if self.in_engine_thread():
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.in_engine_thread():
            self._thread.join()


def sync_twin(method: Callable[Concatenate[S, P], Coroutine[Any, Any, T]], engine: Callable[[S], Engine]) -> Callable[Concatenate[S, P], T]:
    """The synchronous twin of ``method``, a coroutine method whose work runs on ``engine(self)``.

    The whole call runs on the engine, where :meth:`Engine.run` awaits the work directly, and the
    caller's thread blocks for its result: one body serves both twins. ``engine(self)`` runs first, on
    the caller's thread, so that it can refuse the call (a closed Checkpointer) in its own words.
    The twin has ``method``'s signature (for mypy and ``help()``) and says whose twin it is.
    """

    @functools.wraps(method)
    def twin(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return engine(self).run_sync(method(self, *args, **kwargs))

    twin.__name__ = f"{method.__name__}_sync"
    twin.__qualname__ = f"{method.__qualname__}_sync"
    twin.__doc__ = f"Synchronous twin of :meth:`{method.__name__}`."
    return twin
