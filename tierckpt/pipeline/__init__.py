"""The engine thread, the flushers between tiers, backpressure, leases and drain."""

from tierckpt.pipeline.engine import Engine
from tierckpt.pipeline.pipeline import Pipeline
from tierckpt.pipeline.saves import Counters, SaveRequest, SaveTracker

__all__ = ["Counters", "Engine", "Pipeline", "SaveRequest", "SaveTracker"]
