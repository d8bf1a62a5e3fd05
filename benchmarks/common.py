"""Pieces the benchmarks share: tier configurations, simple states, and starting ranks of a benchmark script.

Imported as ``import common`` (or ``from common import …``): a benchmark runs as ``python benchmarks/x.py``, which puts this
folder first on sys.path (the rank processes it starts run the same script, so they find it too).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Collection

import torch

# -- configurations ------------------------------------------------------------------------------------


def ram_tier(**settings: Any) -> dict[str, Any]:
    return {"name": "ram", "type": "memory", **settings}


def disk_tier(path: Path | str, name: str = "disk", **settings: Any) -> dict[str, Any]:
    return {"name": name, "type": "filesystem", "path": str(path), **settings}


def tier_config(*tiers: dict[str, Any], capacity: int | str | None, snapshots: int, ram: dict[str, Any] | None = None,
                distributed: dict[str, Any] | None = None, **host: Any) -> dict[str, Any]:
    """A host section, a memory tier (``ram``: its settings; a plain "ram" when None), then ``tiers``."""
    config: dict[str, Any] = {"host": {"capacity": capacity, "snapshots": snapshots, **host}, "tiers": [ram or ram_tier(), *tiers]}
    if distributed is not None:
        config["distributed"] = distributed
    return config


def alternating_runs(variants: Sequence[str], repeats: int, directory: Path, command: Callable[[str], list[str]], seconds: str,
                     env: Mapping[str, str]) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, Any]]:
    """Each of ``variants`` run ``repeats`` times as ``command(variant)`` (a new process, ``directory``
    emptied first), in alternating order; its last stdout line starting with ``{`` is its JSON result,
    ``seconds`` its key of the time. Returns the times by variant, each time less the ``variants[0]``
    run's of the same repeat (the baseline), and the last result."""
    runs: dict[str, list[float]] = {v: [] for v in variants}
    overheads: dict[str, list[float]] = {v: [] for v in variants}
    info: dict[str, Any] = {}
    for r in range(repeats):
        times = {}
        for variant in variants if r % 2 == 0 else tuple(reversed(variants)):
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            out = subprocess.run(command(variant), capture_output=True, text=True, env=os.environ | dict(env))
            if out.returncode != 0:
                raise SystemExit(f"{variant} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
            info = json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith("{")))
            times[variant] = info[seconds]
            runs[variant].append(info[seconds])
            print(f"repeat {r}: {variant:18s} {info[seconds]:7.2f} s  saved {info['saved']}", flush=True)
        for variant in variants:
            overheads[variant].append(times[variant] - times[variants[0]])
    return runs, overheads, info


def overhead_rows(variants: Sequence[str], runs: Mapping[str, list[float]], overheads: Mapping[str, list[float]], saves: int,
                  named: Mapping[str, str], durable: Mapping[str, str]) -> list[str]:
    """The table rows of :func:`alternating_runs`' results (median time, overhead, per checkpoint,
    durable), then every repeat's times."""
    rows = []
    for variant in variants:
        over = statistics.median(overheads[variant])
        per = over / saves if variant != variants[0] else 0.0
        rows.append(f"| {named[variant]} | {statistics.median(runs[variant]):.2f} | {over:+.2f} | {per:+.3f} | {durable[variant]} |")
    return [*rows, "", "Per repeat (s): " + "; ".join(f"{v} " + " / ".join(f"{t:.2f}" for t in runs[v]) for v in variants)]


def print_and_keep(text: str, results: Path, keep: bool) -> None:
    """Print a benchmark's section, and append it to ``results`` (RESULTS.md) when ``keep``."""
    print(text)
    if keep:
        with open(results, "a") as f:
            f.write("\n" + text + "\n")


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
