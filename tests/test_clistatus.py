"""``tierckpt status CONFIG|DIR [--verify]``: one line per tier of a config or a folder, read from real
versions a real Checkpointer saved, through the console script as a shell runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, Config
from tierckpt.cli import main
from tierckpt.cliversions import format_size
from tierckpt.format import DATA_FILE, MANIFEST_FILE, Manifest, version_dirname
from tierckpt.ranks.nodes import node_identity
from tierckpt.testing import flip_bits

from helpers import SHUFFLED_ZSTD, fs_tier, memory_tier, tier_config, tierckpt_cli
from test_cli import rolled_back

DATA = DATA_FILE.format(rank=0)
HEADER = ["TIER", "TYPE", "VERSIONS", "NEWEST", "STORED", "WHERE"]


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(200, 201, generator=g), "h": torch.ones(20_000, dtype=torch.bfloat16), "step": step}


def _config(root: Path) -> dict[str, Any]:
    """nvme keeps the newest 2; pfs (compressed) takes even steps; local is a node-local tier."""
    return tier_config(
        fs_tier("nvme", root / "nvme", keep={"last": 2}),
        fs_tier("pfs", root / "pfs", flush={"every_steps": 2}, compression=SHUFFLED_ZSTD),
        fs_tier("local", root / "local-{node}", scope="node"),
    )


def _save(ckpt: Checkpointer, steps: range) -> None:
    for step in steps:
        handle = ckpt.save_sync(step, _state(step))
        for tier in ("nvme", "local") + (("pfs",) if step % 2 == 0 else ()):
            assert handle.committed_sync(tier, timeout=60), (tier, step)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Steps 1..3 saved: nvme holds 2 and 3, pfs holds 2, this node's local-<node> holds 1, 2, 3."""
    with Checkpointer(_config(tmp_path)) as ckpt:
        _save(ckpt, range(1, 4))
    return tmp_path


def _stored(directory: Path) -> str:
    """What the STORED column should say: the manifests' stored bytes, summed."""
    return format_size(sum(Manifest.decode((v / MANIFEST_FILE).read_bytes()).stored_bytes for v in directory.glob("step-*")))


def _table(out: str) -> list[list[str]]:
    """The table's rows split on runs of two spaces or more (WHERE may hold single spaces)."""
    import re

    return [re.split(r"\s{2,}", line.rstrip()) for line in out.splitlines()]




def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_status_of_a_folder_of_tiers_has_a_line_per_tier_directory(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "ssd").mkdir()  # a tier no save has reached yet
    done = tierckpt_cli("status", str(root))
    assert done.returncode == 0, done.stderr
    local = f"local-{node_identity()}"
    assert _table(done.stdout) == [
        HEADER,
        [local, "filesystem", "3", "3", _stored(root / local), str(root / local)],
        ["nvme", "filesystem", "2", "3", _stored(root / "nvme"), str(root / "nvme")],
        ["pfs", "filesystem", "1", "2", _stored(root / "pfs"), str(root / "pfs")],
        ["ssd", "filesystem", "0", "-", "0 B", str(root / "ssd")],
    ]
    # One tier directory, and one version directory: a line for their tier.
    status, out, _ = _run(capsys, "status", str(root / "pfs"))
    assert status == 0 and _table(out)[1:] == [["pfs", "filesystem", "1", "2", _stored(root / "pfs"), str(root / "pfs")]]
    status, out, _ = _run(capsys, "status", str(root / "nvme" / version_dirname(3)))
    assert status == 0 and _table(out)[1][:4] == ["nvme", "filesystem", "1", "3"]


