"""What ``save()`` reads of DTensors (tierckpt.state.pieces and the common-case walk), 4 ranks over gloo
on a 2 x 2 mesh (tests/dtensor_survey_worker.py): each DTensor's piece, its place and the ranks that
hold it too, the same through the cached fast path as worked out afresh by the general walk."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tierckpt.testing.ranks import failures, launch_ranks

WORKER = Path(__file__).with_name("dtensor_survey_worker.py")


def test_dtensor_pieces_from_the_cached_fast_walk_are_the_general_walks_on_every_rank(tmp_path: Path) -> None:
    exits = launch_ranks([sys.executable, str(WORKER), str(tmp_path)], 4, timeout_s=180)
    assert not failures(exits), failures(exits)
    for rank in range(4):
        r = json.loads((tmp_path / f"result-{rank}.json").read_text())
        dp, tp = r["coordinate"]
        assert rank == 2 * dp + tp
        fast, general = r["fast"], r["general"]
        assert [{k: v for k, v in leaf.items() if k != "row_len"} for leaf in fast] == [
            {k: v for k, v in leaf.items() if k != "row_len"} for leaf in general
        ]
        assert r["same_skeleton"] and r["rows_repeat"] and r["versions_equal"]
        by_path = {".".join(leaf["path"]): leaf for leaf in fast}
        # Every DTensor took the common-case walk (its 5-field row), not the fallback to the general one.
        assert all(leaf["row_len"] == (5 if leaf["is_dtensor"] else 4) for leaf in fast), fast
        assert all(leaf["local_is_the_dtensors"] for leaf in fast)
        # One place worked out per (mesh, placements, global shape): 6 distinct among the 9 DTensors.
        assert r["cached_places"] == 6

        def piece(path: str) -> tuple[list[int], list[list[int]], list[int]]:
            leaf = by_path[path]
            return leaf["shape"], leaf["region"], leaf["replicas"]

        for path in ("model.layer0.w", "model.layer2.w", "mixed.param", "list.0"):
            assert piece(path) == ([2, 3], [[4, 6], [2 * dp, 3 * tp]], [])
        assert piece("mixed.rep_shard") == ([2, 6], [[4, 6], [2 * tp, 0]], [tp, 2 + tp])
        assert piece("mixed.shard_rep") == ([2, 6], [[4, 6], [2 * dp, 0]], [2 * dp, 2 * dp + 1])
        assert piece("mixed.both_rep") == ([4, 6], [[4, 6], [0, 0]], [0, 1, 2, 3])
        assert piece("mixed.uneven") == ([3 - dp, 3], [[5, 3], [3 * dp, 0]], [2 * dp, 2 * dp + 1])
        # torch.chunk cuts 1 row into 1 and 0: tp 1 holds an empty piece, at the end.
        assert piece("mixed.empty_piece") == ([1 - tp, 2], [[1, 2], [tp, 0]], [tp, 2 + tp])
        assert by_path["mixed.empty_piece"]["dtype"] == "bfloat16"
        assert by_path["mixed.plain"]["region"] is None and not by_path["mixed.plain"]["is_dtensor"]

        partial = r["partial"]
        assert partial["error"] == "UnsupportedStateError" and partial["key"] == "['opt']['grad']", partial
        assert "partial values still to be reduced" in partial["message"], partial
