"""``python -m tierckpt export``: safetensors and torch.save files of one version, bitwise, of one process
or of four ranks with DTensor shards; damage and refusals leave no output behind."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tierckpt import Checkpointer
from tierckpt.cli import main
from tierckpt.export import ExportProgress, OutputExistsError, export
from tierckpt.format import DATA_FILE, MANIFEST_FILE, Manifest, version_dirname
from tierckpt.testing import failures, flip_bits, launch_ranks

from helpers import bitwise_equal

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
STEP = 7
DATA = DATA_FILE.format(rank=0)

sys.path.insert(0, str(TESTS))
import reshard_worker  # noqa: E402  (tests/ is not a package)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 301, generator=g)
    w[0, 0] = float("nan")  # bitwise, not ==
    return {
        "model": {
            "layer.0.w": w,
            "emb": torch.randn(50, 8, generator=g).to(torch.bfloat16),
            "ids": torch.arange(-5, 995),
            "mask": torch.rand(33, generator=g) > 0.5,
            "scale": torch.tensor(0.125),  # 0-d
            "empty": torch.empty(0, 4),
            "big": torch.randn(600, 600, generator=g),  # past 1 MiB: a file-backed mapping for --to torch
        },
        "optim": {
            "state": {0: {"exp_avg": torch.randn(7, generator=g), "step": 3}},
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0]}],
        },
        "np": np.arange(6, dtype=">i2").reshape(2, 3),  # big-endian: exported little-endian
        "step": STEP,
        "name": "run-a",
        "blob": b"\x00\x01",  # not JSON: left out of tierckpt.extra
    }


NAMES = {
    "model.layer.0.w": ("model", "layer.0.w"),
    "model.emb": ("model", "emb"),
    "model.ids": ("model", "ids"),
    "model.mask": ("model", "mask"),
    "model.scale": ("model", "scale"),
    "model.empty": ("model", "empty"),
    "model.big": ("model", "big"),
    "optim.state.0.exp_avg": ("optim", "state", 0, "exp_avg"),
}
TOTAL = 300 * 301 * 4 + 50 * 8 * 2 + 1000 * 8 + 33 + 4 + 600 * 600 * 4 + 7 * 4 + 6 * 2
SIZE = f"{TOTAL / 2**20:.1f} MiB"
EXTRA = {
    "optim.state.0.step": 3,
    "optim.param_groups.0.lr": 0.001,
    "optim.param_groups.0.betas.0": 0.9,
    "optim.param_groups.0.betas.1": 0.999,
    "optim.param_groups.0.params.0": 0,
    "step": STEP,
    "name": "run-a",
}


def _save(root: Path, state: Any, metadata: dict[str, Any] | None = None) -> Path:
    config = {
        "host": {"capacity": "64MiB", "snapshots": 1},
        "tiers": [{"name": "ram", "type": "memory"}, {"name": "disk", "type": "filesystem", "path": str(root / "disk")}],
    }
    with Checkpointer(config) as ckpt:
        assert ckpt.save_sync(STEP, state, metadata=metadata).committed_sync("disk", timeout=60)
    return root / "disk" / version_dirname(STEP)


@pytest.fixture(scope="module")
def version(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process's version of :func:`_state` (read only: copy it to damage it)."""
    return _save(tmp_path_factory.mktemp("single"), _state(), {"epoch": 3, "note": "warm"})


