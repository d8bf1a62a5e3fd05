"""The GPU restore against the disk's read limit, and a bitwise check of the lazy capture on real training.

Parts (``--parts``, all by default), each isolated: one that fails is reported, the others still run,
and the exit status is then 1 (a DCP or GPUDirect Storage failure is a finding, reported, not a failure).

1. **restore**: a state of model weights and AdamW-like moments (``--size``, 2 GiB on cuda; 32 layers
   of 8 fp32 tensors and their moments and step counters: 1,024 tensors) on ``--device``, saved to a
   filesystem tier (``io_threads``: ``--io-threads``) and committed. Then, ``--repeats`` times, in
   alternating order: a new process imports, makes its CUDA context and builds fresh templates
   (``torch.empty`` on the device); then the parent drops the page cache (``/proc/sys/vm/drop_caches``
   as root, else ``posix_fadvise(DONTNEED)`` on the version's files; the report says which, and what
   stayed resident) and the child's clock starts: it constructs a ``Checkpointer`` and restores into
   the templates at once (``restore_latest_sync``), timing the construction and the restore; the
   same, the restore started 3 s after construction (the first-restore gap); and the read limit: O_DIRECT reads of that version's data files into a
   reused 16 MiB buffer per thread (``machine_limits.read_files``) with the tier's threads, one more,
   and twice that (``read_thread_counts``); the limit is the best of them. Every restore's bytes are
   checked against the saved state's digest, outside the clock. Share of the limit = the limit's
   seconds / the restore's (target ≥ 85%).
2. **gds**: (CUDA only) GPUDirect Storage probed on the same disk, in a child process: a 256 MiB file
   registered with ``torch.cuda.gds.GdsFile`` and read into GPU memory, its bytes checked. Reported,
   not built on.
3. **dcp**: DCP ``save`` of the same state, then ``load`` into fresh templates in a new process, the
   page cache dropped the same way: the peer beside the restore.
4. **correctness**: a GPT (``benchmarks/gpt.py``, ``--correctness-size`` of weights + AdamW moments)
   trained a few real steps with AdamW on ``--device``; then, after a forward/backward, a reference
   copy of the model's and optimizer's state (cloned, synchronized), ``ckpt.save_sync(...)`` with
   ``ckpt.attach(optimizer)`` as the only barrier, and ``optimizer.step()`` queued right after it.
   Once committed to the filesystem tier, the step is restored into fresh templates (``empty_like``
   on the device, filled with 0xA5 so that no stale copy can pass) from the RAM tier, from the disk
   (through the pinned ring), from the disk with ``verify_first=True`` (staged), and from the disk in a
   new ``Checkpointer`` (empty RAM, as after a restart), each compared bit for bit (``torch.equal`` on
   uint8 views) with the reference: PASS or FAIL per restore; a FAIL fails the run.

``--budget-s`` starts no restore repeat that would end past that many seconds from the start (estimated
from the last), and no part after them; what was left out is said.

Writes ``<name>.md`` (ready for benchmarks/RESULTS.md) and ``<name>.json`` to ``--out`` (name
``gpu_restore-<time>`` unless ``--name``), both rewritten after each part, so a run cut short keeps
what it measured.

    python3 benchmarks/gpu_restore.py --device cuda --out $OUT            # the GPU machine: 2 GiB, ~1.5 minutes
    .venv/bin/python benchmarks/gpu_restore.py --device cpu --quick      # the same code paths on CPU tensors, seconds

The filesystem tier, the limit's reads and DCP write under ``--dir`` (a temporary directory, removed
after; default ``$TMPDIR``): put it on the disk to measure, not on a tmpfs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash

import common
from gpu_capture import PROFILES as TRAINING_PROFILES
from gpu_capture import Trainer, human, model_size, ready_pool, release, synchronize
from machine_limits import machine, read_files, read_thread_counts
from peer import drop_file_cache
from tierckpt import Checkpointer
from tierckpt.format import version_dirname
from tierckpt.storage.posix import probe_direct_io
from tierckpt.units import parse_size

HERE = Path(__file__).resolve().parent
LAYERS = 32  # of 8 tensors: with 2 moments and a step counter each, 1,024 tensors
STEP = 7  # the version every part saves
DELAY_S = 3.0  # the later restore starts this long after construction
GDS_BYTES = 256 << 20
READY = "ready"  # a child's line: set up, waiting for the page cache to be dropped before its clock starts
POISON = 0xA5  # every byte of a correctness template before its restore
TARGET_SHARE = 0.85
WAIT_S = 600.0  # a capture, commit or child not done by then counts as failed, rather than hanging the run
FINDINGS = ("gds", "dcp")  # parts whose failure is reported, not a failure of the run
PARTS = ("restore", "gds", "dcp", "correctness")


@dataclasses.dataclass(frozen=True)
class Profile:
    size_bytes: int  # the restore's state
    correctness_bytes: int  # the GPT's weights + AdamW moments
    repeats: int
    train_steps: int  # real steps before the checked save
    child_timeout_s: float


PROFILES = {
    "cuda": Profile(2 << 30, 2 << 30, repeats=2, train_steps=3, child_timeout_s=180),
    "cpu": Profile(256 << 20, 128 << 20, repeats=2, train_steps=2, child_timeout_s=180),
    "quick": Profile(16 << 20, 16 << 20, repeats=1, train_steps=2, child_timeout_s=120),
}


# -- the state ---------------------------------------------------------------------------------------------


def make_state(nbytes: int, device: str, *, template: bool = False) -> dict[str, Any]:
    """Weights and AdamW-like moments of about ``nbytes`` (3 × the weights) in ``LAYERS`` layers of 4 matrices
    and 4 vectors, fp32, on ``device``; step counters on the CPU, as AdamW keeps them. The same structure
    every time: ``template`` gives it with uninitialised tensors (``torch.empty``), a restore's target."""
    hidden = max(8, int((nbytes / (3 * LAYERS * 12 * 4)) ** 0.5))  # 12 h² floats of matrices a layer
    shapes: dict[str, tuple[int, ...]] = {"qkv.weight": (3 * hidden, hidden), "proj.weight": (hidden, hidden), "fc.weight": (4 * hidden, hidden), "out.weight": (hidden, 4 * hidden)}
    shapes |= {name: (hidden,) for name in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias")}
    names = [(f"layers.{i}.{name}", shape) for i in range(LAYERS) for name, shape in shapes.items()]
    generator = None if template else torch.Generator(device=device).manual_seed(0)

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        if template:
            return torch.empty(shape, device=device)
        return torch.randn(shape, device=device, generator=generator)

    model = {name: tensor(shape) for name, shape in names}
    moments = {
        i: {"step": torch.empty(()) if template else torch.tensor(float(STEP)), "exp_avg": tensor(shape), "exp_avg_sq": tensor(shape)}
        for i, (_, shape) in enumerate(names)
    }
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "params": list(range(len(names)))}]
    return {"model": model, "optim": {"state": moments, "param_groups": groups}}


