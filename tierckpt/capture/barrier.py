"""The lazy barrier: an optimizer step, or a forward pass, waits for pending host copies.

:class:`LazyBarrier` is the part of :class:`~tierckpt.Checkpointer` (a base class of it) that offers the barrier: hooks
that wait (:meth:`~LazyBarrier.attach`), and the wait itself for state changed elsewhere
(:meth:`~LazyBarrier.wait_captured`). It needs nothing of the Checkpointer but its copy threads, so it lives here, beside
the hooks, rather than in the facade.
"""

from __future__ import annotations

from typing import Any

import torch

from tierckpt.capture.copier import Copier


class Handles:
    """Several hook handles removed as one."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class LazyBarrier:
    """The lazy barrier's part of the Checkpointer's API; ``_copier`` is the Checkpointer's copy threads."""

    _copier: Copier

    def attach(self, target: torch.optim.Optimizer | torch.nn.Module) -> Any:
        """Install the lazy barrier: wait for pending host copies before state is overwritten.

        An optimizer gets a step pre-hook (``optimizer.step()`` waits). A module gets a forward pre-hook on every submodule
        that owns persistent buffers, since forward may update those in place (BatchNorm running statistics), and on itself
        when there are any (DDP's buffer broadcast writes its children's at the top of forward); the other modules keep
        running during the copy. Non-persistent buffers are not in ``state_dict()``: a rotary embedding's ``inv_freq``
        does not hold a forward back. A state that holds them anyway needs :meth:`wait_captured`.
        Returns a handle; ``handle.remove()`` detaches. Other state modified in place outside these (a GradScaler, EMA
        weights) needs :meth:`wait_captured` before it is modified; a copy that sees its tensor change fails with
        :class:`FlushError` instead of storing a torn snapshot.

        Raises:
            TypeError: ``target`` is neither an optimizer nor a module.
        """
        wait = self.wait_captured
        if isinstance(target, torch.optim.Optimizer):

            def step_barrier(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
                wait()

            return target.register_step_pre_hook(step_barrier)
        if isinstance(target, torch.nn.Module):

            def forward_barrier(_module: Any, _args: Any) -> None:
                wait()

            holders = [module for module in target.modules() if _saves_buffers(module)]
            # The root too, buffers of its own or not: a wrapper may write its children's buffers before
            # their own hooks run (DistributedDataParallel broadcasts them in place at the top of forward).
            if holders and holders[0] is not target:
                holders.insert(0, target)
            return Handles([module.register_forward_pre_hook(forward_barrier) for module in holders])
        raise TypeError(f"attach() takes a torch optimizer or module, not {type(target).__name__}")

    def wait_captured(self, timeout: float | None = None, *, host: bool = False) -> bool:
        """The lazy barrier, for state changed in place outside ``optimizer.step()``.

        Call it before such a change (a GradScaler's ``update()``, an EMA update, a manual ``tensor.add_``). Copies of CPU
        tensors: blocks until they are done. Copies of CUDA tensors: blocks only until they are queued, then makes the
        current stream of each device wait for them, so that work queued on that stream afterwards runs after them; call
        it under each stream that will write (``with torch.cuda.stream(s):``). ``host=True`` blocks until the CUDA copies
        are done too (for writes from other streams or processes).

        Returns False if ``timeout`` ran out first (nothing is ordered then).
        """
        return self._copier.wait_captured(timeout, host=host)


def _saves_buffers(module: torch.nn.Module) -> bool:
    """Whether ``module`` owns a buffer that its ``state_dict()`` holds (a persistent one)."""
    skipped = module._non_persistent_buffers_set
    return any(value is not None and name not in skipped for name, value in module._buffers.items())