def _get(state: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        state = state[key]
    return state


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tierckpt", "export", *argv], capture_output=True, text=True, env=ENV, timeout=120)


def _in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["export", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_safetensors_export_is_bitwise_with_dotted_names_and_metadata(version: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    done = _cli(str(version), str(out))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # not a terminal: no progress line
    assert done.stdout == f"exported step {STEP}: 9 tensors, {SIZE} to {out}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temporaries left
    raw = out.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0 and json.loads(raw[8 : 8 + length])  # data 8-byte aligned, header JSON
    state = _state()
    with safe_open(str(out), framework="pt") as f:
        assert set(f.keys()) == set(NAMES) | {"np"}
        for name, path in NAMES.items():
            assert bitwise_equal(f.get_tensor(name), _get(state, path)), name
        assert bitwise_equal(f.get_tensor("np"), torch.arange(6, dtype=torch.int16).reshape(2, 3))
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["tierckpt.step"] == str(STEP)
    assert json.loads(meta["tierckpt.metadata"]) == {"epoch": 3, "note": "warm"}
    assert json.loads(meta["tierckpt.extra"]) == EXTRA


def test_torch_export_rebuilds_the_state_bitwise(version: Path, tmp_path: Path) -> None:
    out = tmp_path / "state.pt"  # the suffix chooses the format
    done = _cli(str(version), str(out))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]  # the scratch directory is gone
    got = torch.load(out, weights_only=True)
    want = _state()
    assert sorted(got) == sorted(want) and sorted(got["model"]) == sorted(want["model"])
    for path in NAMES.values():
        value = _get(got, path)
        assert type(value) is torch.Tensor and bitwise_equal(value, _get(want, path)), path
    assert got["optim"]["param_groups"] == [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0]}]
    assert got["optim"]["state"][0]["step"] == 3
    assert (got["step"], got["name"], got["blob"]) == (STEP, "run-a", b"\x00\x01")
    assert bitwise_equal(got["np"], torch.arange(6, dtype=torch.int16).reshape(2, 3))  # numpy became a tensor


def test_python_api_returns_a_summary_and_reports_each_tensor(version: Path, tmp_path: Path) -> None:
    seen: list[ExportProgress] = []
    out = tmp_path / "x.bin"
    summary = export(version, out, to="torch", progress=seen.append)
    assert (summary.step, summary.tensors, summary.to, summary.path) == (STEP, 9, "torch", out)
    assert [p.tensors for p in seen] == list(range(1, 10))
    assert seen[-1].nbytes == seen[-1].total_nbytes == summary.nbytes == TOTAL
    assert all(a.nbytes <= b.nbytes for a, b in zip(seen, seen[1:]))
    assert isinstance(torch.load(out, weights_only=True), dict)
    # No suffix to go by and no `to`: safetensors.
    assert export(version, tmp_path / "y.bin").to == "safetensors"
    with safe_open(str(tmp_path / "y.bin"), framework="pt") as f:
        assert len(f.keys()) == 9


