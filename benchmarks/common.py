"""Pieces the benchmarks share: tier configurations, simple states, and starting ranks of a benchmark script.

Imported as ``import common`` (or ``from common import …``): a benchmark runs as ``python benchmarks/x.py``, which puts this
folder first on sys.path (the rank processes it starts run the same script, so they find it too).
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Collection

import torch

# -- configurations ------------------------------------------------------------------------------------


def ram_tier(**settings: Any) -> dict[str, Any]:
    return {"name": "ram", "type": "memory", **settings}


def disk_tier(path: Path | str, name: str = "disk", **settings: Any) -> dict[str, Any]:
    return {"name": name, "type": "filesystem", "path": str(path), **settings}


def tier_config(*tiers: dict[str, Any], capacity: int | str, snapshots: int, ram: dict[str, Any] | None = None,
                distributed: dict[str, Any] | None = None, **host: Any) -> dict[str, Any]:
    """A host section, a memory tier (``ram``: its settings; a plain "ram" when None), then ``tiers``."""
    config: dict[str, Any] = {"host": {"capacity": capacity, "snapshots": snapshots, **host}, "tiers": [ram or ram_tier(), *tiers]}
    if distributed is not None:
        config["distributed"] = distributed
    return config


# -- states --------------------------------------------------------------------------------------------


def pieces_state(nbytes: int, pieces: int = 8) -> dict[str, Any]:
    """About ``nbytes`` of fp32 in ``pieces`` equal tensors: for benchmarks where the values do not matter."""
    return {"model": {f"w{i}": torch.randn(nbytes // pieces // 4) for i in range(pieces)}, "step": 0}


# -- this process --------------------------------------------------------------------------------------


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM: ru_maxrss would carry the parent's peak over the exec)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def io_counters() -> tuple[int, int]:
    """This process's (bytes read from the disk, bytes returned by read calls: page cache hits too)."""
    fields = dict(line.split(":") for line in open("/proc/self/io"))
    return int(fields["read_bytes"]), int(fields["rchar"])


# -- the report ----------------------------------------------------------------------------------------


def append_section(results: Path, lines: list[str], raw: Path) -> None:
    """Append a markdown section to ``results`` (RESULTS.md) and say where it and the raw numbers went."""
    with open(results, "a") as f:
        f.write("\n".join(lines) + "\n")
    print(f"results: {results}, {raw}")


def show_report(lines: list[str], markdown: Path, results: Path, total_s: float) -> None:
    """Print the markdown section, write it to ``markdown``, and say where the results went."""
    text = "\n".join(lines)
    print("\n" + text)
    markdown.write_text(text + "\n")
    print(f"results: {results}, {markdown} ({total_s:.0f} s)")


# -- ranks ---------------------------------------------------------------------------------------------


def start_rank(hang_s: float) -> None:
    """What a rank process does first: after ``hang_s`` a hang prints where every thread is and ends the
    process (rather than holding the launcher to its own limit); torch.distributed's FutureWarnings hushed."""
    import faulthandler

    faulthandler.dump_traceback_later(hang_s, exit=True)
    warnings.filterwarnings("ignore", category=FutureWarning)


def run_ranks(script: str, job: dict[str, Any], world: int, log_dir: Path, *, timeout_s: float, what: str,
              expect_dead: Collection[int] = (), env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Start ``world`` ranks of ``script --rank-worker JOB`` (world 0: one process, no process group); each
    writes ``rank-<r>.json`` into a fresh ``job["results"]``. Returns those, or raises with the logs' tails."""
    from tierckpt.testing import failures, launch_ranks

    results = Path(job["results"])
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    exits = launch_ranks([sys.executable, script, "--rank-worker", json.dumps(job)], world, env=env, timeout_s=timeout_s, log_dir=log_dir)
    if failed := failures(exits, expect_dead=expect_dead):
        raise RuntimeError(f"{what} failed (logs: {log_dir}):\n{failed}")
    return [json.loads((results / f"rank-{r}.json").read_text()) for r in range(max(world, 1))]
