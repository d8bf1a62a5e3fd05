"""Lightning's ``FSDPStrategy`` (FSDP1) on CPU, for tests and benchmarks on machines without a GPU.

Lightning refuses ``FSDPStrategy`` without a GPU accelerator (its accelerator check takes the class
itself only, not a subclass), and it wraps the model with ``device_id=None``, which FSDP refuses
without an accelerator. :class:`CpuFSDPStrategy` wraps the model with ``device_id=cpu`` first, which
the strategy then leaves as it is; everything else, its state dicts, saves and loads included, is the
strategy's own. On a GPU, use ``FSDPStrategy`` itself.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy

__all__ = ["CpuFSDPStrategy"]


class CpuFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` that runs on CPU over gloo (see the module docstring)."""

    def _setup_model(self, model: Any) -> Any:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), sharding_strategy=self.sharding_strategy, **self.kwargs)
        return super()._setup_model(model)