def test_explicit_format_wins_over_the_suffix_and_a_terminal_gets_a_progress_line(
    version: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    out = tmp_path / "weights.pt"
    status, stdout, _ = _in_process(capsys, str(version), str(out), "--to", "safetensors")
    assert status == 0
    assert stdout.startswith(f"exported step {STEP}: 9 tensors")
    assert out.read_bytes()[8:9] == b"{"  # a safetensors header, not a zip
    drawn = terminal.getvalue()
    assert f"export step {STEP}: 100%|" in drawn and f"| {SIZE}/{SIZE} [" in drawn
    assert drawn.endswith("\n")  # the bar is closed before the summary


def _run_ranks(root: Path, world: int, env: dict[str, str]) -> None:
    """``world`` ranks of tests/reshard_worker.py saving step 7 (as tests/test_distributed.py starts ranks)."""
    exits = launch_ranks([sys.executable, str(TESTS / "reshard_worker.py"), "save", str(root)], world, env=ENV | env)
    failed = failures(exits)
    assert not failed, failed


@pytest.mark.slow
def test_four_ranks_of_dtensor_shards_export_as_global_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 2x2 mesh, sharded on dim 0 across one mesh dimension and replicated across the other: uneven
    # shards, replicas stored once, and "big" (17 MiB) spanning stored chunks.
    _run_ranks(tmp_path, 4, {"MESH": "2x2", "PLACE": "S0,R"})
    version = tmp_path / "disk" / version_dirname(reshard_worker.STEP)
    assert len(list(version.glob("data-r*.bin"))) == 4
    status, stdout, err = _in_process(capsys, str(version), str(tmp_path / "out.safetensors"))
    assert status == 0, err
    with safe_open(str(tmp_path / "out.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {f"model.{k}" for k in reshard_worker.SHAPES} | {"rank"}
        for key in reshard_worker.SHAPES:
            assert bitwise_equal(f.get_tensor(f"model.{key}"), reshard_worker.global_value(key)), key
        assert bitwise_equal(f.get_tensor("rank"), torch.tensor([0]))  # a rank's own value: rank 0's
        assert json.loads(f.metadata()["tierckpt.extra"]) == {"step": reshard_worker.STEP}
    status, _, err = _in_process(capsys, str(version), str(tmp_path / "out.pt"))
    assert status == 0, err
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    for key in reshard_worker.SHAPES:
        assert bitwise_equal(got["model"][key], reshard_worker.global_value(key)), key
    assert got["step"] == reshard_worker.STEP and bitwise_equal(got["rank"], torch.tensor([0]))


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_a_damaged_chunk_fails_with_status_1_and_leaves_no_output(
    version: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], to: str
) -> None:
    damaged = tmp_path / "disk" / version.name
    shutil.copytree(version, damaged)
    record = next(r for r in Manifest.decode((damaged / MANIFEST_FILE).read_bytes()).records if r.key == "['model']['big']")
    flip_bits(damaged / DATA, record.chunks[0].offset + 1000)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    status, stdout, err = _in_process(capsys, str(damaged), str(out_dir / "model.bin"), "--to", to)
    assert status == 1 and stdout == ""
    assert err.startswith("tierckpt export: ") and len(err.splitlines()) == 1  # main()'s name: the console script's
    assert DATA in err and "['model']['big']" in err and "checksum" in err
    assert list(out_dir.iterdir()) == []  # neither the output nor a temporary


def test_refusals_exit_2_and_write_nothing(version: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"keep")
    status, _, err = _in_process(capsys, str(version), str(out))
    assert (status, err) == (2, f"tierckpt export: {out} exists; --force replaces it\n")  # the flag, not force=True
    assert out.read_bytes() == b"keep"
    with pytest.raises(OutputExistsError, match=r"exists; force=True replaces it$") as refused:  # Python: the argument
        export(version, out)
    assert isinstance(refused.value, FileExistsError) and refused.value.path == out and "--force" not in str(refused.value)
    assert out.read_bytes() == b"keep"
    status, _, err = _in_process(capsys, str(version), str(out), "--force")
    assert status == 0, err
    assert out.read_bytes()[8:9] == b"{"

    status, _, err = _in_process(capsys, str(tmp_path / "nowhere"), str(tmp_path / "a.safetensors"))
    assert status == 2 and "nowhere: no such directory" in err
    status, _, err = _in_process(capsys, str(version.parent), str(tmp_path / "a.safetensors"))
    assert status == 2 and "is a tier directory" in err and version.name in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_what_safetensors_cannot_hold_is_refused_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {"ok": torch.ones(3), "model": {"c": torch.tensor([1 + 2j], dtype=torch.complex128)}, "a.b": 1, "a": {"b": torch.ones(1)}}
    version = _save(tmp_path, state)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    status, stdout, err = _in_process(capsys, str(version), str(out_dir / "m.safetensors"))
    assert status == 2 and stdout == ""
    assert "['model']['c']" in err and "complex128" in err and "--to torch" in err
    assert list(out_dir.iterdir()) == []
    # complex128 aside, two values would share the name "a.b".
    del state["model"]
    status, _, err = _in_process(capsys, str(_save(tmp_path / "again", state)), str(out_dir / "m.safetensors"))
    assert status == 2 and "['a.b']" in err and "['a']['b']" in err and "'a.b'" in err
    assert list(out_dir.iterdir()) == []
    # torch.save holds both.
    status, _, err = _in_process(capsys, str(version), str(out_dir / "m.pt"))
    assert status == 0, err
    got = torch.load(out_dir / "m.pt", weights_only=True)
    assert bitwise_equal(got["model"]["c"], torch.tensor([1 + 2j], dtype=torch.complex128)) and got["a.b"] == 1
