"""The object tier against a real S3 server: SeaweedFS's ``weed mini`` on 127.0.0.1 (conftest's ``s3``).

Faults a server cannot produce on demand (503 storms, a request stalled at an exact point) come from
:class:`tierckpt.testing.s3proxy.S3Proxy`, a real proxy between the client and the server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import obstore
import pytest
import torch
from obstore.store import S3Store

from tierckpt import Checkpointer
from tierckpt.errors import ConfigError, CorruptCheckpointError, FlushError
from tierckpt.testing import failures, launch_ranks
from tierckpt.testing.s3proxy import S3Proxy
from tierckpt.storage.s3uploads import Signer, list_uploads
from tierckpt.testing.s3server import ACCESS_KEY, SECRET_KEY, start_s3

from helpers import SHUFFLED_ZSTD, held, logged_warnings, tier_config

WORKER = Path(__file__).with_name("object_worker.py")
RESHARD = Path(__file__).with_name("reshard_worker.py")
FAST_FAIL = {"retries": 1, "timeout": "5s"}


def config(s3: Any, *, endpoint: str | None = None, prefix: str | None = None, **tier: Any) -> dict[str, Any]:
    section = s3.tier("s3", prefix=prefix or s3.prefix, **tier)
    if endpoint is not None:
        section["endpoint"] = endpoint
    return tier_config(section, capacity="96MiB", snapshots=2)


def client(s3: Any) -> S3Store:
    return s3.client()


def listing(s3: Any, prefix: str) -> dict[str, int]:
    """Every object under ``prefix``, relative to it: name -> size."""
    return {m["path"][len(prefix) + 1:]: m["size"] for batch in obstore.list(client(s3), prefix + "/") for m in batch}


def state(step: int, big: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    # big: a value of more than one stored chunk (16 MiB), so a data object holds several parts.
    w = torch.randn(2100 * (2100 if big else 100), generator=g).reshape(2100, -1)
    return {"model": {"w": w, "b": torch.arange(step, step + 7)}, "step": step, "note": f"step {step}"}


def template() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(2100, 100), "b": torch.zeros(7, dtype=torch.long)}, "step": 0, "note": ""}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in ("w", "b")) and (a["step"], a["note"]) == (b["step"], b["note"])


@pytest.mark.parametrize("compression", [None, SHUFFLED_ZSTD], ids=["raw", "zstd"])
def test_round_trip_commits_the_manifest_last_and_restores_bitwise_in_a_new_checkpointer(s3: Any, compression: Any) -> None:
    tier = {"compression": compression} if compression else {}
    with Checkpointer(config(s3, **tier)) as ckpt:
        for step in (1, 2, 3):
            assert ckpt.save_sync(step, state(step, big=True)).committed_sync("s3", timeout=120)
        assert held(ckpt, "s3") == [1, 2, 3]
    names = sorted(listing(s3, s3.prefix))
    # Per version: its commit object and one data object with a write id; nothing else but nothing.
    assert [n for n in names if n.startswith("step-000000000003/")][-1] == "step-000000000003/manifest.msgpack"
    data = [n for n in names if n.startswith("step-000000000003/data-r00000.")]
    assert len(data) == 1 and data[0].endswith(".bin")
    raw_bytes = 2100 * 2100 * 4
    stored = listing(s3, s3.prefix)[data[0]]
    assert (stored < raw_bytes * 0.95) if compression else (stored >= raw_bytes)
    assert ".writer-lease" not in names  # given back at close
    with Checkpointer(config(s3, **tier)) as ckpt:
        assert held(ckpt, "s3") == [1, 2, 3]
        restored = ckpt.restore_latest_sync(None)
        assert (restored.step, restored.tier) == (3, "s3")
        want = state(3, big=True)
        assert torch.equal(restored.state["model"]["w"], want["model"]["w"]) and restored.state["note"] == "step 3"


def test_ram_nvme_and_s3_the_cloud_three_tier_setup_restores_from_the_bucket_when_the_local_disk_is_gone(tmp_path: Path, s3: Any) -> None:
    cfg = tier_config(
        {"name": "nvme", "type": "filesystem", "path": str(tmp_path / "nvme"), "keep": {"last": 2}},
        s3.tier("s3", prefix=s3.prefix, flush={"every_steps": 2}, keep={"last": 2}, compression=SHUFFLED_ZSTD),
        capacity="96MiB",
    )
    with Checkpointer(cfg) as ckpt:
        for step in (1, 2, 3, 4, 5):
            ckpt.save_sync(step, state(step)).committed_sync("nvme", timeout=60)
        ckpt.wait_sync()
        assert held(ckpt, "nvme") == [4, 5] and held(ckpt, "s3") == [2, 4]
    shutil.rmtree(tmp_path / "nvme")  # the node is replaced: its local disk is empty
    with Checkpointer(cfg) as ckpt:
        restored = ckpt.restore_latest_sync(template())
        assert (restored.step, restored.tier) == (4, "s3") and same(restored.state, state(4))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_a_damaged_or_missing_object_is_detected_and_restore_falls_back(s3: Any, damage: str) -> None:
    with Checkpointer(config(s3)) as ckpt:
        for step in (1, 2):
            assert ckpt.save_sync(step, state(step)).committed_sync("s3", timeout=60)
    store = client(s3)
    names = listing(s3, s3.prefix)
    data = f"{s3.prefix}/" + next(n for n in names if n.startswith("step-000000000002/data-"))
    if damage == "manifest":
        obstore.delete(store, f"{s3.prefix}/step-000000000002/manifest.msgpack")
    elif damage == "delete":
        obstore.delete(store, data)
    else:
        body = bytearray(obstore.get(store, data).bytes())
        if damage == "flip":
            body[len(body) // 2] ^= 0x10
        else:
            del body[len(body) // 2:]
        obstore.put(store, data, bytes(body))
    with Checkpointer(config(s3)) as ckpt:
        if damage == "manifest":  # a version without its commit object is not a version at all
            assert held(ckpt, "s3") == [1]
            restored = ckpt.restore_latest_sync(template())
        else:
            said = {"flip": "checksum mismatch", "truncate": "ends before|bytes", "delete": "data object data-r00000.* is missing"}[damage]
            with logged_warnings(match=rf"step 2 on tier 's3' does not verify.*({said})"):
                restored = ckpt.restore_latest_sync(template())
        assert restored.step == 1 and same(restored.state, state(1))
    if damage == "manifest":  # and what it left was swept when the tier opened
        assert not [n for n in listing(s3, s3.prefix) if n.startswith("step-000000000002/")]


def test_retention_deletes_the_commit_object_first_and_leaves_no_objects_behind(s3: Any) -> None:
    with Checkpointer(config(s3, keep={"last": 2})) as ckpt:
        for step in (1, 2, 3, 4):
            assert ckpt.save_sync(step, state(step)).committed_sync("s3", timeout=60)
        ckpt.wait_sync()
    assert {n.split("/")[0] for n in listing(s3, s3.prefix)} == {"step-000000000003", "step-000000000004"}


def test_saving_a_step_again_replaces_it_and_removes_the_older_write(s3: Any) -> None:
    with Checkpointer(config(s3)) as ckpt:
        assert ckpt.save_sync(5, state(5)).committed_sync("s3", timeout=60)
    with Checkpointer(config(s3)) as ckpt:
        again = state(6) | {"step": 5}
        assert ckpt.save_sync(5, again).committed_sync("s3", timeout=60)
    names = [n for n in listing(s3, s3.prefix) if n.startswith("step-000000000005/data-")]
    assert len(names) == 1  # the first write's data object went once the second committed
    with Checkpointer(config(s3)) as ckpt:
        restored = ckpt.restore_latest_sync(template())
        assert restored.step == 5 and torch.equal(restored.state["model"]["w"], again["model"]["w"])


def test_a_second_checkpointer_on_the_prefix_is_refused_until_the_first_closes(s3: Any) -> None:
    first = Checkpointer(config(s3))
    try:
        with pytest.raises(ConfigError, match=rf"in use by another Checkpointer \(pid {os.getpid()} on"):
            Checkpointer(config(s3))
    finally:
        first.close_sync()
    Checkpointer(config(s3)).close_sync()


def test_bad_bucket_credentials_or_endpoint_are_config_errors_naming_tier_url_and_cause(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"tier 's3'.*s3://no-such-bucket/x.*HTTP 404.*NoSuchBucket"):
        Checkpointer(tier_config(s3.tier("s3", prefix="x", **FAST_FAIL) | {"url": "s3://no-such-bucket/x"}))
    with pytest.raises(ConfigError, match=r"no answer"):
        Checkpointer(config(s3, endpoint="http://127.0.0.1:9", **FAST_FAIL))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ConfigError, match=r"tier 's3'.*HTTP 403.*SignatureDoesNotMatch"):
        Checkpointer(config(s3, **FAST_FAIL))


def test_a_503_storm_within_the_retry_bound_still_commits(s3: Any) -> None:
    proxy = S3Proxy(s3.endpoint)
    try:
        proxy.fail("PUT", "/step-", status=503, code="SlowDown", times=4)
        with Checkpointer(config(s3, endpoint=proxy.endpoint)) as ckpt:
            assert ckpt.save_sync(1, state(1)).committed_sync("s3", timeout=60)
        assert proxy.failed["PUT"] == 4
    finally:
        proxy.close()
    with Checkpointer(config(s3)) as ckpt:
        assert same(ckpt.restore_latest_sync(template()).state, state(1))


def test_throttling_past_the_bound_is_a_flush_error_and_the_last_good_version_stays(s3: Any) -> None:
    proxy = S3Proxy(s3.endpoint)
    try:
        with Checkpointer(config(s3, endpoint=proxy.endpoint, keep={"last": 1}, **FAST_FAIL)) as ckpt:
            assert ckpt.save_sync(1, state(1)).committed_sync("s3", timeout=60)
            proxy.fail("PUT", "/step-000000000002/", status=503, code="SlowDown")
            with pytest.raises(FlushError, match=r"tier 's3'.*step 2.*HTTP 503.*SlowDown.*step-000000000002/data-r00000"):
                ckpt.save_sync(2, state(2)).committed_sync("s3", timeout=60)
            assert held(ckpt, "s3") == [1]  # the failed flush took nothing away: step 1 is the last good one
            proxy.clear()
            assert ckpt.save_sync(3, state(3)).committed_sync("s3", timeout=60)  # training went on; this one commits
            ckpt.wait_sync()
            assert held(ckpt, "s3") == [3]
    finally:
        proxy.close()
    with Checkpointer(config(s3)) as ckpt:
        assert same(ckpt.restore_latest_sync(template()).state, state(3))


def test_a_commit_whose_answers_are_all_lost_is_found_stored_and_counts_as_committed(s3: Any) -> None:
    proxy = S3Proxy(s3.endpoint)
    try:
        with Checkpointer(config(s3, endpoint=proxy.endpoint, **FAST_FAIL)) as ckpt:
            proxy.lose("PUT", "/step-000000000001/manifest.msgpack")  # stored, every answer lost
            assert ckpt.save_sync(1, state(1)).committed_sync("s3", timeout=60)
            assert proxy.failed["PUT"] == 2  # the request and its one retry
            proxy.clear()
    finally:
        proxy.close()
    with Checkpointer(config(s3)) as ckpt:
        assert same(ckpt.restore_latest_sync(template()).state, state(1))


@pytest.mark.slow
def test_the_server_stopped_mid_upload_fails_the_flush_and_the_next_flush_after_a_restart_commits(tmp_path: Path, s3: Any) -> None:
    server = start_s3(tmp_path / "own")
    proxy = S3Proxy(server.endpoint)
    tier = {**FAST_FAIL}
    try:
        cfg = tier_config(server.tier("s3", prefix="p", **tier) | {"endpoint": proxy.endpoint}, capacity="96MiB")
        with Checkpointer(cfg) as ckpt:
            assert ckpt.save_sync(1, state(1)).committed_sync("s3", timeout=60)
            held_upload = proxy.hold("PUT", "/step-000000000002/data-r00000")
            handle = ckpt.save_sync(2, state(2))
            assert held_upload.reached.wait(60)
            server.stop()  # mid-upload: the held request goes on to a server that is gone
            held_upload.release()
            with pytest.raises(FlushError, match=r"tier 's3'.*step 2"):
                handle.committed_sync("s3", timeout=60)
            proxy.clear()
            server.start()
            assert ckpt.save_sync(3, state(3)).committed_sync("s3", timeout=60)
            assert held(ckpt, "s3") == [1, 3]
    finally:
        proxy.close()
        server.stop()


def kill_writer_at(tmp_path: Path, s3: Any, method: str, where: str) -> None:
    """Run tests/object_worker.py saving steps 1 and 2 through a proxy; SIGKILL it once a request to
    ``where`` arrives (held there, then dropped: it never reaches the server)."""
    proxy = S3Proxy(s3.endpoint)
    try:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config(s3, endpoint=proxy.endpoint, part_size="5MiB", concurrency=2)))
        stall = proxy.hold(method, where)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), *sys.path])}
        log = tmp_path / "worker.log"
        with open(log, "wb") as out:
            child = subprocess.Popen([sys.executable, str(WORKER), str(path), "1,2"], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            assert stall.reached.wait(120), log.read_text()
            child.send_signal(signal.SIGKILL)
        finally:
            child.wait()
        stall.drop()
    finally:
        proxy.close()


def test_a_writer_killed_before_its_commit_object_leaves_nothing_committed_and_is_swept(tmp_path: Path, s3: Any) -> None:
    kill_writer_at(tmp_path, s3, "PUT", "/step-000000000002/manifest.msgpack")  # its data object complete
    before = listing(s3, s3.prefix)
    assert any(n.startswith("step-000000000002/data-") for n in before) and "step-000000000002/manifest.msgpack" not in before
    with Checkpointer(config(s3)) as ckpt:  # the dead writer's lease is taken over: its pid is gone
        assert held(ckpt, "s3") == [1]
        assert ckpt.restore_latest_sync(None).state["step"] == 1
    assert not [n for n in listing(s3, s3.prefix) if n.startswith("step-000000000002/")]


def reshard_run(tmp_path: Path, s3: Any, world: int, mode: str, mesh: str, place: str = "S0", **more: str) -> list[dict[str, Any]]:
    """Run ``world`` ranks of tests/reshard_worker.py with an object tier in place of its disk tier."""
    env = {"S3_TIER": json.dumps(s3.tier("disk", prefix=s3.prefix, **json.loads(more.pop("TIER", "{}")))), **s3.env()}
    exits = launch_ranks([sys.executable, str(RESHARD), mode, str(tmp_path)], world, env={"MESH": mesh, "PLACE": place, **env, **more})
    failed = failures(exits)
    assert not failed, failed
    return [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in range(max(world, 1))]


@pytest.mark.slow
def test_two_ranks_save_their_parts_and_one_process_and_two_ranks_reshard_reading_only_what_overlaps(tmp_path: Path, s3: Any) -> None:
    assert [r["committed"] for r in reshard_run(tmp_path, s3, 2, "save", "2")] == [True, True]
    names = listing(s3, s3.prefix)
    assert {n.split("/")[1].split(".")[0] for n in names} == {"manifest", "data-r00000", "data-r00001", "manifest-r00000", "manifest-r00001"}
    (alone,) = reshard_run(tmp_path, s3, 1, "restore", "none", TEMPLATE="plain")
    assert all(alone[k] for k in ("w", "emb", "big", "norm")) and alone["tier"] == "disk"
    halves = reshard_run(tmp_path, s3, 2, "restore", "2", "S1")
    assert all(r[k] for r in halves for k in ("w", "emb", "big", "norm"))
    same_dim = reshard_run(tmp_path, s3, 2, "restore", "2", "S0")
    row = 2100 * 4
    # Rank r restores rows it saved: the ranged GETs fetch only those chunks (one saved piece each).
    assert [r["read_bytes"]["['model']['big']"] for r in same_dim] == [1025 * row, 1025 * row]


@pytest.mark.slow
def test_replicated_values_are_stored_once_across_ranks_and_a_damaged_part_makes_every_rank_fall_back(tmp_path: Path, s3: Any) -> None:
    from test_distributed import MODEL_BYTES
    from test_distributed import run_ranks as dist_ranks

    env = {"S3_TIER": json.dumps(s3.tier("disk", prefix=s3.prefix)), **s3.env()}
    saved = dist_ranks(2, "save", tmp_path, {"STEPS": "1,2,3", "REPLICATED": "1", **env})
    assert [r["committed"] for r in saved] == [[True, True, True]] * 2
    names = listing(s3, s3.prefix)
    data = {n: size for n, size in names.items() if n.startswith("step-000000000003/data-")}
    assert len(data) == 2 and sum(data.values()) < MODEL_BYTES + 3 * 4096 + 2 * 5000  # the model once, split
    assert all(size < MODEL_BYTES * 0.75 for size in data.values())
    restored = dist_ranks(2, "restore", tmp_path, env)
    assert [r["step"] for r in restored] == [3, 3] and all(r["bitwise"] for r in restored), restored
    key = f"{s3.prefix}/" + next(n for n in data if ".r00001." in n or "data-r00001." in n)
    body = bytearray(obstore.get(client(s3), key).bytes())
    body[100] ^= 0xFF
    obstore.put(client(s3), key, bytes(body))
    restored = dist_ranks(2, "restore", tmp_path, env)
    assert [r["step"] for r in restored] == [2, 2] and all(r["bitwise"] for r in restored)
    assert all(len(r["warnings"]) == 1 and "data-r00001." in r["warnings"][0] for r in restored), restored


@pytest.mark.slow
def test_four_ranks_save_compressed_and_two_ranks_restore_the_other_dimension(tmp_path: Path, s3: Any) -> None:
    tier = json.dumps({"compression": SHUFFLED_ZSTD})
    assert [r["committed"] for r in reshard_run(tmp_path, s3, 4, "save", "4", "S0", TIER=tier)] == [True] * 4
    two = reshard_run(tmp_path, s3, 2, "restore", "2", "S1", TIER=tier)
    assert all(r[k] for r in two for k in ("w", "emb", "big", "norm")), two
    assert [r["rank_value"] for r in two] == [0, 1]


def test_a_writer_killed_mid_upload_leaves_an_incomplete_upload_that_the_next_open_aborts(tmp_path: Path, s3: Any) -> None:
    signer = Signer.of(s3.endpoint, "us-east-1", {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY})
    assert signer is not None
    kill_writer_at(tmp_path, s3, "PUT", "/step-000000000002/data-r00000")  # a part of its data object
    # The second part's request was dropped with the writer: the upload stays incomplete, invisible.
    (upload,) = list_uploads(signer, s3.bucket, f"{s3.prefix}/")
    assert "/step-000000000002/data-r00000." in upload.key
    assert not [n for n in listing(s3, s3.prefix) if n.startswith("step-000000000002/")]
    with Checkpointer(config(s3)) as ckpt:
        assert held(ckpt, "s3") == [1]
    assert list_uploads(signer, s3.bucket, f"{s3.prefix}/") == []


def test_the_command_line_lists_verifies_and_exports_versions_in_a_bucket(tmp_path: Path, s3: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    from tierckpt.cli import main

    with Checkpointer(config(s3)) as ckpt:
        for step in (1, 2):
            assert ckpt.save_sync(step, state(step)).committed_sync("s3", timeout=60)
    url = f"s3://{s3.bucket}/{s3.prefix}"
    assert main(["ls", url, "--endpoint", s3.endpoint]) == 0
    out = capsys.readouterr().out
    assert "step-000000000001" in out and "step-000000000002" in out and out.count("yes") == 2
    assert main(["export", f"{url}/step-000000000002", str(tmp_path / "m.safetensors"), "--endpoint", s3.endpoint]) == 0
    exported = load_file(tmp_path / "m.safetensors")
    assert torch.equal(exported["model.w"], state(2)["model"]["w"])
    assert main(["export", url, str(tmp_path / "n.safetensors"), "--endpoint", s3.endpoint]) == 2
    assert "is a tier prefix; name one of its versions" in capsys.readouterr().err
    data = f"{s3.prefix}/" + next(n for n in listing(s3, s3.prefix) if n.startswith("step-000000000002/data-"))
    body = bytearray(obstore.get(client(s3), data).bytes())
    body[100] ^= 1
    obstore.put(client(s3), data, bytes(body))
    assert main(["verify", url, "--endpoint", s3.endpoint]) == 1
    out = capsys.readouterr().out
    assert "step-000000000001  OK" in out and "step-000000000002  DAMAGED" in out and "checksum mismatch" in out
    # verify's mark, at the prefix's root (never inside the version's container): the tier reads it at open.
    assert ".damaged-step-000000000002" in listing(s3, s3.prefix)
    assert main(["ls", url, "--endpoint", s3.endpoint]) == 1 and "DAMAGED (tierckpt verify" in capsys.readouterr().out
    with Checkpointer(config(s3)) as ckpt:
        assert [(v.step, v.damaged is not None) for v in ckpt.versions() if v.tier == "s3"] == [(1, False), (2, True)]
        restored = ckpt.restore_latest_sync(template())
        assert restored.step == 1
    body[100] ^= 1  # as saved again: verify takes its mark back
    obstore.put(client(s3), data, bytes(body))
    assert main(["verify", url, "--endpoint", s3.endpoint]) == 0
    assert ".damaged-step-000000000002" not in listing(s3, s3.prefix)
    capsys.readouterr()
    assert main(["ls", f"s3://{s3.bucket}/nothing-here", "--endpoint", s3.endpoint]) == 0
    assert "no versions" in capsys.readouterr().out


def test_many_small_tensors_are_restored_with_few_ranged_gets_and_each_is_still_verified(s3: Any) -> None:
    def small_state(step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(step)
        return {"norms": {f"n{i}": torch.randn(300, generator=g) for i in range(60)}, "w": torch.randn(1024, 1024, generator=g)}

    with Checkpointer(config(s3)) as ckpt:
        for step in (1, 2):
            assert ckpt.save_sync(step, small_state(step)).committed_sync("s3", timeout=60)
    proxy = S3Proxy(s3.endpoint)
    try:
        with Checkpointer(config(s3, endpoint=proxy.endpoint)) as ckpt:
            before = proxy.seen["GET"]
            restored = ckpt.restore_latest_sync(None)
            gets = proxy.seen["GET"] - before
        assert restored.step == 2
        want = small_state(2)
        assert all(torch.equal(restored.state["norms"][k], v) for k, v in want["norms"].items())
        assert torch.equal(restored.state["w"], want["w"])
        # The 60 small tensors lie next to each other: one GET for them, one for "w", and the listing
        # and the manifest; not one GET per tensor.
        assert gets <= 6, gets
    finally:
        proxy.close()
    # A flipped byte in one small tensor of a group still fails that tensor's checksum.
    data = f"{s3.prefix}/" + next(n for n in listing(s3, s3.prefix) if n.startswith("step-000000000002/data-"))
    body = bytearray(obstore.get(client(s3), data).bytes())
    body[200] ^= 0x01  # inside the first 4 KiB: a small tensor, packed before "w" or after it
    body[-200] ^= 0x01
    obstore.put(client(s3), data, bytes(body))
    with Checkpointer(config(s3)) as ckpt, logged_warnings(match=r"step 2 on tier 's3' does not verify.*checksum mismatch"):
        assert ckpt.restore_latest_sync(None).step == 1


def test_a_chunk_read_across_two_windows_is_verified_whole_before_a_byte_of_it_lands_in_the_template(s3: Any) -> None:
    quarter = (6 << 20) // 4  # three 6 MiB tensors: whichever comes third crosses the 16 MiB window edge
    g = torch.Generator().manual_seed(0)
    saved = {k: torch.randn(quarter, generator=g) for k in "abc"}
    with Checkpointer(config(s3)) as ckpt:
        assert ckpt.save_sync(1, saved).committed_sync("s3", timeout=60)
    data = f"{s3.prefix}/" + next(n for n in listing(s3, s3.prefix) if n.startswith("step-000000000001/data-"))
    body = bytearray(obstore.get(client(s3), data).bytes())
    assert len(body) > 16 << 20
    where = {k: body.find(saved[k].numpy().tobytes()[:4096]) for k in "abc"}
    crossing = next(k for k, at in where.items() if at < 16 << 20 < (17 << 20) + 5 < at + (6 << 20))
    body[(17 << 20) + 5] ^= 0x01  # in the second window: the crossing tensor's second piece
    obstore.put(client(s3), data, bytes(body))
    template = {k: torch.zeros(quarter) for k in "abc"}
    with Checkpointer(config(s3)) as ckpt, logged_warnings(match=rf"checksum mismatch in \['{crossing}'\]"):
        with pytest.raises(CorruptCheckpointError, match="no version verifies"):
            ckpt.restore_latest_sync(template)
    # The other two verified and landed; of the damaged one, not a byte did.
    assert not template[crossing].any()
    assert all(torch.equal(template[k], saved[k]) for k in "abc" if k != crossing)

