"""FSDP1's ShardedTensors as DTensors (tierckpt.integrations.sharded_tensors), 2 ranks over gloo
(tests/sharded_tensor_worker.py). The trainers' FSDP1 runs (tests/test_lightning.py,
tests/test_huggingface.py) store and reshard them end to end; this names what is refused and why, and that
a plugin's saves keep one mesh."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tierckpt.testing.ranks import failures, launch_ranks

WORKER = Path(__file__).with_name("sharded_tensor_worker.py")


def test_fsdp1_pieces_become_dtensors_over_their_memory_and_other_cuts_are_refused_naming_the_key(tmp_path: Path) -> None:
    exits = launch_ranks([sys.executable, str(WORKER), str(tmp_path)], 2, timeout_s=120)
    assert not failures(exits), failures(exits)
    r0, r1 = (json.loads((tmp_path / f"result-{r}.json").read_text()) for r in (0, 1))

    for rank, result in ((0, r0), (1, r1)):
        chunk = result["chunks"]
        assert chunk["type"] == "DTensor" and chunk["placements"] == ["S(0)"] and chunk["shape"] == [5, 4]
        rows = 3 if rank == 0 else 2
        assert chunk["local"] == [[100 * rank + 4 * i + j for j in range(4)] for i in range(rows)]
        assert chunk["shares_memory"] and chunk["back_is_original"]

    key = "['opt']['state']['w']['exp_avg']"
    other = r0["other_cut"]
    assert other["error"] == "UnsupportedStateError" and other["key"] == key
    assert "is not dim 0's chunk 0 of 2" in other["message"], other["message"]
    part = r1["part_of_the_ranks"]
    assert part["error"] == "UnsupportedStateError" and part["key"] == key
    assert "sharded over 1 of the job's 2 ranks" in part["message"] and "device_mesh" in part["message"], part["message"]

    for result in (r0, r1):  # a trainer plugin's dict of meshes, kept from save to save
        kept = result["kept"]
        assert kept["same_mesh"] and kept["same_spec"] and kept["own_mesh_alone"] and kept["as_from_local"], kept
        assert kept["whole"] == kept["whole_from_local"] == [[4 * i + j for j in range(4)] for i in range(3)] + [[100 + 4 * i + j for j in range(4)] for i in range(2)]
