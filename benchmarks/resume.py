"""Time to resume: a new process per run, as a restarted job does it, each phase timed apart.

After a failure every GPU of the job idles until the state is back, so what counts is the time from
the new process's start to its first training step. Each run is a new process started with the page
cache dropped (as root): import torch and the checkpoint library, build the model and its AdamW
optimizer (the template: freshly initialised weights, zeroed moments), construct the loader
(tierckpt's ``Checkpointer``; nothing for DCP and ``torch.load``; torch_checkpointing's manager),
restore into the template (``model.load_state_dict`` and ``optimizer.load_state_dict`` after it, for
every loader), then one training step. Every restored byte is checked against the saved state's digest,
outside the timed phases.

The loaders, on the same state and directory: tierckpt ``restore_latest(template)`` (its host pool sized
for two snapshots, as a training run would have it), tierckpt with ``verify_first=True``, tierckpt
from its RAM tier on /dev/shm (a restart on the same node after the process died: the snapshot
outlived it there, and dropping the page cache leaves tmpfs alone), DCP
``load``, ``torch.load`` (weights_only) then ``load_state_dict``, and Meta's torch_checkpointing
``load(into=template)`` where it is installed. The model: an MLP whose weights and AdamW moments make
the state size asked for (12 bytes a parameter).

    .venv/bin/python benchmarks/resume.py --gib 1 4 --repeats 3 --dir /tmp/tierckpt-resume
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

# The parent's helpers (common, machine_limits) import tierckpt: the children must not, so that each
# loader's own import is timed as a phase of its own.

LAYERS = 8
KINDS = ["tierckpt", "tierckpt_later", "tierckpt_verify_first", "tierckpt_ram", "dcp", "torch", "tc"]
LATER_S = 3.0  # how long after construction tierckpt_later's restore starts (not counted in its phases)
LABELS = {
    "tierckpt": "tierckpt `restore_latest(template)`",
    "tierckpt_later": f"tierckpt, restore {LATER_S:g} s after `Checkpointer()` (the wait not counted)",
    "tierckpt_verify_first": "tierckpt, `verify_first=True`",
    "tierckpt_ram": "tierckpt from its RAM tier (/dev/shm: the process died, not the node)",
    "dcp": "DCP `load`",
    "torch": "`torch.load` + `load_state_dict`",
    "tc": "torch_checkpointing `load(into=)`",
}


def hidden_for(nbytes: int) -> int:
    """The MLP width whose weights, biases and two AdamW moments come to about ``nbytes``."""
    return max(64, int(math.sqrt(nbytes / (12 * LAYERS))) // 64 * 64)


def build(hidden: int) -> tuple[Any, Any]:
    """A freshly initialised model and its AdamW optimizer with zeroed state (what a template is)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # AdamW's state as its first step would make it, zeroed
        optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return model, optimizer


def train_step(model: Any, optimizer: Any, hidden: int, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, hidden, generator=g)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def state_of(model: Any, optimizer: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def digest(model: Any, optimizer: Any) -> str:
    import torch
    import xxhash

    h = xxhash.xxh3_64()
    for p in model.parameters():
        h.update(p.detach().view(torch.uint8).numpy())
        for v in optimizer.state[p].values():
            h.update(v.reshape(-1).contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def tier_config(directory: Path, nbytes: int, shm: str | None = None) -> dict[str, Any]:
    """RAM and a local disk, the pool sized for two snapshots of the state. ``shm``: the RAM tier's
    pool in this directory on /dev/shm, where it outlives the process (its own disk tier beside it)."""
    ram: dict[str, Any] = {"name": "ram", "type": "memory"}
    if shm is not None:
        ram["path"] = shm
    nvme = {"name": "nvme", "type": "filesystem", "path": str(directory / ("tierckpt-ram" if shm else "tierckpt")), "keep": {"last": 1}}
    return {"host": {"capacity": 2 * (nbytes + (64 << 20)), "snapshots": 2}, "tiers": [ram, nvme]}


def tc_manager() -> Any:
    """torch_checkpointing's manager with a synchronous saver (no writer process) and buffered files
    (its O_DIRECT default fails on ext4: see save_restore.py)."""
    from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))


def fsync_tree(root: Path) -> None:
    from tierckpt.storage.posix import fsync_dir

    paths = [root] if root.is_file() else [Path(d) / f for d, _, fs in os.walk(root) for f in fs]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(root.parent)


