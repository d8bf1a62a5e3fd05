"""``tierckpt status CONFIG|DIR [--verify] [--threads N]``: one line per tier, what it holds now.

For each tier: its name, its type, the number of versions it holds, the newest step, the bytes they
store, and with ``--verify`` how many verify and how many are damaged (each version checked as
``tierckpt verify`` checks it: :func:`tierckpt.cliversions.verify_version`). The damaged versions follow the
table, one line each, as ``verify`` prints them.

``CONFIG`` is a YAML config (what :meth:`Checkpointer.from_yaml <tierckpt.Checkpointer.from_yaml>`
reads): every tier it names, in its order, where the Checkpointer would find it if started here
(relative paths against the working directory):

- a memory tier lives in the training process's RAM, and is not visible from here; unless it has a
  ``path`` (snapshots that outlive the process, :mod:`tierckpt.tiers.memory.shm`): then its version
  directories there are read like a filesystem tier's (of several ranks: one line per ``rank-NNNNN``
  directory);
- a filesystem tier: its directory; of ``scope: node``, this node's (``{node}`` replaced by
  ``GROUP_RANK``, else the host name; every simulated node's with ``distributed.nodes``);
- an object tier: its committed versions, listed as ``tierckpt ls s3://...`` lists them, with the
  tier's endpoint, region and credentials;
- a peer tier's copies are held by the training processes of other nodes: not visible from here.

``DIR`` is what ``ls`` takes: a tier directory (one line), a folder holding tier directories (one
line per tier directory, named after it), one version directory, or ``s3://bucket/prefix``.

Nothing is written and no tier's lock is taken, so it runs beside a training job; a version that
retention removes while it is being read is left out rather than reported damaged.

Exit status: 0 when every version read is fine, 1 when one is damaged (a manifest that does not
read, or with ``--verify`` any damage) or a tier cannot be listed, 2 on a usage error (a missing
path, a config that does not load, a folder that is neither a tier directory nor holds one).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tierckpt.cliversions import (
    DAMAGED, NO_TIER_HINT, OK, ListedVersion, UsageError, bucket_versions, damage_message, dir_versions,
    format_size, held_bytes, open_parts, verify_version,
)
from tierckpt.config import Config, TierConfig
from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.format import parse_version_dirname
from tierckpt.tiers.stored.find import holds_a_tier, tier_dirs
from tierckpt.tiers.memory.shm import POOL_INFO

__all__ = ["status"]

_RANK_DIR = re.compile(r"rank-\d{5}")  # a memory tier's pool of one rank, under its path (tierckpt.runtime)
_NOT_VISIBLE = {
    "memory": "in the training process's RAM: not visible from here",
    "peer": "copies held by the training processes of other nodes: not visible from here",
}


@dataclass
class _Row:
    """One line: a tier (or one directory of it) and the versions found there.

    ``versions`` None: nothing is listed from here (``where`` says why); ``broken``: ``where`` names
    why the tier cannot be listed."""

    tier: str
    type: str
    where: str
    versions: list[ListedVersion] | None = None
    broken: bool = False
    held: int = 0
    newest: int | None = None
    stored: int = 0
    damage: list[tuple[str, str]] = field(default_factory=list)  # (version, what is damaged)


def status(target: str, *, verify: bool, threads: int, endpoint: str | None) -> int:
    """Print the table for ``target``; returns the exit status (see the module docstring).

    Args:
        target: a YAML config file, a directory (a tier's, a folder of tiers, a version's), or an
            ``s3://bucket/prefix``.
        verify: check every chunk of every version, as ``tierckpt verify`` does.
        threads: threads reading and checking chunks (>= 1).
        endpoint: the S3-compatible server of an ``s3://`` target (a config's tiers name their own).

    Raises:
        tierckpt.cliversions.UsageError: before anything is printed, when ``target`` is none of those (the
            command line prints it and exits 2).

    Example: ``tierckpt status ./checkpoints`` runs ``status("./checkpoints", verify=False, threads=2,
    endpoint=None)``.
    """
    rows = _rows(target, endpoint)
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tierckpt-status") as executor:
        for row in rows:
            _tally(row, verify, executor)
    _print(rows, verify)
    return DAMAGED if any(row.damage or row.broken for row in rows) else OK


def _rows(target: str, endpoint: str | None) -> list[_Row]:
    if target.startswith("s3://"):
        name = target.rstrip("/").rpartition("/")[2] or target
        return [_Row(name, "object", target, bucket_versions(target, endpoint))]
    path = Path(target)
    if not path.exists():
        raise UsageError(f"{target}: no such file or directory")
    if not path.is_dir():
        return _config_rows(path)
    if dir_versions(path) or holds_a_tier(path):
        resolved = path.resolve()
        own = resolved.parent if parse_version_dirname(resolved.name) is not None else resolved
        return [_local_row(own.name, _dir_type(own), path)]
    names = tier_dirs(path)
    if not names:
        raise UsageError(f"{target}: {NO_TIER_HINT}, or a YAML config")
    return [_local_row(name, _dir_type(path / name), path / name) for name in names]


def _dir_type(directory: Path) -> str:
    return "memory" if (directory / POOL_INFO).exists() else "filesystem"


def _local_row(tier: str, kind: str, directory: Path, note: str = "") -> _Row:
    """The versions in ``directory``; none when there is no directory there yet (no save reached it)."""
    if not os.path.lexists(directory):
        note = "does not exist yet" + (f"; {note}" if note else "")
        return _Row(tier, kind, f"{directory} ({note})", [])
    try:
        versions = dir_versions(directory)
    except UsageError as exc:  # not a directory, not readable
        return _Row(tier, kind, str(exc), broken=True)
    return _Row(tier, kind, f"{directory}" + (f" ({note})" if note else ""), versions)


def _config_rows(path: Path) -> list[_Row]:
    try:
        config = Config.from_yaml(path)
    except ConfigError as exc:  # it names the file, the key and the line
        raise UsageError(f"not a config that loads: {exc}") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:  # a binary file: PyYAML's reader refuses it
        raise UsageError(f"{path}: not a config that loads ({exc})") from None
    rows: list[_Row] = []
    for tier in config.tiers:
        if tier.type == "memory" and tier.path is not None:
            rows.extend(_shm_rows(tier, tier.path))
        elif tier.type in _NOT_VISIBLE:
            rows.append(_Row(tier.name, tier.type, _NOT_VISIBLE[tier.type]))
        elif tier.type == "object":
            rows.append(_object_row(tier))
        else:
            rows.extend(_filesystem_rows(tier, config))
    return rows


def _shm_rows(tier: TierConfig, root: Path) -> list[_Row]:
    """A memory tier that outlives its process: its pool's directory; of several ranks, each rank's."""
    ranks = [] if (root / POOL_INFO).exists() or not root.is_dir() else sorted(n for n in os.listdir(root) if _RANK_DIR.fullmatch(n))
    return [_local_row(tier.name, "memory", root / n) for n in ranks] or [_local_row(tier.name, "memory", root)]


def _filesystem_rows(tier: TierConfig, config: Config) -> list[_Row]:
    assert tier.path is not None  # the config requires one
    if tier.scope != "node":
        return [_local_row(tier.name, tier.type, tier.path)]
    nodes = config.distributed.nodes
    if nodes is not None and "{node}" in str(tier.path):  # nodes simulated on this host: every one is here
        paths = [(tier.on_node(str(n)).path, f"node {n}") for n in range(nodes)]
    else:
        from tierckpt.ranks.nodes import node_identity

        paths = [(tier.on_node(node_identity()).path, "this node's directory")]
    rows = []
    for directory, note in paths:
        assert directory is not None
        rows.append(_local_row(tier.name, tier.type, directory, note))
    return rows


def _object_row(tier: TierConfig) -> _Row:
    assert tier.url is not None  # the config requires one
    where = tier.url if tier.endpoint is None else f"{tier.url} at {tier.endpoint}"
    try:
        from tierckpt.storage.s3 import Bucket
        from tierckpt.tiers.object.read import list_versions

        versions = [ListedVersion(None, step, files, files.container) for step, files in list_versions(Bucket(tier))]
    except ImportError as exc:
        return _Row(tier.name, tier.type, f"{where}: cannot be listed ({exc}; pip install 'tierckpt[s3]')", broken=True)
    except (ConfigError, OSError) as exc:
        return _Row(tier.name, tier.type, f"{where}: cannot be listed ({exc})", broken=True)
    return _Row(tier.name, tier.type, where, versions)


def _tally(row: _Row, verify: bool, executor: concurrent.futures.Executor) -> None:
    """Read (with ``verify``: check) each of the row's versions, as ls (verify) does."""
    for version in row.versions or []:
        if verify:
            opened, damage = verify_version(version, executor)
        else:
            try:
                opened, damage = open_parts(version), None
                opened.close()
            except CorruptCheckpointError as exc:
                opened, damage = None, damage_message(exc, version)
        if damage is not None and version.path is not None and not os.path.lexists(version.path):
            continue  # removed while it was read (retention beside the running job): no longer held
        row.held += 1
        step = opened.head.step if opened is not None else version.step
        if step is not None:
            row.newest = step if row.newest is None else max(row.newest, step)
        if opened is not None:
            row.stored += held_bytes(opened.head)
        if damage is not None:
            row.damage.append((version.name, damage))


def _print(rows: list[_Row], verify: bool) -> None:
    header = ["TIER", "TYPE", "VERSIONS", "NEWEST", "STORED"] + (["VERIFIED"] if verify else []) + ["WHERE"]
    table = [header]
    for row in rows:
        if row.versions is None:
            cells = ["-", "-", "-"] + (["-"] if verify else [])
        else:
            cells = [str(row.held), "-" if row.newest is None else str(row.newest), format_size(row.stored)]
            if verify:
                ok = row.held - len(row.damage)
                cells.append("-" if not row.held else f"{ok} OK" + (f", {len(row.damage)} DAMAGED" if row.damage else ""))
        table.append([row.tier, row.type, *cells, row.where])
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1])
    damaged = [(row.tier, name, damage) for row in rows for name, damage in row.damage]
    if damaged:
        tier_width = max(len(t) for t, _, _ in damaged)
        name_width = max(len(n) for _, n, _ in damaged)
        for tier, name, damage in damaged:
            print(f"{tier.ljust(tier_width)}  {name.ljust(name_width)}  DAMAGED  {damage}")
    if verify:
        held = sum(row.held for row in rows)
        print(f"{held} version{'s' if held != 1 else ''}: {held - len(damaged)} OK, {len(damaged)} damaged")
