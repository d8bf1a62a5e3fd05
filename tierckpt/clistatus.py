"""``tierckpt status CONFIG|DIR [--verify] [--threads N] [--events FILE]``: one line per tier, what it holds now.

For each tier: its name, its type, the number of versions it holds (with how many are differential
and how many abandoned: of a direction a save after a rollback left, :mod:`tierckpt.format.lineage`,
decided against the newest save of every tier listed), the newest step of the direction being
trained (the highest step not abandoned), the bytes they store, and with ``--verify`` how many
verify and how many are damaged (each version checked as ``tierckpt verify`` checks it:
:func:`tierckpt.cliversions.verify_version`, leaving the same marks). The damaged versions follow
the table, one line each, as ``verify`` prints them; without ``--verify``, those ``verify`` marked
damaged when it last checked them (:mod:`tierckpt.format.damage`).

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

With an events file (``--events FILE``; for a ``CONFIG`` with an ``events:`` key and no ``--events``,
rank 0's file of it, when it exists), a second table follows: per tier, when its last flush ended
(local time with its UTC offset, as ``ls`` prints times, and its step) and its last failure
(``flush_failed`` or ``delete_failed``: time, step, error), as the file recorded them. What a running job already did: a recorded failure does not
change the exit status (a later flush may have gone through; the first table says what is held).

Nothing is written but ``--verify``'s damage marks, and no tier's lock is taken, so it runs beside a training job; a version that
retention removes while it is being read is left out rather than reported damaged.

Exit status: 0 when every version read is fine, 1 when one is damaged (a manifest that does not
read, a version marked damaged, or with ``--verify`` any damage) or a tier cannot be listed, 2 on a usage error (a missing
path, a config that does not load, a folder that is neither a tier directory nor holds one, an
``--events`` file missing or holding a line that is not an event).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tierckpt.cliversions import (
    DAMAGED, NO_TIER_HINT, OK, ListedVersion, UsageError, abandoned, bucket_versions, damage_message,
    dir_versions, direction, format_size, format_time, held_bytes, keep_verdict, marked, open_parts, verify_version,
)
from tierckpt.config import Config, TierConfig
from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.format import CommitMarker, Manifest, parse_version_dirname
from tierckpt.observe.eventfile import events_path
from tierckpt.observe.timeline import read_events
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
    newest: int | None = None  # the highest step not abandoned (:func:`_mark`)
    stored: int = 0
    deltas: int = 0  # differential versions among those held
    abandoned: int = 0  # versions of a direction a save after a rollback left (:func:`_mark`)
    heads: list[Manifest | CommitMarker] = field(default_factory=list)  # of the versions whose manifests read
    unread: list[int] = field(default_factory=list)  # steps of those whose manifests did not: never known abandoned
    damage: list[tuple[str, str]] = field(default_factory=list)  # (version, what is damaged)
    notes: list[str] = field(default_factory=list)  # what verify could not leave for later processes


@dataclass
class _Recorded:
    """What an events file says of each tier: its last ``flushed`` event and its last failure; or,
    for a config's file that does not read, why (``problem``)."""

    path: Path
    flushed: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed: dict[str, dict[str, Any]] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)
    problem: str | None = None


_FAILURES = ("flush_failed", "delete_failed")


def status(target: str, *, verify: bool, threads: int, endpoint: str | None, events: str | None = None) -> int:
    """Print the table for ``target``; returns the exit status (see the module docstring).

    Args:
        target: a YAML config file, a directory (a tier's, a folder of tiers, a version's), or an
            ``s3://bucket/prefix``.
        verify: check every chunk of every version, as ``tierckpt verify`` does.
        threads: threads reading and checking chunks (>= 1).
        endpoint: the S3-compatible server of an ``s3://`` target (a config's tiers name their own).
        events: an events file: each tier's last flush and failure follow the table (None: a config's
            ``events:`` file of rank 0, where there is one).

    Raises:
        tierckpt.cliversions.UsageError: before anything is printed, when ``target`` is none of those, or
            ``events`` is missing or not an events file (the command line prints it and exits 2).

    Example: ``tierckpt status ./checkpoints`` runs ``status("./checkpoints", verify=False, threads=2,
    endpoint=None)``.
    """
    rows, configured = _rows(target, endpoint)
    recorded = _recorded(events, configured)
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tierckpt-status") as executor:
        for row in rows:
            _tally(row, verify, executor)
    _mark(rows)
    _print(rows, verify)
    if recorded is not None:
        _print_recorded(recorded, rows)
    return DAMAGED if any(row.damage or row.broken for row in rows) else OK


def _rows(target: str, endpoint: str | None) -> tuple[list[_Row], str | None]:
    """The rows of ``target``, and a config's ``events:`` path (None for a directory or a prefix)."""
    if target.startswith("s3://"):
        name = target.rstrip("/").rpartition("/")[2] or target
        return [_Row(name, "object", target, bucket_versions(target, endpoint))], None
    path = Path(target)
    if not path.exists():
        raise UsageError(f"{target}: no such file or directory")
    if not path.is_dir():
        return _config_rows(path)
    if dir_versions(path) or holds_a_tier(path):
        resolved = path.resolve()
        own = resolved.parent if parse_version_dirname(resolved.name) is not None else resolved
        return [_local_row(own.name, _dir_type(own), path)], None
    names = tier_dirs(path)
    if not names:
        raise UsageError(f"{target}: {NO_TIER_HINT}, or a YAML config")
    return [_local_row(name, _dir_type(path / name), path / name) for name in names], None


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


