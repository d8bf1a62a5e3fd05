"""``tierckpt ls|verify DIR`` (and ``python -m tierckpt``): listing and checking versions, exit statuses,
damage reports, folders holding tiers, what a rollback left, the console script and ``--version``."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import runpy
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

import tierckpt
from tierckpt import Checkpointer
from tierckpt.cli import main
from tierckpt.format import CHECKSUM_ALGORITHM, DATA_FILE, MANIFEST_FILE, Manifest, checksum, version_dirname
from tierckpt.testing import flip_bits

from helpers import nvme_and_pfs, tierckpt_cli, tierckpt_cli_argv

DATA = DATA_FILE.format(rank=0)
ROOT = Path(__file__).resolve().parent.parent
LS_HEADER = ["NAME", "STEP", "SAVE", "STORED", "LOGICAL", "CREATED", "MANIFEST"]


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(300, 301, generator=g),
        "h": torch.ones(20_000, dtype=torch.bfloat16),  # compresses: a zstd+shuffle chunk on pfs
        "i": torch.arange(5000),
        "np": np.arange(100, dtype=np.int16),
        "step": step,
    }


@pytest.fixture
def tiers(tmp_path: Path) -> Path:
    """Steps 1 and 2 on nvme (raw) and pfs (zstd + shuffle)."""
    config = nvme_and_pfs(tmp_path)
    with Checkpointer(config) as ckpt:
        for step in (1, 2):
            assert ckpt.save_sync(step, _state(step)).committed_sync("pfs", timeout=60)
    return tmp_path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _manifest(version: Path) -> Manifest:
    return Manifest.decode((version / MANIFEST_FILE).read_bytes())


def rolled_back(root: Path) -> dict[str, Any]:
    """A rollback saved by real Checkpointers in ``root``; returns their config. A job saves steps 1..13
    (saves 1..13); the next one restores step 5 and saves 6, 7, 8 (saves 14, 15, 16). nvme (keep the
    newest 3 live) then holds 6, 7, 8 and 13 (abandoned); pfs (every 5th step) holds 5 and 10 (abandoned)."""
    config = {
        "host": {"capacity": "1MiB", "snapshots": 2},
        "tiers": [
            {"name": "ram", "type": "memory", "keep": {"last": 1}},
            {"name": "nvme", "type": "filesystem", "path": str(root / "nvme"), "keep": {"last": 3}},
            {"name": "pfs", "type": "filesystem", "path": str(root / "pfs"), "flush": {"every_steps": 5, "newest_only": False}},
        ],
    }
    with Checkpointer(config) as ckpt:
        _save_each(ckpt, range(1, 14))
    with Checkpointer(config) as ckpt:
        ckpt.restore_sync(5)
        _save_each(ckpt, range(6, 9))
    return config


def _save_each(ckpt: Checkpointer, steps: range) -> None:
    for step in steps:
        ckpt.save_sync(step, {"w": torch.full((4,), float(step))})
        ckpt.wait_sync()


def _listed(out: str) -> dict[tuple[str, int], tuple[str, str]]:
    """What ``ls`` printed of each version, by (heading, step): its SAVE and its MANIFEST cell."""
    listed = {}
    for block in out.split("\n\n"):
        lines = block.splitlines()
        heading = lines.pop(0).removesuffix(":") if not lines[0].startswith("NAME") else ""
        assert lines[0].split() == LS_HEADER
        for row in lines[1:]:
            _, step, save, *_ = row.split()
            listed[(heading, int(step))] = (save, row.rpartition("  ")[2])
    return listed


def test_verify_passes_a_healthy_tier_and_says_what_it_checked(tiers: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for tier in ("nvme", "pfs"):
        status, out, err = _run(capsys, "verify", str(tiers / tier))
        assert status == 0, out + err
        lines = out.splitlines()
        assert lines[0].startswith("step-000000000001  OK ") and "4 tensors" in lines[0]
        assert lines[1].startswith("step-000000000002  OK ")
        assert lines[2] == "2 versions: 2 OK, 0 damaged"
        assert not err


def test_verify_of_one_version_directory(tiers: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "verify", str(tiers / "pfs" / version_dirname(2)))
    assert status == 0
    assert out.splitlines() == [out.splitlines()[0], "1 version: 1 OK, 0 damaged"]
    assert out.startswith("step-000000000002  OK")


def test_verify_names_the_file_key_and_chunk_of_a_flipped_byte(tiers: Path, capsys: pytest.CaptureFixture[str]) -> None:
    version = tiers / "nvme" / version_dirname(2)
    record = next(r for r in _manifest(version).records if r.key == "['i']")
    flip_bits(version / DATA, record.chunks[0].offset + 17)
    status, out, _ = _run(capsys, "verify", str(tiers / "nvme"))
    assert status == 1
    lines = out.splitlines()
    assert lines[0].startswith("step-000000000001  OK")
    assert lines[1].startswith("step-000000000002  DAMAGED  ")
    assert f"{DATA}: checksum mismatch in ['i'] (chunk 0)" in lines[1]
    assert lines[2] == "2 versions: 1 OK, 1 damaged"


def test_verify_counts_every_damaged_chunk(tiers: Path, capsys: pytest.CaptureFixture[str]) -> None:
    version = tiers / "nvme" / version_dirname(1)
    for record in _manifest(version).records[:3]:
        flip_bits(version / DATA, record.chunks[0].offset)
    status, out, _ = _run(capsys, "verify", str(version))
    assert status == 1
    assert out.splitlines()[0].endswith("(and 2 more damaged chunks)")


def test_verify_decodes_compressed_chunks(tiers: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A compressed chunk whose checksum matches but whose frame does not decode (a writer's bug, or a
    manifest rewritten to match damaged bytes) is damage too: verify decodes every chunk."""
    version = tiers / "pfs" / version_dirname(2)
    path = version / MANIFEST_FILE
    body = msgpack.unpackb(msgpack.unpackb(path.read_bytes())["body"], strict_map_key=False)
    record = next(r for r in body["records"] if r["key"] == "['h']")
    assert record["codec"] == "zstd+shuffle"
    offset, stored = record["chunks"][0][:2]
    flip_bits(version / DATA, offset + 4)  # the frame's plane count
    with open(version / DATA, "rb") as f:
        f.seek(offset)
        record["chunks"][0][2] = checksum(f.read(stored))
    raw = msgpack.packb(body, use_bin_type=True)
    path.write_bytes(msgpack.packb({"body": raw, CHECKSUM_ALGORITHM: checksum(raw)}, use_bin_type=True))
    status, out, _ = _run(capsys, "verify", str(version))
    assert status == 1
    assert f"DAMAGED  {DATA}: ['h'] chunk 0 does not decode (byte-shuffle frame declares" in out


