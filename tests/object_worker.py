"""A training process saving to an object tier, for tests/test_object_tier.py to SIGKILL mid-upload.

``python object_worker.py <config.json> <steps>``: saves ``state(step)`` (helpers.py) at each of the
comma-separated steps and waits for each to commit on tier "s3", so a test holding a request of a
later step at its proxy knows every earlier one is committed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tierckpt import Checkpointer


def state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, 1024, generator=g), "step": step}  # 16 MiB: parts of a multipart upload


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    with Checkpointer(config) as ckpt:
        for step in map(int, sys.argv[2].split(",")):
            ckpt.save_sync(step, state(step)).committed_sync("s3", timeout=120)


if __name__ == "__main__":
    main()
