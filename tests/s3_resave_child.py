"""The process test_delta.py kills: saves step 1 again on an object tier with ``delta`` and dies by
SIGKILL at ``point`` of the bucket's commit (see the test).

Usage: ``python s3_resave_child.py '<tier config JSON>' <point>``, the point one of:

- ``aside``: the commit object in place was copied aside, the new one not yet put;
- ``put``: the new commit object was put, the tier has not yet kept or removed the earlier write.

Prints ``survived`` if it was not killed (the test then fails).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import torch

from tierckpt import Checkpointer
from tierckpt.storage.s3 import Bucket

MiB = 1 << 20


def again() -> dict[str, Any]:
    """Step 1 as the job saves it the second time (another run: another state)."""
    return {"weight": torch.randn(MiB, generator=torch.Generator().manual_seed(99))}


def main() -> None:
    config, point = json.loads(sys.argv[1]), sys.argv[2]
    real_put = Bucket.put
    copied = []

    async def put(self: Bucket, key: str, data: bytes, **kwargs: Any) -> str | None:
        result = await real_put(self, key, data, **kwargs)
        name = key.rpartition("/")[2]
        if name.startswith("head."):
            copied.append(key)
            if point == "aside":
                os.kill(os.getpid(), signal.SIGKILL)
        elif name == "manifest.msgpack" and copied and point == "put":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    Bucket.put = put  # type: ignore[method-assign]
    with Checkpointer(config) as ckpt:
        ckpt.save_sync(1, again())
        ckpt.wait_sync()
    print("survived", flush=True)


if __name__ == "__main__":
    main()