def test_ls_lists_steps_sizes_and_validity_and_verify_names_a_damaged_manifest(
    tiers: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = _run(capsys, "ls", str(tiers / "pfs"))
    assert status == 0
    header, *rows = out.splitlines()
    assert header.split() == LS_HEADER
    assert [row.split()[:3] for row in rows] == [["step-000000000001", "1", "1"], ["step-000000000002", "2", "2"]]
    assert all(row.endswith("  yes") for row in rows)
    # Creation times are local, with the UTC offset: the form status prints times in.
    created = datetime.fromtimestamp(_manifest(tiers / "pfs" / version_dirname(1)).created).astimezone()
    assert f"  {created.isoformat(timespec='seconds')}  yes" in rows[0]
    manifest = _manifest(tiers / "pfs" / version_dirname(2))
    assert manifest.stored_bytes < sum(r.nbytes for r in manifest.records)  # stored and logical differ

    path = tiers / "pfs" / version_dirname(2) / MANIFEST_FILE
    path.write_bytes(path.read_bytes()[:-5])
    status, out, _ = _run(capsys, "ls", str(tiers / "pfs"))
    assert status == 1
    assert out.splitlines()[2].endswith(f"no: {MANIFEST_FILE}: not msgpack (Unpack failed: incomplete input)")
    status, out, _ = _run(capsys, "verify", str(tiers / "pfs"))
    assert status == 1
    assert f"step-000000000002  DAMAGED  {MANIFEST_FILE}: not msgpack" in out


def test_truncated_and_missing_data_files_are_damage(tiers: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.truncate(tiers / "nvme" / version_dirname(1) / DATA, 10_000)
    os.unlink(tiers / "nvme" / version_dirname(2) / DATA)
    status, out, _ = _run(capsys, "verify", str(tiers / "nvme"))
    assert status == 1
    lines = out.splitlines()
    assert f"DAMAGED  {DATA}: " in lines[0] and "lies past the end of the file (10000 bytes): truncated?" in lines[0]
    assert f"DAMAGED  data file {DATA} is missing" in lines[1]


def test_leftovers_and_other_entries_are_not_versions(tiers: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nvme = tiers / "nvme"
    (nvme / ".tmp-step-000000000003-abc").mkdir()
    (nvme / ".trash-step-000000000001-abc").mkdir()
    (nvme / "notes.txt").write_text("x")
    status, out, _ = _run(capsys, "verify", str(nvme))
    assert status == 0
    assert out.splitlines()[-1] == "2 versions: 2 OK, 0 damaged"


def test_usage_errors_exit_2(tiers: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _run(capsys, "verify", str(tmp_path / "missing"))
    assert (status, out) == (2, "")
    assert "missing: no such directory" in err
    (tmp_path / "file").write_text("x")
    assert _run(capsys, "ls", str(tmp_path / "file"))[0] == 2
    assert _run(capsys, "verify", "--threads", "0", str(tiers / "nvme"))[0] == 2
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["frobnicate", str(tiers)])
    assert info.value.code == 2
    capsys.readouterr()


def test_an_empty_directory_has_no_versions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "verify", str(tmp_path))
    assert (status, out) == (0, f"no versions in {tmp_path}\n")


@pytest.mark.slow
def test_python_dash_m_tierckpt(tiers: Path) -> None:
    """The real entry point, in a subprocess: exit statuses and output as a shell sees them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-m", "tierckpt", "verify", str(tiers / "nvme")], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == "2 versions: 2 OK, 0 damaged"
    flip_bits(tiers / "nvme" / version_dirname(2) / MANIFEST_FILE, 40)
    bad = subprocess.run([sys.executable, "-m", "tierckpt", "ls", str(tiers / "nvme")], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1
    assert f"no: {MANIFEST_FILE}:" in bad.stdout
    usage = subprocess.run([sys.executable, "-m", "tierckpt"], capture_output=True, text=True, env=env, timeout=120)
    assert usage.returncode == 2 and "usage: python -m tierckpt" in usage.stderr


def test_the_module_entry_point_runs_the_command_line_under_its_own_name(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """tierckpt/__main__.py in this process (the quick subset's; the subprocess test above is slow):
    it runs main() and exits with its status, naming itself ``python -m tierckpt``."""
    monkeypatch.setattr(sys, "argv", ["tierckpt"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("tierckpt", run_name="__main__")
    assert done.value.code == 2 and "usage: python -m tierckpt" in capsys.readouterr().err


def test_the_version_is_written_once_and_the_console_script_prints_it() -> None:
    assert tierckpt.__version__ == importlib.metadata.version("tierckpt")
    assert "__version__" not in tierckpt.__all__  # a module attribute, not an API name
    done = tierckpt_cli("--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"tierckpt {tierckpt.__version__}\n", "")
    module = subprocess.run([sys.executable, "-m", "tierckpt", "--version"], capture_output=True, text=True, timeout=120)
    assert (module.returncode, module.stdout) == (0, done.stdout)


# main() as the console script runs it, in a fresh interpreter: what it imported, after it printed.
NO_TORCH = """
import sys
from tierckpt.cli import main
try:
    main(sys.argv[1:])
except SystemExit:  # argparse's --version and --help exit
    pass
print("imported torch" if "torch" in sys.modules else "no torch", file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["export", "--help"]])
def test_version_and_help_do_not_import_torch(argv: list[str]) -> None:
    # torch takes seconds to import (5-10 s on a busy machine, issue 55); neither answer needs it.
    done = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "no torch\n"), done.stderr
    if argv == ["--version"]:
        assert done.stdout == f"tierckpt {tierckpt.__version__}\n"
    else:
        assert done.stdout.startswith("usage: ")


def test_the_parser_offers_the_export_formats() -> None:
    from tierckpt import cli, export

    assert cli._FORMATS == export.FORMATS  # the parser's copy: tierckpt.export imports torch


def test_the_console_script_and_python_dash_m_are_one_command_line() -> None:
    script = tierckpt_cli("--help")
    module = subprocess.run([sys.executable, "-m", "tierckpt", "--help"], capture_output=True, text=True, timeout=120)
    assert script.returncode == module.returncode == 0
    assert script.stdout.startswith("usage: tierckpt ")
    assert " ".join(module.stdout.replace("python -m tierckpt", "tierckpt").split()) == " ".join(script.stdout.split())
    for command in ("ls", "verify", "status", "export"):
        assert command in script.stdout


def test_export_help_speaks_in_flags_and_metavars(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["export", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: tierckpt export [-h] [--to {safetensors,torch}] [--force] [--threads N] [--endpoint URL] VERSION OUT")
    assert "positional arguments: VERSION a version directory" in text and " OUT the file to write " in text
    for python_name in ("force=", "to=", "threads=", "torch.save", " out ", "THREADS", "ENDPOINT"):
        assert python_name not in text, python_name


@pytest.mark.slow
def test_ls_of_a_folder_holding_tiers_lists_each_tier_under_its_path(tiers: Path) -> None:
    """./checkpoints holding nvme/ and pfs/ (what examples/train_demo.py writes): every tier directory in
    it, under a heading; an empty one beside them is a tier with no version yet; other folders are not tiers."""
    (tiers / "ssd").mkdir()
    (tiers / "logs").mkdir()
    (tiers / "logs" / "train.log").write_text("x")
    (tiers / "README").write_text("x")
    done = tierckpt_cli("ls", str(tiers))
    assert done.returncode == 0, done.stderr
    blocks = done.stdout.split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == [f"{tiers / name}:" for name in ("nvme", "pfs", "ssd")]
    for block in blocks[:2]:
        header, *rows = block.splitlines()[1:]
        assert header.split() == LS_HEADER
        assert [row.split()[:2] for row in rows] == [["step-000000000001", "1"], ["step-000000000002", "2"]]
        assert all(row.endswith("  yes") for row in rows)
    assert blocks[2].splitlines()[1:] == ["no versions"]

    flip_bits(tiers / "pfs" / version_dirname(1) / DATA, _manifest(tiers / "pfs" / version_dirname(1)).records[0].chunks[0].offset)
    verified = tierckpt_cli("verify", str(tiers))
    assert verified.returncode == 1
    blocks = verified.stdout.split("\n\n")
    assert blocks[0].splitlines()[-1] == "2 versions: 2 OK, 0 damaged"
    assert blocks[1].splitlines()[1].startswith("step-000000000001  DAMAGED  ")
    assert blocks[1].splitlines()[-1] == "2 versions: 1 OK, 1 damaged"


def test_a_reader_that_goes_away_stops_the_command_quietly(tiers: Path) -> None:
    """`tierckpt ls DIR | head -1`: the pipe is closed before the command writes, so its first write
    fails (Python ignores SIGPIPE): it stops with status 1 and no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([*tierckpt_cli_argv(), "ls", str(tiers)], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (1, "")


def test_a_folder_that_is_no_tier_and_holds_none_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "plain"
    (plain / "empty").mkdir(parents=True)  # an empty folder alone is no sign of a tier
    (plain / "notes.txt").write_text("x")
    for command in ("ls", "verify"):
        status, out, err = _run(capsys, command, str(plain))
        assert (status, out) == (2, "")
        assert f"tierckpt {command}: {plain}: no tier and no version found here; pass a tier's directory" in err
    # A tier directory with no version yet (its leftovers show what it is) is fine.
    (plain / ".tmp-step-000000000003-abc").mkdir()
    assert _run(capsys, "ls", str(plain)) == (0, f"no versions in {plain}\n", "")


def test_ls_of_a_folder_of_tiers_numbers_the_saves_and_marks_what_a_rollback_abandoned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Abandoned is decided against the newest save of every tier listed: the saves after the rollback
    are on nvme, and leave pfs's step 10 behind as much as nvme's 13."""
    rolled_back(tmp_path)
    status, out, _ = _run(capsys, "ls", str(tmp_path))
    assert status == 0, out
    nvme, pfs = str(tmp_path / "nvme"), str(tmp_path / "pfs")
    assert _listed(out) == {
        (nvme, 6): ("14", "yes"), (nvme, 7): ("15", "yes"), (nvme, 8): ("16", "yes"), (nvme, 13): ("13", "yes, abandoned"),
        (pfs, 5): ("5", "yes"), (pfs, 10): ("10", "yes, abandoned"),
    }
    # pfs alone holds no save after 10: it is the newest there, and nothing is abandoned.
    status, out, _ = _run(capsys, "ls", pfs)
    assert status == 0 and _listed(out) == {("", 5): ("5", "yes"), ("", 10): ("10", "yes")}


def test_ls_of_a_version_without_a_lineage_or_with_a_damaged_manifest_shows_no_save(tiers: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A version saved before lineages were recorded counts as save 0 (live: the newest save descends
    from it); one whose manifest does not read has no save to show, and is not called abandoned."""
    old = tiers / "nvme" / version_dirname(1)
    (old / MANIFEST_FILE).write_bytes(dataclasses.replace(_manifest(old), metadata={}).encode())
    torn = tiers / "pfs" / version_dirname(2) / MANIFEST_FILE
    torn.write_bytes(torn.read_bytes()[:-5])
    status, out, _ = _run(capsys, "ls", str(tiers))
    assert status == 1
    listed = _listed(out)
    assert listed[(str(tiers / "nvme"), 1)] == ("-", "yes") and listed[(str(tiers / "nvme"), 2)] == ("2", "yes")
    assert listed[(str(tiers / "pfs"), 1)] == ("1", "yes")
    assert listed[(str(tiers / "pfs"), 2)][0] == "-" and listed[(str(tiers / "pfs"), 2)][1].startswith(f"no: {MANIFEST_FILE}: not msgpack")
