"""The RAM tier that outlives its process: restore after a SIGKILL from /dev/shm, against the disk.

A child saves a model-like state (~200 fp32 and bf16 tensors) through ram (``path:`` on /dev/shm) and
nvme (this disk), waits until both committed it, and kills itself with SIGKILL. Then a new process
restores it from ram (verifying every chunk), and another, whose config has no RAM path, from the
disk with a cold page cache; both into new tensors, both checked bitwise. The O_DIRECT read limit of
the disk is measured in the same repeat. Results: a JSON file and a section appended to RESULTS.md.

    .venv/bin/python benchmarks/ram_tier.py --gib 1 --repeats 3 --dir /tmp/tierckpt-bench
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import common
from machine_limits import drop_caches, fault_in, limits, machine
from save_restore import digest, make_state, spec_of, state_bytes, template_from, tensors
from tierckpt import Checkpointer


def config(shm: Path | None, disk: Path, nbytes: int) -> dict[str, Any]:
    ram = common.ram_tier(keep={"last": 1}, **({} if shm is None else {"path": str(shm)}))
    return common.tier_config(common.disk_tier(disk, "nvme", keep={"last": 1}), capacity=nbytes + (64 << 20), snapshots=1, ram=ram)


def child(job: dict[str, Any]) -> None:
    shm = Path(job["shm"]) if job["shm"] else None
    disk, nbytes = Path(job["disk"]), job["nbytes"]
    if job["kind"] == "save":
        state = make_state(job["gib_bytes"])
        ckpt = Checkpointer(config(shm, disk, nbytes))
        for step in (1, 2):  # the first save warms code paths; the second is the one reported
            t = time.perf_counter()
            handle = ckpt.save_sync(step, state)
            handle.captured_sync()
            captured = time.perf_counter() - t
            assert handle.committed_sync("ram")
            ram = time.perf_counter() - t
            assert handle.committed_sync("nvme")
            nvme = time.perf_counter() - t
        out = {"captured_s": captured, "ram_committed_s": ram, "nvme_committed_s": nvme, "digest": digest(state)}
        print(json.dumps(out), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    template = template_from(job["spec"]) if job["template"] else None
    ckpt = Checkpointer(config(shm, disk, nbytes))
    fault_in(nbytes)  # as save_restore.py: no loader pays for memory the machine has not backed yet
    if job["cold"]:
        drop_caches()
    t = time.perf_counter()
    restored = ckpt.restore_latest_sync(template)
    seconds = time.perf_counter() - t
    assert restored is not None
    assert template is None or restored.state["model"]["norm.weight"] is template["model"]["norm.weight"]
    print(json.dumps({"seconds": seconds, "tier": restored.tier, "digest": digest(restored.state)}))
    ckpt.close_sync()


def run(job: dict[str, Any], *, killed: bool = False) -> dict[str, Any]:
    result = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True, text=True)
    if result.returncode != (-signal.SIGKILL if killed else 0):
        raise RuntimeError(f"{job['kind']} failed ({result.returncode}):\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tierckpt-bench"), help="a directory on the disk")
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    disk_root = args.dir / "ram-tier"
    shm = Path("/dev/shm") / f"tierckpt-bench-{uuid.uuid4().hex[:8]}"
    state = make_state(int(args.gib * 2**30))
    nbytes, count, spec = state_bytes(state), len(tensors(state)), spec_of(state)
    del state
    cold = drop_caches()
    samples = []
    try:
        for r in range(args.repeats):
            shutil.rmtree(disk_root, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
            disk_root.mkdir(parents=True)
            sample = {k: v for k, v in limits(disk_root, nbytes, 2, cold).items() if k in ("memcpy_s", "read_s")}
            job = {"shm": str(shm), "disk": str(disk_root / "nvme"), "nbytes": nbytes, "gib_bytes": int(args.gib * 2**30), "cold": cold, "spec": spec, "template": False}
            saved = run({**job, "kind": "save"}, killed=True)
            expected = saved.pop("digest")  # the state holds the saving process's RNG state
            sample.update(saved)
            for name, shm_path in (("ram", str(shm)), ("disk", None)):
                for into in ("", "_template"):
                    out = run({**job, "kind": "load", "shm": shm_path, "template": bool(into)})
                    if out["digest"] != expected or out["tier"] != ("ram" if shm_path else "nvme"):
                        raise RuntimeError(f"restore from {name} returned {out['tier']} / other bytes")
                    sample[f"restore_{name}{into}_s"] = out["seconds"]
            samples.append(sample)
            print(f"repeat {r}: " + ", ".join(f"{k}={v:.3f}" for k, v in sample.items()), flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk_root, ignore_errors=True)
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    stamp = time.strftime("%Y-%m-%d %H:%M")
    report = {"time": stamp, "machine": machine(args.dir), "bytes": nbytes, "tensors": count, "cold_cache": cold, "median": med, "samples": samples}
    json_path = Path(__file__).with_name("results") / f"ram_tier-{time.strftime('%Y%m%d-%H%M%S')}.json"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    gb, m = nbytes / 1e9, report["machine"]
    rows = [
        ("memcpy into a reused buffer (limit)", "memcpy_s", ""),
        ("O_DIRECT read of the disk (limit)", "read_s", ""),
        ("captured (host copy into the /dev/shm pool)", "captured_s", f"{med['memcpy_s'] / med['captured_s']:.0%} of memcpy"),
        ("committed on ram (+ chunk checksums, manifest)", "ram_committed_s", ""),
        ("committed on nvme", "nvme_committed_s", ""),
        ("restore after SIGKILL from ram, new tensors", "restore_ram_s", f"{med['restore_disk_s'] / med['restore_ram_s']:.1f}× faster than from the disk"),
        ("restore after SIGKILL from the disk (cold cache), new tensors", "restore_disk_s", f"{med['read_s'] / med['restore_disk_s']:.0%} of the O_DIRECT read limit"),
        ("restore after SIGKILL from ram, into a template", "restore_ram_template_s", f"{med['restore_disk_template_s'] / med['restore_ram_template_s']:.1f}× faster than from the disk"),
        ("restore after SIGKILL from the disk (cold cache), into a template", "restore_disk_template_s", f"{med['read_s'] / med['restore_disk_template_s']:.0%} of the O_DIRECT read limit"),
    ]
    lines = [
        f"### RAM tier on /dev/shm: restore after SIGKILL ({stamp})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}; disk: {m['disk']}; "
        f"torch {m['torch']}. State: {nbytes / 2**30:.2f} GiB, {count} tensors (fp32 and bf16); medians of {args.repeats}. "
        f"Page cache dropped before the disk restore: {cold}. Command: `python benchmarks/ram_tier.py --gib {args.gib:g} "
        f"--repeats {args.repeats}`; raw numbers: `{json_path.name}`.",
        "",
        "| measure | seconds | GB/s | note |",
        "| --- | ---: | ---: | --- |",
        *(f"| {label} | {med[key]:.3f} | {gb / med[key]:.2f} | {note} |" for label, key, note in rows),
        "",
        "Each restore runs in a new process after the saving one was killed with SIGKILL (template built, "
        "Checkpointer made and a state-sized buffer of new memory faulted in before the clock), and is checked "
        "bitwise against the saved state. From ram every chunk is verified against its xxh3 checksum once, then "
        "copied out of the pool file; from the disk it is read with O_DIRECT and verified as it arrives. New "
        "tensors are new memory, faulted in as they are filled, which bounds both restores on this VM.",
        "",
    ]
    with open(args.results, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
