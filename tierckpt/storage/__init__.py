"""Byte stores under the tiers: the interface (store.py), the write plan (plan.py), the local file
system (local.py). See :mod:`tierckpt.storage.store` for what a store does and promises."""

from tierckpt.storage.plan import WriteItem, WritePlan, plan_write
from tierckpt.storage.store import ByteStore, DataWriter, RangeReader, RootEntry

__all__ = ["ByteStore", "DataWriter", "RangeReader", "RootEntry", "WriteItem", "WritePlan", "plan_write"]