def leaves(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every value that is not a container, with its path, in a fixed order."""
    if isinstance(value, dict):
        return [leaf for key, v in value.items() for leaf in leaves(v, f"{path}/{key}")]
    if isinstance(value, (list, tuple)):
        return [leaf for i, v in enumerate(value) for leaf in leaves(v, f"{path}/{i}")]
    return [(path, value)]


def tensors_of(state: Any) -> list[torch.Tensor]:
    return [v for _, v in leaves(state) if isinstance(v, torch.Tensor)]


def nbytes_of(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (any dtype, any shape, 0-d included)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def digest(state: Any) -> str:
    """xxh3-64 of every tensor's bytes in order, copied to the host one by one."""
    h = xxhash.xxh3_64()
    for tensor in tensors_of(state):
        h.update(raw(tensor).cpu().numpy().data)
    return h.hexdigest()


def tier_config(directory: Path, nbytes: int, tensors: int, io_threads: int) -> dict[str, Any]:
    """RAM, then the filesystem tier in ``directory``; a host pool of two slots of the state's size, as a training
    run would have it (its slots are faulted in the background, paused while a restore runs)."""
    slot = nbytes + 4096 * tensors + (64 << 20)
    nvme = common.disk_tier(directory, "nvme", keep={"last": 1}, io_threads=io_threads)
    return common.tier_config(nvme, capacity=2 * slot, snapshots=2)


# -- children: one restore, load or probe per new process ----------------------------------------------------


def child(job: dict[str, Any]) -> dict[str, Any]:
    """One timed restore (``--child``), from a new process: templates built and the device ready before the clock."""
    device = job["device"]
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.zeros(1, device=device)  # the CUDA context, before anything is timed
    if job["kind"] == "gds":
        ready()
        return gds_probe(Path(job["path"]))
    template = make_state(job["size"], device, template=True)
    synchronize(device)
    if job["kind"] == "dcp":
        import torch.distributed.checkpoint as dcp

        ready()
        t = time.perf_counter()
        dcp.load(template, checkpoint_id=job["path"], no_dist=True)
        synchronize(device)
        return {"restore_s": time.perf_counter() - t, "digest": digest(template)}
    config = tier_config(Path(job["path"]), job["nbytes"], job["tensors"], job["io_threads"])
    ready()
    t = time.perf_counter()
    ckpt = Checkpointer(config)
    constructed = time.perf_counter()
    try:
        time.sleep(job["delay_s"])
        started = time.perf_counter()
        restored = ckpt.restore_latest_sync(template)
        synchronize(device)
        done = time.perf_counter()
        if restored is None or (restored.step, restored.tier) != (STEP, "nvme"):
            raise RuntimeError(f"restored {None if restored is None else (restored.step, restored.tier)}, expected step {STEP} from nvme")
        first = next(iter(template["model"].values()))
        if restored.state["model"]["layers.0.qkv.weight"] is not first:
            raise RuntimeError("the restore did not land in the template's tensors")
        return {"construct_s": constructed - t, "restore_s": done - started, "digest": digest(template)}
    finally:
        ckpt.close_sync()


def gds_probe(path: Path) -> dict[str, Any]:
    """Register ``path`` with cuFile (``torch.cuda.gds.GdsFile``) and read it into GPU memory; its bytes checked."""
    try:
        import torch.cuda.gds as gds
    except ImportError as exc:
        return {"ok": False, "error": f"no torch.cuda.gds in torch {torch.__version__}: {exc}"}
    if not hasattr(gds, "GdsFile"):
        return {"ok": False, "error": f"no torch.cuda.gds.GdsFile in torch {torch.__version__}"}
    nbytes = path.stat().st_size
    try:
        t = time.perf_counter()
        handle = gds.GdsFile(str(path), os.O_RDONLY)
        registered = time.perf_counter() - t
    except Exception as exc:
        return {"ok": False, "error": f"registering the file: {type(exc).__name__}: {exc}"}
    try:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        handle.load_storage(buffer.untyped_storage(), 0)  # type: ignore[arg-type]  # its docs pass an untyped storage
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
    except Exception as exc:
        return {"ok": False, "registered_s": registered, "error": f"reading: {type(exc).__name__}: {exc}"}
    expected = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    equal = torch.equal(buffer.cpu(), expected)
    return {"ok": equal, "registered_s": registered, "seconds": seconds, "gbps": nbytes / seconds / 1e9, "bytes": nbytes, "equal": equal}


def ready() -> None:
    """In a child: say that everything before the clock is done (imports, CUDA context, templates), and wait
    for the parent to have dropped the page cache."""
    print(READY, flush=True)
    sys.stdin.readline()


def run_child(job: dict[str, Any], timeout_s: float, directory: Path | None = None, cache: str = "drop") -> dict[str, Any]:
    """``child(job)`` in a new process; its answer, or an error with the end of its stderr. With ``directory``,
    the page cache of its files is dropped (:func:`peer.drop_file_cache`; ``cache``: ``drop``, the whole page
    cache where allowed, or ``fadvise``, only these files') once the child is ready, right before its clock
    starts: its own imports and libraries stay cached, as a restarted job's have been loaded by then, while
    the checkpoint is read cold. The answer then holds ``uncached``."""
    command = [sys.executable, __file__, "--child", json.dumps(job)]
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        timer = threading.Timer(timeout_s, proc.kill)  # readline() below cannot time out by itself
        timer.start()
        try:
            uncached = None
            if proc.stdout.readline().strip() == READY:  # else it failed before: its stderr says why
                uncached = drop_file_cache(directory, whole=cache == "drop") if directory is not None else None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            out, _ = proc.communicate()
        finally:
            timer.cancel()
        if proc.returncode != 0:
            stderr.seek(0)
            killed = f" (killed after {timeout_s:.0f} s)" if proc.returncode == -9 else ""
            raise RuntimeError(f"the {job['kind']} child exited {proc.returncode}{killed}:\n{stderr.read()[-4000:]}")
    answer = dict(json.loads(out.strip().splitlines()[-1]))
    if uncached is not None:
        answer["uncached"] = uncached
    return answer


# -- part 1: restore vs the read limit -------------------------------------------------------------------------


def saved_state(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """The state made on the device, saved to the filesystem tier in ``directory`` and committed; its numbers."""
    state = make_state(args.size, args.device)
    synchronize(args.device)
    nbytes, tensors = nbytes_of(state), len(tensors_of(state))
    saved = {"bytes": nbytes, "tensors": tensors, "digest": digest(state)}
    with Checkpointer(tier_config(directory, nbytes, tensors, args.io_threads)) as ckpt:
        t = time.perf_counter()
        handle = ckpt.save_sync(STEP, state)
        if not handle.committed_sync("nvme", timeout=WAIT_S):
            raise RuntimeError(f"step {STEP} was not committed to the filesystem tier")
        saved["save_to_commit_s"] = time.perf_counter() - t
    del state, handle
    release(args.device)
    return saved


def restore_once(args: argparse.Namespace, directory: Path, saved: dict[str, Any], delay_s: float) -> dict[str, Any]:
    """One restore in a new process, the version's page cache dropped right before; checked against the saved digest."""
    job = {"kind": "restore", "device": args.device, "path": str(directory), "size": args.size, "nbytes": saved["bytes"],
           "tensors": saved["tensors"], "io_threads": args.io_threads, "delay_s": delay_s}  # fmt: skip
    out = run_child(job, args.child_timeout_s, directory, args.cache)
    if out.pop("digest") != saved["digest"]:
        raise RuntimeError(f"the restore {'after ' + str(delay_s) + ' s' if delay_s else 'at once'} gave other bytes than were saved")
    return out


def bench_restore(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    directory = work / "restore"
    saved = saved_state(args, directory)
    print(f"restore: saved {human(saved['bytes'])} in {saved['tensors']} tensors ({elapsed(args)})", flush=True)
    files = sorted(p for p in (directory / version_dirname(STEP)).glob("data-*") if p.is_file())
    file_bytes = sum(p.stat().st_size for p in files)
    direct = probe_direct_io(directory)
    threads = read_thread_counts(args.io_threads)
    out: dict[str, Any] = {**saved, "files": len(files), "file_bytes": file_bytes, "io_threads": args.io_threads, "o_direct": direct,
                           "thread_counts": list(threads), "samples": []}  # fmt: skip
    for r in range(args.repeats):
        if r and args.deadline is not None and time.monotonic() + out["samples"][-1]["took_s"] > args.deadline:
            out["cut"] = f"{args.repeats - r} of {args.repeats} repeats left out by --budget-s"
            break
        t = time.monotonic()
        sample: dict[str, Any] = {}
        for kind in ("at_once", "later") if r % 2 == 0 else ("later", "at_once"):
            sample[kind] = restore_once(args, directory, saved, DELAY_S if kind == "later" else 0.0)
        if direct:
            # O_DIRECT reads go to the disk whatever the page cache holds; read_files drops it first only under --cache drop.
            sample["limit_s"] = {str(n): read_files(files, n, args.cache == "drop") for n in threads}
        sample["took_s"] = time.monotonic() - t
        out["samples"].append(sample)
        print(f"restore: repeat {r}: " + json.dumps({k: v for k, v in sample.items() if k != "took_s"}, default=str) + f" ({elapsed(args)})", flush=True)
    samples = out["samples"]
    med: dict[str, Any] = {
        "at_once_s": statistics.median(s["at_once"]["restore_s"] for s in samples),
        "construct_s": statistics.median(s["at_once"]["construct_s"] for s in samples),
        "construct_and_restore_s": statistics.median(s["at_once"]["construct_s"] + s["at_once"]["restore_s"] for s in samples),
        "later_s": statistics.median(s["later"]["restore_s"] for s in samples),
    }
    if direct:
        med["limit_s"] = {n: statistics.median(s["limit_s"][n] for s in samples) for n in map(str, threads)}
        med["best_limit_s"] = min(med["limit_s"].values())
        med["tier_threads_limit_s"] = med["limit_s"][str(args.io_threads)]
        med["share_at_once"] = med["best_limit_s"] / med["at_once_s"]
        med["share_later"] = med["best_limit_s"] / med["later_s"]
    out["median"] = med
    out["uncached"] = samples[-1]["at_once"]["uncached"]
    return {"restore": out}


# -- parts 2 and 3: GPUDirect Storage, DCP ------------------------------------------------------------------


def bench_gds(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    if args.device != "cuda":
        return {"gds": {"ok": False, "skipped": "needs CUDA"}}
    path = work / "gds" / "probe.bin"
    path.parent.mkdir()
    with open(path, "wb") as f:
        f.write(os.urandom(GDS_BYTES))
        f.flush()
        os.fsync(f.fileno())
    try:
        result = run_child({"kind": "gds", "device": args.device, "path": str(path)}, 60.0, path.parent, args.cache)
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
    return {"gds": result | {"uncached": result["uncached"]["how"]}}


def bench_dcp(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    directory = work / "dcp"
    state = make_state(args.size, args.device)
    synchronize(args.device)
    expected = digest(state)
    t = time.perf_counter()
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    save_s = time.perf_counter() - t
    del state
    release(args.device)
    out = run_child({"kind": "dcp", "device": args.device, "path": str(directory), "size": args.size}, args.child_timeout_s, directory, args.cache)
    if out.pop("digest") != expected:
        raise RuntimeError("DCP load gave other bytes than were saved")
    shutil.rmtree(directory, ignore_errors=True)
    return {"dcp": {"save_s": save_s, "load_s": out["restore_s"], "uncached": out["uncached"]["how"]}}


# -- part 4: correctness --------------------------------------------------------------------------------------


def cloned(value: Any) -> Any:
    """A deep copy in which every tensor is a new one (same device), every container rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cloned(v) for v in value)
    return value


def poisoned(value: Any) -> Any:
    """The structure of ``value`` with fresh tensors (``empty_like``: the same devices) full of ``POISON`` bytes."""
    if isinstance(value, torch.Tensor):
        fresh = torch.empty_like(value)
        raw(fresh).fill_(POISON)
        return fresh
    if isinstance(value, dict):
        return {k: poisoned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(poisoned(v) for v in value)
    return value


def mismatches(got: Any, want: Any) -> list[str]:
    """Where ``got`` differs from ``want``: structure, devices, dtypes, shapes, and bytes (``torch.equal`` on
    uint8 views); the paths, at most 10."""
    got_leaves, want_leaves = leaves(got), leaves(want)
    if [p for p, _ in got_leaves] != [p for p, _ in want_leaves]:
        return [f"structure: {len(got_leaves)} values at other paths than the reference's {len(want_leaves)}"]
    wrong = []
    for (path, a), (_, b) in zip(got_leaves, want_leaves):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or (a.device, a.dtype, a.shape) != (b.device, b.dtype, b.shape):
                wrong.append(f"{path}: {getattr(a, 'device', type(a))} {getattr(a, 'dtype', '')} {tuple(getattr(a, 'shape', ()))}")
            elif not torch.equal(raw(a), raw(b)):
                wrong.append(f"{path}: bytes differ")
        elif a != b:
            wrong.append(f"{path}: {a!r} != {b!r}")
    return wrong[:10] + ([f"... {len(wrong) - 10} more"] if len(wrong) > 10 else [])


def checked(name: str, reference: Any, device: str, restore: Callable[[Any], Any]) -> dict[str, Any]:
    """One restore into poisoned fresh templates, compared with the reference bit for bit."""
    template = poisoned(reference)
    synchronize(device)
    t = time.perf_counter()
    restored = restore(template)
    synchronize(device)
    seconds = time.perf_counter() - t
    wrong = mismatches(restored.state, reference)
    in_place = all(a is b for a, b in zip(tensors_of(restored.state), tensors_of(template)))
    if not in_place:
        wrong.append("the restored tensors are not the template's")
    out = {"tier": restored.tier, "step": restored.step, "seconds": seconds, "in_place": in_place, "mismatches": wrong, "pass": not wrong and restored.step == STEP}
    print(f"correctness: {name}: {'PASS' if out['pass'] else 'FAIL'} (tier {restored.tier}, {seconds:.2f} s){'' if not wrong else ': ' + '; '.join(wrong)}", flush=True)
    del template, restored
    release(device)
    return out


def bench_correctness(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    profile = TRAINING_PROFILES["quick" if args.quick else args.device]
    size = model_size(args.correctness_size, profile, batch=min(profile.batch, 16))  # the step's length does not matter here
    trainer = Trainer(size, args.device, "bf16" if args.device == "cuda" else "fp32")
    for _ in range(args.train_steps):  # the AdamW moments exist from here on
        trainer.step()
    live = trainer.state()
    nbytes, tensors = nbytes_of(live), len(tensors_of(live))
    config = tier_config(work / "correctness", nbytes, tensors, args.io_threads)
    out: dict[str, Any] = {"model": dataclasses.asdict(size) | {"parameters": sum(p.numel() for p in trainer.model.parameters())},
                           "bytes": nbytes, "tensors": tensors, "train_steps": args.train_steps, "restores": {}}  # fmt: skip
    print(f"correctness: GPT {out['model']['parameters'] / 1e6:.1f} M parameters, state {human(nbytes)} in {tensors} tensors ({elapsed(args)})", flush=True)
    box: dict[str, Any] = {}

    def checkpoint() -> None:
        """After backward, right before ``optimizer.step()``: the reference, then the save."""
        synchronize(args.device)
        box["reference"] = cloned(trainer.state())
        synchronize(args.device)
        t = time.perf_counter()
        box["handle"] = ckpt.save_sync(STEP, trainer.state())
        box["call_s"] = time.perf_counter() - t

    restores = out["restores"]
    with Checkpointer(config) as ckpt:
        ready_pool(ckpt)  # as a training job's pool is by its first save
        ckpt.attach(trainer.optimizer)
        trainer.step(checkpoint)  # optimizer.step() is queued right after save(); only the barrier orders it
        handle, reference = box["handle"], box["reference"]
        if not handle.captured_sync(WAIT_S):
            raise RuntimeError(f"step {STEP} was skipped: no free host slot")
        if not handle.committed_sync("nvme", timeout=WAIT_S):
            raise RuntimeError(f"step {STEP} was not committed to the filesystem tier")
        out["save_call_s"] = box["call_s"]
        now = leaves(trainer.state())
        out["changed_by_step"] = sum(1 for (_, a), (_, b) in zip(now, leaves(reference)) if isinstance(a, torch.Tensor) and not torch.equal(raw(a), raw(b)))
        del now
        restores["ram"] = checked("ram", reference, args.device, lambda t: ckpt.restore_sync(STEP, t, tier="ram"))
        restores["disk"] = checked("disk", reference, args.device, lambda t: ckpt.restore_sync(STEP, t, tier="nvme"))
        restores["disk, verify_first"] = checked("disk, verify_first", reference, args.device, lambda t: ckpt.restore_sync(STEP, t, tier="nvme", verify_first=True))
    del trainer, live, handle
    release(args.device)
    with Checkpointer(config) as fresh:  # its RAM tier is empty, as a restarted job's: this reads the disk
        restores["disk, new Checkpointer"] = checked("disk, new Checkpointer", reference, args.device, fresh.restore_latest_sync)
    failed = [name for name, r in restores.items() if not r["pass"]]
    if restores["disk, new Checkpointer"]["tier"] != "nvme":
        failed.append("disk, new Checkpointer (not read from the disk)")
    if out["changed_by_step"] == 0:
        failed.append("optimizer.step() changed nothing: the check proves nothing")
    out["failed"] = failed
    if failed:
        raise RestoreMismatch(out, f"bitwise check failed: {', '.join(failed)}")
    return {"correctness": out}


class RestoreMismatch(RuntimeError):
    """A correctness check that failed, with what it measured (kept in the report)."""

    def __init__(self, result: dict[str, Any], message: str) -> None:
        super().__init__(message)
        self.result = result


# -- the report ---------------------------------------------------------------------------------------------------


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}"


def header(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    gpu = f"{report['gpu']} (CUDA {report['cuda']})" if report["device"] == "cuda" else "none used"
    fs = m["disk"]
    warning = " (a tmpfs: no disk is measured)" if "tmpfs" in fs else ""
    return [
        f"### GPU restore against the disk's read limit, and a bitwise check of the lazy capture ({report['time']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}; GPU: {gpu}; Python {m['python']}, "
        f"torch {m['torch']}. Device: `{report['device']}`. Directory: {fs}{warning}, O_DIRECT: {m['o_direct']}. "
        f"Command: `{report['command']}`; raw numbers: `{report['json']}`.",
        "",
    ]


def restore_table(r: dict[str, Any]) -> list[str]:
    med, n = r["median"], r["bytes"]
    u = r["uncached"]
    resident = "unknown (no fincore)" if u.get("resident_bytes") is None else human(u["resident_bytes"])
    how = {"drop_caches": "`drop_caches`", "posix_fadvise(DONTNEED)": "`posix_fadvise(DONTNEED)` on its files"}.get(u["how"], u["how"])
    if u["how"] != "drop_caches" and r.get("cache") == "drop":
        how += " (`/proc/sys/vm/drop_caches` refused: not root, or a read-only /proc)"
    lines = [
        f"**Restore from the filesystem tier into fresh templates on `{r.get('device', '')}`, a new process each** ({human(n)}, {r['tensors']} tensors, "
        f"{r['files']} data file(s) of {human(r['file_bytes'])}; the tier's `io_threads` {r['io_threads']}; medians of {len(r['samples'])}, "
        f"alternating order). Each process imported, made its CUDA context and built its templates first; then the page cache was dropped with "
        f"{how} (resident after: {resident}) and its clock started.",
        "",
        "| measure | seconds | GB/s | share of the read limit |",
        "| --- | ---: | ---: | ---: |",
    ]
    best = med.get("best_limit_s")
    if best is not None:
        for threads, s in med["limit_s"].items():
            mark = " (the tier's)" if threads == str(r["io_threads"]) else ""
            lines.append(f"| read limit: O_DIRECT into a reused 16 MiB buffer per thread, {threads} threads{mark} | {s:.3f} | {gbps(r['file_bytes'], s)} | {100 * best / s:.0f}% |")
    else:
        lines.append("| read limit: O_DIRECT is not supported in this directory: not measured | | | |")

    def share(s: float) -> str:
        return f"{100 * best / s:.0f}%" if best is not None else ""

    lines += [
        f"| restore right after `Checkpointer()` | {med['at_once_s']:.3f} | {gbps(n, med['at_once_s'])} | {share(med['at_once_s'])} |",
        f"| `Checkpointer()` + that restore (construction {med['construct_s']:.3f} s) | {med['construct_and_restore_s']:.3f} | {gbps(n, med['construct_and_restore_s'])} | {share(med['construct_and_restore_s'])} |",
        f"| restore started {DELAY_S:g} s after `Checkpointer()` | {med['later_s']:.3f} | {gbps(n, med['later_s'])} | {share(med['later_s'])} |",
    ]
    return lines


def dcp_row(report: dict[str, Any]) -> list[str]:
    d = report.get("dcp")
    r = report.get("restore")
    if not d or not r:
        return []
    best = r["median"].get("best_limit_s")
    share = f"{100 * best / d['load_s']:.0f}%" if best is not None else ""
    versus = r["median"]["at_once_s"] / d["load_s"]
    return [f"| DCP `load` into fresh templates, a new process (save {d['save_s']:.2f} s; tierckpt's restore at once: {1 / versus:.2f}× as fast) | {d['load_s']:.3f} | {gbps(r['bytes'], d['load_s'])} | {share} |"]


def gds_line(report: dict[str, Any]) -> list[str]:
    g = report.get("gds")
    if g is None:
        return []
    if g.get("skipped"):
        return [f"GPUDirect Storage: not probed ({g['skipped']}).", ""]
    if g.get("ok"):
        return [f"GPUDirect Storage: `torch.cuda.gds.GdsFile` registered a {human(g['bytes'])} file in {g['registered_s']:.3f} s and read it into GPU memory at {g['gbps']:.2f} GB/s, bytes equal (page cache: {g['uncached']}). Not used by tierckpt.", ""]
    return [f"GPUDirect Storage: probe failed: `{g.get('error', 'bytes differ')}`. Not used by tierckpt.", ""]


def correctness_table(c: dict[str, Any], device: str) -> list[str]:
    m = c["model"]
    lines = [
        f"**Correctness of the lazy capture**: GPT ({m['layers']} layers, d_model {m['d_model']}, vocab {m['vocab']}), {m['parameters'] / 1e6:.1f} M parameters, "
        f"AdamW, on `{device}`; state {human(c['bytes'])} in {c['tensors']} tensors after {c['train_steps']} real steps. After a forward/backward: a "
        f"reference copy (cloned, synchronized), `save_sync` ({1e3 * c['save_call_s']:.1f} ms) with `attach(optimizer)` the only barrier, "
        f"`optimizer.step()` queued right after it (it changed {c['changed_by_step']} of the {c['tensors']} tensors of the live state). Each restore "
        f"into fresh templates (`empty_like`, every byte 0x{POISON:02X}), compared bit for bit with the reference:",
        "",
        "| restored from | tier read | seconds | result |",
        "| --- | --- | ---: | --- |",
    ]
    for name, r in c["restores"].items():
        verdict = "PASS" if r["pass"] else "**FAIL**: " + "; ".join(r["mismatches"])
        lines.append(f"| {name} | {r['tier']} | {r['seconds']:.3f} | {verdict} |")
    return lines + [""]


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    med = report.get("restore", {}).get("median", {})
    if "share_at_once" in med:
        share = med["share_at_once"]
        out.append({"what": "restore right after construction, new process / read limit", "value": f"{100 * share:.0f}%", "target": f"≥ {100 * TARGET_SHARE:.0f}%", "met": share >= TARGET_SHARE})
        later = med["share_later"]
        out.append({"what": f"restore {DELAY_S:g} s after construction / read limit", "value": f"{100 * later:.0f}%", "target": f"≥ {100 * TARGET_SHARE:.0f}%", "met": later >= TARGET_SHARE})
    c = report.get("correctness")
    if c:
        out.append({"what": "bitwise restores (RAM, disk, disk verify_first, disk in a new Checkpointer)", "value": "all PASS" if not c["failed"] else "FAIL: " + ", ".join(c["failed"]), "target": "all PASS", "met": not c["failed"]})
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = header(report)
    if "restore" in report:
        lines += restore_table(report["restore"]) + dcp_row(report) + [""]
        if report["restore"].get("cut"):
            lines += [f"Cut: {report['restore']['cut']}.", ""]
    elif "dcp" in report:
        lines += [f"DCP: save {report['dcp']['save_s']:.2f} s, `load` into fresh templates in a new process {report['dcp']['load_s']:.3f} s.", ""]
    lines += gds_line(report)
    if "correctness" in report:
        lines += correctness_table(report["correctness"], report["device"])
    checks = report.get("targets", [])
    if checks:
        lines += ["Targets: " + "; ".join(f"{c['what']}: {c['value']} (target {c['target']}, {'met' if c['met'] else 'NOT met'})" for c in checks) + ".", ""]
    for part, error in report.get("errors", {}).items():
        lines += [f"**{part} failed**: `{error.strip().splitlines()[-1]}`", ""]
    for part, why in report.get("skipped", {}).items():
        lines += [f"{part}: not run ({why}).", ""]
    for part, error in report.get("findings", {}).items():
        lines += [f"{part} did not run through (a finding, not a failure of this run): `{error.strip().splitlines()[-1]}`", ""]
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------------------------


def elapsed(args: argparse.Namespace) -> str:
    return f"{time.monotonic() - args.started:.0f} s"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts run (default: all)")
    parser.add_argument("--size", type=lambda s: parse_size(s, key="--size"), help="the restore's state (2GiB on cuda, 256MiB on cpu, 16MiB with --quick)")
    parser.add_argument("--correctness-size", type=lambda s: parse_size(s, key="--correctness-size"), help="the GPT's weights + AdamW moments (2GiB on cuda, 128MiB on cpu, 16MiB with --quick)")
    parser.add_argument("--repeats", type=int, help="restores of each kind and read limits (default 2; --quick 1)")
    parser.add_argument("--train-steps", type=int, help="real training steps before the checked save (default 3 on cuda, 2 on cpu)")
    parser.add_argument("--io-threads", type=int, default=2, help="the filesystem tier's io_threads (its default: 2)")
    parser.add_argument("--dir", type=Path, default=None, help="where the tier and DCP write, in a temporary directory removed after (default: $TMPDIR)")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where the JSON and markdown go")
    parser.add_argument("--name", help="their file name without the suffix (default gpu_restore-<time>)")
    parser.add_argument("--cache", choices=("drop", "fadvise"), default="drop",
                        help="how the page cache of the saved files is dropped before each read: drop (the whole cache as root, else posix_fadvise on "
                        "the files; default), fadvise (only posix_fadvise, leaving a shared machine's cache alone)")
    parser.add_argument("--budget-s", type=float, help="start no restore repeat that would end, and no part, later than this many seconds after the start")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: the code paths in seconds")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.started = time.monotonic()
    if args.child:
        return args
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available to this torch")
    profile = PROFILES["quick" if args.quick else args.device]
    args.size = args.size or profile.size_bytes
    args.correctness_size = args.correctness_size or profile.correctness_bytes
    args.repeats = args.repeats or profile.repeats
    args.train_steps = args.train_steps or profile.train_steps
    if args.repeats < 1 or args.train_steps < 1 or args.io_threads < 1:
        parser.error("--repeats, --train-steps and --io-threads must be at least 1")
    args.child_timeout_s = profile.child_timeout_s
    args.deadline = None if args.budget_s is None else args.started + args.budget_s
    return args


def main() -> int:
    args = parse_args()
    # DCP says once per call that it runs in a single process: it does, on purpose (no_dist=True).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierckpt-gpu-restore-", dir=args.dir))
    name = args.name or f"gpu_restore-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path, md_path = args.out / f"{name}.json", args.out / f"{name}.md"
    report: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python", *sys.argv]), "json": json_path.name,
        "machine": machine(work), "device": args.device, "quick": args.quick, "parts": args.parts,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "cuda": torch.version.cuda,
    }  # fmt: skip

    def save() -> None:
        report["targets"] = targets(report)
        json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        md_path.write_text(markdown(report) + "\n")

    benches = {"restore": bench_restore, "gds": bench_gds, "dcp": bench_dcp, "correctness": bench_correctness}
    try:
        for part in PARTS:
            if part not in args.parts:
                continue
            if args.deadline is not None and time.monotonic() > args.deadline:
                report.setdefault("skipped", {})[part] = f"--budget-s {args.budget_s:g} spent before it could start"
                continue
            print(f"-- {part} ({elapsed(args)})", flush=True)
            try:
                report.update(benches[part](args, work))
                if part == "restore":
                    report["restore"] |= {"device": args.device, "cache": args.cache}
            except Exception as exc:
                if isinstance(exc, RestoreMismatch):
                    report["correctness"] = exc.result
                report.setdefault("findings" if part in FINDINGS else "errors", {})[part] = traceback.format_exc()
                traceback.print_exc()
            release(args.device)
            save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save()
    print("\n" + md_path.read_text() + f"results: {json_path}, {md_path} ({elapsed(args)})", flush=True)
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
