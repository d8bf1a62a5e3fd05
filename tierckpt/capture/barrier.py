"""The lazy barrier's hooks: an optimizer step, or a forward pass, waits for pending host copies."""

from __future__ import annotations

from typing import Any, Callable

import torch


class Handles:
    """Several hook handles removed as one."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def attach(target: torch.optim.Optimizer | torch.nn.Module, wait: Callable[[], Any]) -> Any:
    """Make ``target`` call ``wait()`` before it overwrites state; returns a handle with ``remove()``.

    An optimizer gets a step pre-hook. A module gets a forward pre-hook on itself and on every
    submodule that owns buffers, since forward may update those in place (BatchNorm running
    statistics, DDP's buffer broadcast); modules without buffers keep running during the copy.

    Raises:
        TypeError: ``target`` is neither an optimizer nor a module.
    """
    if isinstance(target, torch.optim.Optimizer):

        def step_barrier(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            wait()

        return target.register_step_pre_hook(step_barrier)
    if isinstance(target, torch.nn.Module):

        def forward_barrier(_module: Any, _args: Any) -> None:
            wait()

        # The root too, buffers or not: a wrapper may write its children's buffers before their
        # own hooks run (DistributedDataParallel broadcasts them in place at the top of forward).
        return Handles(
            [
                module.register_forward_pre_hook(forward_barrier)
                for module in target.modules()
                if module is target or next(module.buffers(recurse=False), None) is not None
            ]
        )
    raise TypeError(f"attach() takes a torch optimizer or module, not {type(target).__name__}")