@pytest.mark.slow
def test_status_of_a_config_reads_every_tier_it_names_in_its_order(root: Path) -> None:
    config = _config(root)
    config["distributed"] = {"nodes": 2}  # the peer tier below wants nodes; the config only has to load
    config["tiers"].append({"name": "mirror", "type": "peer"})
    config["tiers"].append(fs_tier("archive", root / "archive"))
    path = root / "tiers.yaml"
    path.write_text(Config.from_dict(config).to_yaml())
    del config["distributed"]
    path_local = root / "local.yaml"
    path_local.write_text(Config.from_dict(config).to_yaml())

    done = tierckpt_cli("status", str(path_local))
    assert done.returncode == 0, done.stderr
    local = root / f"local-{node_identity()}"
    assert _table(done.stdout) == [
        HEADER,
        ["ram", "memory", "-", "-", "-", "in the training process's RAM: not visible from here"],
        ["nvme", "filesystem", "2", "3", _stored(root / "nvme"), str(root / "nvme")],
        ["pfs", "filesystem", "1", "2", _stored(root / "pfs"), str(root / "pfs")],
        ["local", "filesystem", "3", "3", _stored(local), f"{local} (this node's directory)"],
        ["mirror", "peer", "-", "-", "-", "copies held by the training processes of other nodes: not visible from here"],
        ["archive", "filesystem", "0", "-", "0 B", f"{root / 'archive'} (does not exist yet)"],
    ]
    # Nodes simulated on this host (distributed.nodes): every node's directory is here.
    done = tierckpt_cli("status", str(path))
    assert done.returncode == 0, done.stderr
    rows = [row for row in _table(done.stdout) if row[0] == "local"]
    assert rows == [
        ["local", "filesystem", "0", "-", "0 B", f"{root / 'local-0'} (does not exist yet; node 0)"],
        ["local", "filesystem", "0", "-", "0 B", f"{root / 'local-1'} (does not exist yet; node 1)"],
    ]
    assert not (root / "archive").exists() and not (root / "local-0").exists()  # status creates nothing