def _config_rows(path: Path) -> tuple[list[_Row], str | None]:
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
    return rows, config.events


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
            if opened is not None and opened.verdict is not None and (problem := keep_verdict(version, opened.verdict)) is not None:
                row.notes.append(problem)
        else:
            try:
                opened, damage = open_parts(version), None
                opened.close()
                mark = marked(version, opened.head)
                damage = None if mark is None else mark.text
            except CorruptCheckpointError as exc:
                opened, damage = None, damage_message(exc, version)
        if damage is not None and version.path is not None and not os.path.lexists(version.path):
            continue  # removed while it was read (retention beside the running job): no longer held
        row.held += 1
        if opened is not None:
            row.heads.append(opened.head)
            row.stored += held_bytes(opened.head)
            row.deltas += opened.head.base_step is not None
        elif version.step is not None:
            row.unread.append(version.step)
        if damage is not None:
            row.damage.append((version.name, damage))


def _mark(rows: list[_Row]) -> None:
    """Count each row's abandoned versions and find its newest step not abandoned, against the newest
    save of every row: a rollback's new saves may lie on one tier, the versions it left on another."""
    top = direction(h for row in rows for h in row.heads)
    for row in rows:
        live = [h.step for h in row.heads if not abandoned(h, top)]
        row.abandoned = len(row.heads) - len(live)
        row.newest = max(live + row.unread, default=None)


def _count(row: _Row) -> str:
    """The VERSIONS cell: how many, and of them how many differential and abandoned (``4 (2 deltas, 1 abandoned)``)."""
    notes = []
    if row.deltas:
        notes.append(f"{row.deltas} delta{'s' if row.deltas != 1 else ''}")
    if row.abandoned:
        notes.append(f"{row.abandoned} abandoned")
    return f"{row.held} ({', '.join(notes)})" if notes else str(row.held)


def _print(rows: list[_Row], verify: bool) -> None:
    header = ["TIER", "TYPE", "VERSIONS", "NEWEST", "STORED"] + (["VERIFIED"] if verify else []) + ["WHERE"]
    table = [header]
    for row in rows:
        if row.versions is None:
            cells = ["-", "-", "-"] + (["-"] if verify else [])
        else:
            cells = [_count(row), "-" if row.newest is None else str(row.newest), format_size(row.stored)]
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
    for row in rows:
        for note in row.notes:
            print(f"{row.tier}: note: {note}")
    if verify:
        held = sum(row.held for row in rows)
        print(f"{held} version{'s' if held != 1 else ''}: {held - len(damaged)} OK, {len(damaged)} damaged")


def _recorded(given: str | None, configured: str | None) -> _Recorded | None:
    """The events file's last flush and failure per tier: ``given`` (a usage error when it is missing or
    not an events file), else rank 0's file of a config's ``events:`` where it exists (where it does not
    read, the reason is printed in place of the table: the command was not asked for it)."""
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise UsageError(f"--events {given}: no such file")
    elif configured is not None:
        path = events_path(configured, 0)  # relative to here, as the Checkpointer would open it
        if not path.is_file():
            return None
    else:
        return None
    recorded = _Recorded(path)
    try:
        events = read_events(path)
    except (OSError, ValueError) as exc:
        if given is not None:
            raise UsageError(f"--events {exc}") from None
        recorded.problem = str(exc)
        return recorded
    for event in events:
        tier, kind = event["tier"], event["event"]
        latest = recorded.flushed if kind == "flushed" else recorded.failed if kind in _FAILURES else None
        if latest is None or tier is None:
            continue
        recorded.ranks.add(event["rank"])
        if tier not in latest or event["time"] >= latest[tier]["time"]:  # the later line wins a tie
            latest[tier] = event
    return recorded


def _print_recorded(recorded: _Recorded, rows: list[_Row]) -> None:
    print()
    if recorded.problem is not None:
        print(f"events: {recorded.path} cannot be read: {recorded.problem}")
        return
    print(f"events: {recorded.path}")
    ranked = len(recorded.ranks) > 1  # one file several ranks wrote: say whose
    tiers = dict.fromkeys([row.tier for row in rows] + list(recorded.flushed) + list(recorded.failed))
    table = [["TIER", "LAST FLUSHED", "LAST FAILURE"]]
    for tier in tiers:
        flushed, failed = recorded.flushed.get(tier), recorded.failed.get(tier)
        last_flush = "-" if flushed is None else f"{format_time(flushed['time'])} step {_step(flushed, ranked)}"
        last_failure = "-"
        if failed is not None:
            error = " ".join(str(failed["error"] or "no error recorded").split())  # one line
            last_failure = f"{format_time(failed['time'])} step {_step(failed, ranked)} {failed['event']}: {error}"
        table.append([tier, last_flush, last_failure])
    widths = [max(len(line[i]) for line in table) for i in range(2)]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1])


def _step(event: dict[str, Any], ranked: bool) -> str:
    step = "-" if event["step"] is None else str(event["step"])  # None: the flusher itself failed
    return f"{step} (rank {event['rank']})" if ranked else step