def setup(job: dict[str, Any]) -> None:
    """Train one step, then save the same state with every loader's library (``--setup``)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tierckpt import Checkpointer

    directory, hidden = Path(job["dir"]), job["hidden"]
    model, optimizer = build(hidden)
    train_step(model, optimizer, hidden, seed=1)  # moments that are not zeros
    state = state_of(model, optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    with Checkpointer(tier_config(directory, nbytes)) as ckpt:
        assert ckpt.save_sync(100, state).committed_sync("nvme")
    # The same step through a RAM tier on /dev/shm: its snapshot stays there when this process exits.
    with Checkpointer(tier_config(directory, nbytes, job["shm"])) as ckpt:
        assert ckpt.save_sync(100, state).committed_sync("nvme")
    dcp.save(state, checkpoint_id=directory / "dcp", no_dist=True)
    torch.save(state, directory / "torch.pt")
    fsync_tree(directory / "torch.pt")
    if job["tc"]:
        manager = tc_manager()
        try:
            future = manager.save(str(directory / "tc"), state)  # the synchronous saver returns when written
            if future is not None:
                future.result()
        finally:
            manager.close()
        fsync_tree(directory / "tc")
    print(json.dumps({"digest": digest(model, optimizer), "nbytes": nbytes}))


def _tensors(state: Any) -> list[Any]:
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def child(job: dict[str, Any]) -> None:
    """One resume (``--child``): every phase timed from this process's start, as given by the parent."""
    started = job["started"]
    kind, directory, hidden = job["kind"], Path(job["dir"]), job["hidden"]
    import torch

    marks = {"torch": time.time()}
    if kind.startswith("tierckpt"):
        from tierckpt import Checkpointer
    elif kind == "dcp":
        import torch.distributed.checkpoint as dcp
    elif kind == "tc":
        import torch_checkpointing  # noqa: F401
    marks["import"] = time.time()
    model, optimizer = build(hidden)
    template = state_of(model, optimizer)
    marks["template"] = time.time()
    ckpt = manager = None
    if kind.startswith("tierckpt"):
        ckpt = Checkpointer(tier_config(directory, job["nbytes"], job["shm"] if kind == "tierckpt_ram" else None))
    elif kind == "tc":
        manager = tc_manager()
    marks["construct"] = time.time()
    waited = 0.0
    if kind == "tierckpt_later":  # what a restore that starts later gains: the first seconds' costs
        time.sleep(LATER_S)
        waited = time.time() - marks["construct"]
    if ckpt is not None:
        restored = ckpt.restore_latest_sync(template, verify_first=kind == "tierckpt_verify_first")
        assert restored is not None and restored.step == 100 and restored.tier == ("ram" if kind == "tierckpt_ram" else "nvme")
        loaded = restored.state
    elif kind == "dcp":
        dcp.load(template, checkpoint_id=directory / "dcp", no_dist=True)
        loaded = template
    elif kind == "torch":
        loaded = torch.load(directory / "torch.pt", weights_only=True)
    else:
        loaded = manager.load(str(directory / "tc"), into=template)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optim"])
    marks["restore"] = time.time() - waited
    checked = digest(model, optimizer)  # not timed: the next phase starts after it
    resumed = time.time()
    train_step(model, optimizer, hidden, seed=2)
    marks["step"] = time.time() - (resumed - marks["restore"])  # less the digest, and the wait (in marks["restore"])
    if ckpt is not None:
        ckpt.close_sync()
    if manager is not None:
        manager.close()
    phases, last = {}, started
    for name, at in marks.items():
        phases[name] = at - last
        last = at
    print(json.dumps({"phases": phases, "resume_s": marks["step"] - started, "digest": checked}))