def test_status_verify_counts_ok_and_damaged_versions_per_tier(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    version = root / "nvme" / version_dirname(3)
    record = next(r for r in Manifest.decode((version / MANIFEST_FILE).read_bytes()).records if r.key == "['w']")
    flip_bits(version / DATA, record.chunks[0].offset + 100)
    assert _run(capsys, "status", str(root))[0] == 0  # without --verify only manifests are read

    done = tierckpt_cli("status", "--verify", "--threads", "3", str(root))
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    table = _table(done.stdout)
    assert table[0] == ["TIER", "TYPE", "VERSIONS", "NEWEST", "STORED", "VERIFIED", "WHERE"]
    assert [row[:6] for row in table[1:4]] == [
        [f"local-{node_identity()}", "filesystem", "3", "3", _stored(root / f"local-{node_identity()}"), "3 OK"],
        ["nvme", "filesystem", "2", "3", _stored(root / "nvme"), "1 OK, 1 DAMAGED"],
        ["pfs", "filesystem", "1", "2", _stored(root / "pfs"), "1 OK"],
    ]
    assert lines[4].startswith("nvme  step-000000000003  DAMAGED  ")
    assert f"{DATA}: checksum mismatch in ['w'] (chunk 0)" in lines[4]
    assert lines[5:] == ["6 versions: 5 OK, 1 damaged"]

    # A manifest that does not read is damage even without --verify.
    path = root / "pfs" / version_dirname(2) / MANIFEST_FILE
    path.write_bytes(path.read_bytes()[:-5])
    status, out, _ = _run(capsys, "status", str(root / "pfs"))
    assert status == 1
    assert _table(out)[1][:5] == ["pfs", "filesystem", "1", "2", "0 B"]
    assert out.splitlines()[2].startswith(f"pfs  step-000000000002  DAMAGED  {MANIFEST_FILE}: not msgpack")


def test_status_counts_what_a_rollback_abandoned_and_shows_the_newest_live_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Against the newest save of every tier listed (on nvme, after the rollback to step 5): nvme's 13
    and pfs's 10 are abandoned, and NEWEST is the direction's, not the highest step held."""
    config = rolled_back(tmp_path)
    nvme, pfs = tmp_path / "nvme", tmp_path / "pfs"
    rows = [
        ["nvme", "filesystem", "4 (1 abandoned)", "8", _stored(nvme), str(nvme)],
        ["pfs", "filesystem", "2 (1 abandoned)", "5", _stored(pfs), str(pfs)],
    ]
    status, out, _ = _run(capsys, "status", str(tmp_path))
    assert status == 0 and _table(out) == [HEADER, *rows]
    path = tmp_path / "tiers.yaml"
    path.write_text(Config.from_dict(config).to_yaml())
    status, out, _ = _run(capsys, "status", str(path))
    assert status == 0 and _table(out)[2:] == rows
    # pfs alone: 10 is the newest save there.
    status, out, _ = _run(capsys, "status", str(pfs))
    assert status == 0 and _table(out)[1:] == [["pfs", "filesystem", "2", "10", _stored(pfs), str(pfs)]]


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_status_runs_beside_a_training_job_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text(Config.from_dict(_config(tmp_path)).to_yaml())
    with Checkpointer(path) as ckpt:  # holds every tier's lock
        _save(ckpt, range(1, 3))
        before = _files(tmp_path)
        status, out, err = _run(capsys, "status", "--verify", str(path))
        assert (status, err) == (0, "")
        assert out.splitlines()[-1] == "5 versions: 5 OK, 0 damaged"
        assert _files(tmp_path) == before
        _save(ckpt, range(3, 5))  # the job goes on: status took no lock and left nothing behind
    status, out, _ = _run(capsys, "status", str(path))
    assert [row[:4] for row in _table(out)[2:4]] == [["nvme", "filesystem", "2", "4"], ["pfs", "filesystem", "2", "4"]]


def test_status_reads_a_memory_tier_that_outlives_its_process(shm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tier_config(fs_tier("nvme", tmp_path / "nvme"), ram=memory_tier(path=str(shm), keep={"last": 2}), capacity="4MiB")
    path = tmp_path / "tiers.yaml"
    path.write_text(Config.from_dict(config).to_yaml())
    with Checkpointer(path) as ckpt:
        for step in range(1, 4):
            assert ckpt.save_sync(step, _state(step)).committed_sync("nvme", timeout=60)
        status, out, _ = _run(capsys, "status", "--verify", str(path))  # the pool is in use: read beside it
    assert status == 0, out
    assert [row[:6] for row in _table(out)[1:3]] == [
        ["ram", "memory", "2", "3", _stored(shm), "2 OK"],
        ["nvme", "filesystem", "3", "3", _stored(tmp_path / "nvme"), "3 OK"],
    ]
    assert _table(out)[1][6] == str(shm)
    status, out, _ = _run(capsys, "status", str(shm))  # the directory alone: a memory tier by its pool
    assert status == 0 and _table(out)[1][:4] == [shm.name, "memory", "2", "3"]


def test_status_of_an_object_tier_lists_its_bucket(s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tier_config(s3.tier("s3", prefix=s3.prefix), capacity="8MiB")
    with Checkpointer(config) as ckpt:
        for step in (1, 2):
            assert ckpt.save_sync(step, _state(step)).committed_sync("s3", timeout=60)
    path = tmp_path / "tiers.yaml"
    path.write_text(Config.from_dict(config).to_yaml())
    status, out, _ = _run(capsys, "status", "--verify", str(path))
    assert status == 0, out
    url = f"s3://{s3.bucket}/{s3.prefix}"
    row = _table(out)[2]
    assert row[:4] + row[5:] == ["s3", "object", "2", "2", "2 OK", f"{url} at {s3.endpoint}"]
    status, out, _ = _run(capsys, "status", url, "--endpoint", s3.endpoint)
    assert status == 0 and _table(out)[1][:4] == [s3.prefix, "object", "2", "2"]


def test_status_usage_errors_exit_2(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _run(capsys, "status", str(tmp_path / "missing"))
    assert (status, out) == (2, "") and "missing: no such file or directory" in err
    plain = tmp_path / "plain"
    (plain / "logs").mkdir(parents=True)
    (plain / "logs" / "train.log").write_text("x")
    status, out, err = _run(capsys, "status", str(plain))
    assert (status, out) == (2, "") and "no tier and no version found here" in err and "or a YAML config" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - name: nvme\n    type: filesystem\n    paht: /x\n")
    status, out, err = _run(capsys, "status", str(bad))
    assert (status, out) == (2, "") and "not a config that loads" in err and "paht" in err
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)))
    status, out, err = _run(capsys, "status", str(binary))
    assert (status, out) == (2, "") and f"{binary}: not a config that loads" in err
    assert _run(capsys, "status", "--threads", "0", str(root))[0] == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run(capsys, "status", str(empty)) == (0, "TIER   TYPE        VERSIONS  NEWEST  STORED  WHERE\n"
                                                     f"empty  filesystem  0         -       0 B     {empty}\n", "")
