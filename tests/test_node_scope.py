"""Filesystem tiers with ``scope: node`` (each node's own directory, ``{node}`` in the path): one process,
the ranks of one node, and the placeholder's rules. Across nodes, with failures: tests/test_node_local.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, ConfigError
from tierckpt.config import TierConfig
from tierckpt.format import version_dirname
from tierckpt.testing import launch_ranks
from tierckpt.testing.ranks import failures

from helpers import assert_bitwise, ram_fs

WORKER = Path(__file__).with_name("dist_worker.py")


def _config(path: str) -> dict[str, Any]:
    return ram_fs(path, capacity="16MiB", scope="node")


def test_node_placeholder_is_the_nodes_name_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROUP_RANK", "7")  # torchrun's node rank names the node
    state = {"w": torch.randn(1000), "step": torch.tensor(5)}
    with Checkpointer(_config(str(tmp_path / "local-{node}" / "ckpt"))) as ckpt:
        assert ckpt.save_sync(5, state).committed_sync("nvme", timeout=60)
    assert (tmp_path / "local-7" / "ckpt" / version_dirname(5)).is_dir()
    assert not (tmp_path / "local-{node}").exists()
    with Checkpointer(_config(str(tmp_path / "local-{node}" / "ckpt"))) as ckpt:
        restored = ckpt.restore_latest_sync()
    assert restored is not None and restored.tier == "nvme" and restored.step == 5
    assert_bitwise(restored.state, state)


def test_a_path_without_the_placeholder_is_used_as_it_is(tmp_path: Path) -> None:
    with Checkpointer(_config(str(tmp_path / "nvme"))) as ckpt:
        assert ckpt.save_sync(1, {"w": torch.ones(10)}).committed_sync("nvme", timeout=60)
    assert (tmp_path / "nvme" / version_dirname(1)).is_dir()


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        (dict(type="filesystem", path="/x/{node}"), r"^tier\.path: \{node\} needs scope: node \(tier 't'\); set scope: node"),
        (dict(type="filesystem", path="/x/{nod}", scope="node"), r"^tier\.path: '\{nod\}' is not a placeholder \(tier 't'\); the only one is \{node\}"),
        (dict(type="filesystem", path="/x", scope="nodes"), r"^tier\.scope: 'nodes' is not allowed \(tier 't'\); use one of: shared, node$"),
        (dict(type="memory", scope="node"), r"^tier\.scope: not allowed on a memory tier \(tier 't'\); scope applies to filesystem tiers"),
        (dict(type="peer", scope="node"), r"^tier\.scope: not allowed on a peer tier \(tier 't'\)"),
    ],
)
def test_scope_and_placeholder_mistakes_name_the_key(tier: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TierConfig(name="t", **tier)


def test_lone_braces_are_plain_characters_in_a_shared_path() -> None:
    assert str(TierConfig(name="t", type="filesystem", path="/x/{a/b}c").path) == "/x/{a/b}c"


def _ranks(root: Path, nodes: int) -> list[dict[str, Any]]:
    exits = launch_ranks([sys.executable, str(WORKER), "node_scope", str(root)], 2, env={"TEST_TIMEOUT": "30", "NODES": str(nodes)})
    failed = failures(exits, ())
    assert not failed, failed
    return [json.loads((root / f"result-{e.rank}.json").read_text()) for e in exits]


def test_the_ranks_of_one_node_share_its_directory(tmp_path: Path) -> None:
    results = _ranks(tmp_path, nodes=1)
    for r in results:
        assert "config_error" not in r, r
        assert r["committed"] is True
        assert r["versions"] == [["nvme", 3, str(tmp_path / "local-0" / version_dirname(3))]], r


def test_ranks_on_two_nodes_each_commit_into_their_nodes_directory(tmp_path: Path) -> None:
    results = _ranks(tmp_path, nodes=2)
    for rank, r in enumerate(results):
        assert "config_error" not in r, r
        assert r["committed"] is True
        assert r["versions"] == [["nvme", 3, str(tmp_path / f"local-{rank}" / version_dirname(3))]], r
