"""tierckpt.integrations.saves.DurableSaves, what every trainer integration saves through: the step of
each of a process's saves stays known after its action ran, as a load on a rank that does not run
the actions needs it."""

from __future__ import annotations

from pathlib import Path

import torch

from tierckpt.config import Config
from tierckpt.integrations.saves import DurableSaves

from helpers import ram_fs


def test_a_save_is_known_by_its_key_after_it_is_durable_until_it_is_cancelled(tmp_path: Path) -> None:
    saves = DurableSaves(Config.coerce(ram_fs(tmp_path / "nvme")), "test")
    ran: list[tuple[str, str]] = []
    key = str(tmp_path / "tag-a")
    try:
        assert saves.save(key, 3, {"w": torch.arange(8.0)}, lambda tier: ran.append((key, tier)))
        assert saves.saved_step(key) == 3 and saves.saved_step(str(tmp_path / "tag-b")) is None
    finally:
        saves.close()  # waits until the save is durable and its action ran
    assert ran == [(key, "nvme")]
    # durable, its action run: on a rank that runs no actions its pointer may not be written yet, so the step stays known
    assert saves.saved_step(key) == 3
    try:
        assert saves.save(key, 4, {"w": torch.arange(8.0) + 1}, lambda tier: None)
        assert saves.saved_step(key) == 4
        saves.cancel(key)
        assert saves.saved_step(key) is None
    finally:
        saves.close()
