"""``tierckpt.testing.launch_ranks``: real processes, their environment, one deadline, logs in files; and
``end_job``: a rank of an FSDP2 job on gloo ends with no gloo thread left to abort its exit."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tierckpt.testing import TAIL_CHARS, RankExit, failures, launch_ranks

SHOW_ENV = "import json, os; print(json.dumps({k: os.environ.get(k) for k in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'OMP_NUM_THREADS', 'EXTRA')}))"


def _env(exit: RankExit) -> dict[str, str | None]:
    return json.loads(exit.output)


def test_ranks_share_a_port_and_get_their_own_rank_and_env_overrides_the_defaults() -> None:
    exits = launch_ranks([sys.executable, "-c", SHOW_ENV], 3, env={"EXTRA": "x", "OMP_NUM_THREADS": "4"}, timeout_s=60)
    assert failures(exits) == ""
    envs = [_env(e) for e in exits]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"], e["OMP_NUM_THREADS"], e["EXTRA"]) for e in envs} == {
        ("3", "127.0.0.1", envs[0]["MASTER_PORT"], "4", "x")
    }
    assert int(envs[0]["MASTER_PORT"]) > 0
    (alone,) = launch_ranks([sys.executable, "-c", SHOW_ENV], 1, timeout_s=60)
    assert _env(alone)["OMP_NUM_THREADS"] == "1" and _env(alone)["WORLD_SIZE"] == "1"


def test_world_zero_is_one_process_without_the_distributed_variables(tmp_path: Path) -> None:
    (only,) = launch_ranks([sys.executable, "-c", SHOW_ENV], 0, timeout_s=60, log_dir=tmp_path / "logs")
    assert only.rank == 0 and only.returncode == 0
    assert _env(only) == {"RANK": None, "WORLD_SIZE": None, "MASTER_ADDR": None, "MASTER_PORT": None, "OMP_NUM_THREADS": "1", "EXTRA": None}
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["rank-0.log"]


def test_a_rank_past_the_deadline_is_killed_and_the_others_are_reported_as_they_ended(tmp_path: Path) -> None:
    code = "import os, sys, time; r = int(os.environ['RANK']); print('rank', r, flush=True); time.sleep(60) if r == 1 else sys.exit(r)"
    t = time.monotonic()
    exits = launch_ranks([sys.executable, "-c", code], 3, timeout_s=3, log_dir=tmp_path)
    assert time.monotonic() - t < 20
    assert [(e.rank, e.returncode) for e in exits] == [(0, 0), (1, None), (2, 2)]
    assert [e.output for e in exits] == ["rank 0\n", "rank 1\n", "rank 2\n"]
    assert (tmp_path / "rank-1.log").read_text() == "rank 1\n"  # kept
    report = failures(exits)
    assert "rank 0" not in report
    assert "--- rank 1 (still running at the deadline, killed, expected exit 0) ---\nrank 1\n" in report
    assert "--- rank 2 (exit 2, expected exit 0) ---\nrank 2\n" in report


def test_output_larger_than_a_pipe_does_not_hang_and_its_tail_is_kept() -> None:
    # 1 MiB from every rank: a launcher reading pipes one rank after another would block rank 1 on a full pipe.
    code = "import sys; sys.stdout.write('x' * (1 << 20) + 'end'); sys.stdout.flush()"
    exits = launch_ranks([sys.executable, "-c", code], 2, timeout_s=60)
    assert [e.returncode for e in exits] == [0, 0]
    assert all(len(e.output) == TAIL_CHARS and e.output.endswith("xend") for e in exits)


def test_ranks_expected_dead_must_die_by_sigkill() -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL) if os.environ['RANK'] == '1' else None"
    exits = launch_ranks([sys.executable, "-c", code], 2, timeout_s=60)
    assert [e.returncode for e in exits] == [0, -9]
    assert failures(exits, expect_dead=(1,)) == ""
    assert "--- rank 1 (exit -9, expected exit 0) ---" in failures(exits)
    assert "--- rank 0 (exit 0, expected exit -9) ---" in failures(exits, expect_dead=(0, 1))


# Two ranks of an FSDP2 model on gloo take its weights whole, drop the model and call end_job.
# "pinned": the script keeps the default group, as torch.distributed.nn's default arguments do when a
# DTensor call first imports it after init_process_group.
END_JOB = """
import atexit, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from tierckpt.testing.ranks import end_job, gloo_threads
out = Path(sys.argv[1]) / os.environ["RANK"]
out.mkdir()
atexit.register(lambda: (out / "atexit").write_text("ran"))
dist.init_process_group("gloo")
model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
model(torch.randn(4, 4)).sum().backward()
whole = [p.full_tensor() for p in model.parameters()]
kept = dist.group.WORLD if sys.argv[2] == "pinned" else None
(out / "threads").write_text(str(gloo_threads()))
del model, whole
end_job()
(out / "returned").write_text(str(gloo_threads()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("held", ["freed", "pinned"])
def test_end_job_leaves_no_gloo_thread_to_race_the_exit_or_ends_the_process_at_once(tmp_path: Path, held: str) -> None:
    exits = launch_ranks([sys.executable, "-c", END_JOB, str(tmp_path), held], 2, timeout_s=120)
    assert failures(exits) == ""
    for rank in ("0", "1"):
        out = tmp_path / rank
        assert int((out / "threads").read_text()) > 0  # the job's groups ran gloo threads
        if held == "freed":  # every group went: end_job returned with no thread left, and the exit ran its hooks
            assert (out / "returned").read_text() == "0"
            assert (out / "atexit").read_text() == "ran"
        else:  # torch keeps the default group: the process ended inside end_job, before finalization
            assert not (out / "returned").exists()
            assert not (out / "atexit").exists()