def run_child(job: dict[str, Any], flag: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, __file__, flag, json.dumps(job)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{flag} {job.get('kind', '')} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def table(size: dict[str, Any]) -> list[str]:
    med = size["median"]
    dcp = med["dcp"]["resume_s"]
    lines = [
        f"**{size['bytes'] / 2**30:.2f} GiB** (an MLP of {LAYERS} layers, width {size['hidden']}: weights and AdamW moments; "
        f"medians of {size['repeats']}; seconds)",
        "",
        "| loader | interpreter + torch | import the library | build the template | construct | restore + load_state_dict | "
        "first step | resume | vs DCP | the library's own (import + construct + restore): s | DCP's own over it |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def own(p: dict[str, float]) -> float:
        return p["import"] + p["construct"] + p["restore"]

    dcp_own = own(med["dcp"]["phases"])
    for kind in size["kinds"]:
        p, total = med[kind]["phases"], med[kind]["resume_s"]
        lines.append(
            f"| {LABELS[kind]} | {p['torch']:.2f} | {p['import']:.2f} | {p['template']:.2f} | {p['construct']:.3f} | {p['restore']:.2f} | "
            f"{p['step']:.2f} | {total:.2f} | {100 * total / dcp:.0f}% | {own(p):.2f} | {dcp_own / own(p):.1f}× |"
        )
    return lines + [""]


def median_of(samples: list[dict[str, Any]]) -> dict[str, Any]:
    names = samples[0]["phases"].keys()
    return {
        "phases": {n: statistics.median(s["phases"][n] for s in samples) for n in names},
        "resume_s": statistics.median(s["resume_s"] for s in samples),
    }


def resumes(repeats: int, kinds: list[str], directory: Path, hidden: int, saved: dict[str, Any], shm: str, gib: float) -> dict[str, list[dict[str, Any]]]:
    """Every loader's resume, ``repeats`` times each, a new process per run with the page cache dropped
    (which leaves /dev/shm as it is: tmpfs pages are not cache)."""
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    from machine_limits import drop_caches

    for r in range(repeats):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:  # alternate the order: no loader always goes first
            drop_caches()
            job = {"kind": kind, "dir": str(directory), "hidden": hidden, "nbytes": saved["nbytes"], "shm": shm, "started": time.time()}
            out = run_child(job, "--child")
            if out.pop("digest") != saved["digest"]:
                raise RuntimeError(f"{kind} restored other bytes than were saved")
            samples[kind].append(out)
            print(f"{gib:g} GiB, repeat {r}, {kind}: " + json.dumps(out), flush=True)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk to measure (default: a new one under /tmp)")
    parser.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.setup:
        setup(json.loads(args.setup))
        return
    if args.child:
        child(json.loads(args.child))
        return
    import importlib.util

    import common
    from machine_limits import drop_caches, machine

    tc = importlib.util.find_spec("torch_checkpointing") is not None
    kinds = [k for k in args.kinds if k != "tc" or tc]
    base = args.dir or Path(tempfile.mkdtemp(prefix="tierckpt-resume-"))
    base.mkdir(parents=True, exist_ok=True)
    cold = drop_caches()
    stamp = time.strftime("%Y-%m-%d %H:%M")
    report: dict[str, Any] = {"time": stamp, "machine": machine(base), "cold_cache": cold, "sizes": []}
    for gib in args.gib:
        directory = base / f"{gib:g}gib"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        hidden = hidden_for(int(gib * 2**30))
        shm = Path("/dev/shm") / f"tierckpt-resume-{uuid.uuid4().hex[:8]}"
        try:
            saved = run_child({"dir": str(directory), "hidden": hidden, "tc": tc, "shm": str(shm)}, "--setup")
            samples = resumes(args.repeats, kinds, directory, hidden, saved, str(shm), gib)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        size = {"gib": gib, "bytes": saved["nbytes"], "hidden": hidden, "repeats": args.repeats, "kinds": kinds,
                "median": {k: median_of(v) for k, v in samples.items()}, "samples": samples}
        report["sizes"].append(size)
        print("\n".join(table(size)), flush=True)
        shutil.rmtree(directory, ignore_errors=True)
    json_path = Path(__file__).with_name("results") / f"resume-{time.strftime('%Y%m%d-%H%M%S')}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    m = report["machine"]
    lines = [
        f"### Time to resume: a new process from start to its first training step ({stamp})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}; disk: {m['disk']}, "
        f"O_DIRECT: {m['o_direct']}; Python {m['python']}, torch {m['torch']}. Page cache dropped before every run: {cold}. "
        f"Command: `{' '.join(['python', *sys.argv])}`; raw numbers: `{json_path.name}`. Each phase starts where the last "
        "ended; `interpreter + torch` includes the interpreter's start. Resume = from the process's start to the end of its first step. "
        "The library's own: importing it (after torch), constructing its loader, and restoring: what a job pays for it.",
        "",
    ]
    for size in report["sizes"]:
        lines += table(size)
    common.append_section(args.results, lines, json_path)
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
