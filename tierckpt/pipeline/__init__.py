"""The engine thread, the flushers between tiers, backpressure, leases and drain."""

from tierckpt.pipeline.engine import Engine
from tierckpt.pipeline.pipeline import Counters, Pipeline, SaveTracker

__all__ = ["Counters", "Engine", "Pipeline", "SaveTracker"]
