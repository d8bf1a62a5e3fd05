"""``tierckpt ls|verify DIR``, ``tierckpt status CONFIG|DIR`` and ``tierckpt export VERSION OUT``: stored
versions without a Checkpointer; ``tierckpt timeline EVENTS... -o FILE``: a run's events file drawn.
``python -m tierckpt`` is the same command line; ``tierckpt --version`` prints ``tierckpt <version>``.

``DIR`` is a filesystem tier's directory (every ``step-<12 digits>`` directory in it is a version) or
one version directory; or a folder holding tier directories (``./checkpoints`` holding ``nvme/`` and
``pfs/``): then each tier directory in it, under a heading; or an object tier's ``s3://bucket/prefix``
(every committed version under it, or the one it names), with ``--endpoint`` for a server other than
AWS and the credentials found as the tier finds them. Nothing is written, and no lock is taken: every
command works beside a running job.

- ``ls`` prints one line per version: step, save (the number of the ``save()`` call that made it,
  across restarts: :mod:`tierckpt.format.lineage`), stored and logical bytes, creation time (local,
  with its UTC offset, as ``status`` prints times), and whether its manifest verifies and its records
  fit its data files (no tensor byte is read; use ``verify`` for that), with notes: ``abandoned`` for
  a version of a direction a save after a rollback left, decided against the newest save among every
  version listed (of every tier directory DIR holds), and ``DAMAGED`` with the damage ``verify``
  found in its bytes when it last checked it.
- ``verify`` checks what a restore checks: the manifest's checksum and fields, the skeleton, every
  record against the data files, and every chunk's checksum, decoding each compressed chunk. It
  prints one line per version, ``OK`` or ``DAMAGED`` with the first damage found (file, key, chunk)
  and how many chunks are damaged. It leaves a mark beside each damaged version (and takes back its
  own mark of one that now verifies): later restores pass a marked version over and retention keeps
  it for inspection (:mod:`tierckpt.format.damage`). A chunk that could not be read (an I/O error) is
  reported but not marked.

- ``status`` prints one line per tier of a config (:mod:`tierckpt.clistatus`) or of ``DIR``: versions
  (and how many are abandoned), the newest step not abandoned, stored bytes, and with ``--verify``
  what ``verify`` finds; with ``--events FILE`` (or a config's ``events:`` file, rank 0's, when it
  exists) each tier's last flush and last failure.

Exit status: 0 when every version is fine (or there is none), 1 when one is damaged, 2 on a usage
error (a missing directory, a folder that is neither a tier directory nor holds one, a bad argument).

``export VERSION OUT [--to safetensors|torch] [--force] [--threads N]`` writes one version's
consolidated state (DTensor shards of every rank put together; every other value as rank 0 saved it)
for tools without tierckpt: a safetensors file (the default, and for an ``OUT`` not ending in ``.pt``
or ``.pth``) or a ``torch.save`` file that ``torch.load(OUT, weights_only=True)`` reads
(:mod:`tierckpt.export`). One tensor at a time is in memory. It shows a progress line on stderr when
that is a terminal and prints one summary line. Exit status: 0 when written; 1 when the version is
damaged (a chunk's checksum) or the output cannot be written, and then no output is left; 2 on a
usage error: ``VERSION`` missing or not a version directory, ``OUT`` existing (``--force`` replaces
it), a value the format cannot hold (a dtype safetensors lacks: use ``--to torch``), named before
anything is written.

``timeline EVENTS... -o FILE [--rank N] [--title T]`` draws events files (config ``events:``; several
files, or one holding several ranks, give one set of lanes per rank; ``--rank N`` keeps rank N's) as
a timeline image, its format named by ``FILE``'s suffix (``.png``, ``.svg``, ``.pdf``):
:mod:`tierckpt.observe.timeline`, with matplotlib (``pip install 'tierckpt[plot]'``). A half-written
last line (a killed job's) is left out. It prints one summary line. Exit status: 0 when drawn; 1 when
``FILE`` cannot be written; 2 on a usage error: an events file missing or holding a line that is not
an event, no event to draw (of rank N), a suffix matplotlib cannot write, matplotlib not installed.

Example::

    $ tierckpt verify ./checkpoints/nvme
    step-000000000100  OK       5 tensors, 1.2 GiB stored, 1.2 GiB logical
    step-000000000200  DAMAGED  data-r00000.bin: checksum mismatch in ['model']['w'] (chunk 3) at bytes ...
    2 versions: 1 OK, 1 damaged
    $ tierckpt export ./checkpoints/nvme/step-000000000100 model.safetensors
    exported step 100: 5 tensors, 1.2 GiB to model.safetensors
    $ tierckpt timeline events-0.jsonl -o timeline.png
    drew 412 events of rank 0 over 96.3 s (lanes training, capture, nvme, pfs) to timeline.png
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from tierckpt._version import __version__
from tierckpt.errors import ConfigError, CorruptCheckpointError, UnsupportedStateError
from tierckpt.format import CommitMarker, Manifest
from tierckpt.format.lineage import Lineage, lineage_of
from tierckpt.observe.progress import Progress, format_size, progress_bar
from tierckpt.observe.timeline import draw_timeline, read_events

# What reads stored versions (cliversions, clistatus, the tiers, the export) imports torch, seconds of
# it: each command imports it in its own function, so that `tierckpt --version` and `--help` do not
# wait for it (tests/test_cli.py checks that they leave torch unimported).
if TYPE_CHECKING:
    from tierckpt import export as exporting
    from tierckpt.cliversions import ListedVersion, OpenedVersion

__all__ = ["main"]

# tierckpt.export.FORMATS, which the parser cannot import without torch; a test keeps the two equal.
_FORMATS = ("safetensors", "torch")


def main(argv: Sequence[str] | None = None, *, prog: str = "tierckpt") -> int:
    """Run the command line; returns the exit status (see the module docstring).

    Args:
        argv: the arguments after the program's name (None: ``sys.argv[1:]``).
        prog: the program's name in usage and error messages (``python -m tierckpt`` passes its own).
    """
    try:
        return _main(argv, prog)
    except BrokenPipeError:
        # The reader went away (`tierckpt ls DIR | head`): stop quietly, as other commands do. Output
        # still buffered for the closed pipe goes to /dev/null, so that exiting does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: Sequence[str] | None, prog: str) -> int:
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.command == "export":
        return _export(parser.prog, args)
    if args.command == "timeline":
        return _timeline(parser.prog, args)
    from tierckpt.clistatus import status as tier_status
    from tierckpt.cliversions import OK, USAGE, OpenedVersion, UsageError, bucket_versions, direction

    try:
        if args.command in ("verify", "status") and args.threads < 1:
            raise UsageError(f"--threads must be at least 1, not {args.threads}")
        if args.command == "status":
            return tier_status(args.target, verify=args.verify, threads=args.threads, endpoint=args.endpoint, events=args.events)
        tiers = [_Tier(None, bucket_versions(args.dir, args.endpoint))] if args.dir.startswith("s3://") else _local_tiers(args.dir)
    except UsageError as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return USAGE
    if len(tiers) == 1 and tiers[0].heading is None and not tiers[0].versions:
        print(f"no versions in {args.dir}")
        return OK
    status = OK
    # ls reads every manifest first: a version is abandoned against the newest save of every tier
    # listed (a rollback's new saves may lie on nvme, the versions it left on pfs).
    listed = [_read(tier.versions) if args.command == "ls" else [] for tier in tiers]
    top = direction(got.head for read in listed for _, got in read if isinstance(got, OpenedVersion))
    for i, tier in enumerate(tiers):
        if tier.heading is not None:
            if i:
                print()
            print(f"{tier.heading}:", flush=True)
        if not tier.versions:
            print("no versions", flush=True)
        elif args.command == "ls":
            status = max(status, _ls(listed[i], top))
        else:
            status = max(status, _verify(tier.versions, args.threads))
    return status


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Look at, check and export tierckpt versions on a filesystem or object tier; draw events files.")
    parser.add_argument("--version", action="version", version=f"tierckpt {__version__}", help="print tierckpt's version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{ls,verify,status,export,timeline}")
    where = "a tier directory, a folder holding tier directories, or one version directory; or s3://bucket/prefix"
    ls = commands.add_parser("ls", help="list versions: step, save, sizes, creation time, manifest valid, abandoned (reads manifests only)")
    ls.add_argument("dir", metavar="DIR", help=where)
    verify = commands.add_parser("verify", help="check every version: manifest, every chunk's checksum, decoding")
    verify.add_argument("dir", metavar="DIR", help=where)
    status = commands.add_parser("status", help="per tier: versions held, newest step, stored bytes; --verify checks them")
    status.add_argument(
        "target", metavar="CONFIG|DIR",
        help="a YAML config (every tier it names, in its order), or a DIR as ls takes it (one line per tier directory)",
    )
    status.add_argument("--verify", action="store_true", help="check every version as verify does; count OK and DAMAGED per tier")
    status.add_argument(
        "--events", metavar="FILE", default=None,
        help="an events file: per tier, its last flush and last failure after the table (default: a config's events file of rank 0, if it exists)",
    )
    export = commands.add_parser("export", help="write one version's consolidated state as a safetensors or a torch file")
    export.add_argument("version", metavar="VERSION", help="a version directory (step-<12 digits>) of a filesystem tier, or s3://bucket/prefix/step-...")
    export.add_argument("out", metavar="OUT", type=Path, help="the file to write")
    export.add_argument(
        "--to", choices=_FORMATS, default=None,
        help="safetensors, or torch (a file torch.load reads); default: torch when OUT ends in .pt or .pth, else safetensors",
    )
    export.add_argument("--force", action="store_true", help="replace OUT if it exists")
    timeline = commands.add_parser("timeline", help="draw events files as a timeline: save calls, captures, flushes, failures per tier")
    timeline.add_argument("events", metavar="EVENTS", nargs="+", help="events files (config events:), of one rank or several")
    timeline.add_argument("-o", "--out", metavar="FILE", type=Path, required=True, help="the image to write: .png, .svg or .pdf")
    timeline.add_argument("--rank", metavar="N", type=int, default=None, help="draw rank N's events only (default: every rank's, one set of lanes each)")
    timeline.add_argument("--title", metavar="T", default=None, help="the image's title (default: the events files' names)")
    for command in (verify, status, export):
        threads = "threads reading and checking chunks (default 2)"
        command.add_argument("--threads", metavar="N", type=int, default=2, help=threads if command is not status else f"with --verify: {threads}")
    for command in (ls, verify, status, export):
        endpoint = "the S3-compatible server of an s3:// URL (default: AWS)"
        command.add_argument("--endpoint", metavar="URL", default=None, help=endpoint if command is not status else f"{endpoint}; a config's tiers name their own")
    return parser


@dataclass(frozen=True)
class _Tier:
    """The versions of one tier directory or prefix; ``heading``: its path when DIR holds several."""

    heading: str | None
    versions: list[ListedVersion]


def _local_tiers(argument: str) -> list[_Tier]:
    """DIR's versions: its own (a tier directory, or a version directory), or those of each tier directory
    it holds (a folder of tiers), each under its path as given; a usage error when it is neither."""
    from tierckpt.cliversions import NO_TIER_HINT, UsageError, dir_versions
    from tierckpt.tiers.stored.find import holds_a_tier, tier_dirs

    directory = Path(argument)
    versions = dir_versions(directory)
    if versions or holds_a_tier(directory):
        return [_Tier(None, versions)]
    inside = tier_dirs(directory)
    if not inside:
        raise UsageError(f"{argument}: {NO_TIER_HINT}")
    return [_Tier(str(directory / name), dir_versions(directory / name)) for name in inside]


def _part(head: Manifest | CommitMarker) -> str | None:
    """What a node-local directory's version holds (``node 1's part: ranks 2, 3 of 4``); None for a whole version."""
    if not isinstance(head, CommitMarker) or head.holds is None:
        return None
    return f"node {head.node}'s part: ranks {', '.join(map(str, head.holds))} of {head.world_size}"


def _dependency(head: Manifest | CommitMarker, needed_by: Sequence[int]) -> str | None:
    """How a version of a tier with ``delta`` depends on others (``delta of step 4``, ``base of 5, 6``)."""
    base = head.base_step
    if base is not None:
        return f"delta of step {base}"
    if needed_by:
        return f"base of {', '.join(map(str, sorted(needed_by)))}"
    return None


_Read: TypeAlias = "list[tuple[ListedVersion, OpenedVersion | CorruptCheckpointError]]"  # a version, opened or why not


def _read(versions: list[ListedVersion]) -> _Read:
    """Each version opened as ls reads it (its manifests, checked against its files), or why not."""
    from tierckpt.cliversions import open_parts

    read: _Read = []
    for version in versions:
        try:
            opened = open_parts(version)
            opened.close()
            read.append((version, opened))
        except CorruptCheckpointError as exc:
            read.append((version, exc))
    return read


def _ls(read: _Read, top: Lineage | None) -> int:
    """Print one tier's versions; ``top``: the newest save of every tier listed (:func:`direction`)."""
    from tierckpt.cliversions import DAMAGED, OK, OpenedVersion, abandoned, damage_message, format_time, held_bytes, marked
    from tierckpt.tiers.stored.delta import dependents

    rows = [("NAME", "STEP", "SAVE", "STORED", "LOGICAL", "CREATED", "MANIFEST")]
    status = OK
    # Of each base, the differential versions listed here written against it.
    needed = dependents([(got.head.step, got.head.base_step, got.head.created) for _, got in read if isinstance(got, OpenedVersion)])
    for version, got in read:
        if isinstance(got, CorruptCheckpointError):
            status = DAMAGED
            try:
                assert version.path is not None
                created = format_time(os.lstat(version.path).st_mtime)
            except (OSError, AssertionError):
                created = "-"
            step = "-" if version.step is None else str(version.step)
            rows.append((version.name, step, "-", "-", "-", created, f"no: {damage_message(got, version)}"))
            continue
        head = got.head
        lineage = lineage_of(head.metadata)
        logical = sum(r.nbytes for r in got.logical_records())
        mark = marked(version, head)
        notes = [
            _part(head), _dependency(head, needed.get(head.step, ())), "abandoned" if abandoned(head, top) else None,
            f"DAMAGED (tierckpt verify, {format_time(mark.at)}): {mark.why}" if mark is not None else None,
        ]
        if mark is not None:
            status = DAMAGED
        verdict = ", ".join(["yes", *(n for n in notes if n)])
        save = "-" if lineage is None else str(lineage.serial)
        rows.append((version.name, str(head.step), save, format_size(held_bytes(head)), format_size(logical), format_time(head.created), verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[6])
    return status


def _verify(versions: list[ListedVersion], threads: int) -> int:
    from tierckpt.cliversions import DAMAGED, OK, held_bytes, keep_verdict, verify_bytes, verify_version

    width = max(len(v.name) for v in versions)
    damaged = 0
    desc = f"verify {len(versions)} version{'s' if len(versions) != 1 else ''}"
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tierckpt-verify") as executor, \
            progress_bar(verify_bytes(versions), desc) as bar:
        for version in versions:
            opened, damage = verify_version(version, executor, bar.update)
            if damage is None:
                assert opened is not None
                logical = sum(r.nbytes for r in opened.logical_records())
                ranks = f" from {opened.head.world_size} ranks" if isinstance(opened.head, CommitMarker) else ""
                part = _part(opened.head)
                ranks = ranks if part is None else f", {part} (complete)"
                bar.print_above(
                    f"{version.name.ljust(width)}  OK       {opened.tensors} tensors{ranks}, "
                    f"{format_size(held_bytes(opened.head))} stored, {format_size(logical)} logical"
                )
            else:
                damaged += 1
                bar.print_above(f"{version.name.ljust(width)}  DAMAGED  {damage}")
            if opened is not None and opened.verdict is not None and (problem := keep_verdict(version, opened.verdict)) is not None:
                bar.print_above(f"{version.name.ljust(width)}  note: {problem}")
    print(f"{len(versions)} version{'s' if len(versions) != 1 else ''}: {len(versions) - damaged} OK, {damaged} damaged")
    return DAMAGED if damaged else OK


def _export(prog: str, args: argparse.Namespace) -> int:
    from tierckpt import export as exporting
    from tierckpt.cliversions import DAMAGED, OK, USAGE

    if args.threads < 1:
        print(f"{prog} export: --threads must be at least 1, not {args.threads}", file=sys.stderr)
        return USAGE
    bar = _ExportBar()
    try:
        summary = exporting.export(
            args.version, args.out, to=args.to, force=args.force, threads=args.threads, progress=bar, endpoint=args.endpoint
        )
    except exporting.OutputExistsError as exc:  # its message names the Python argument
        status, text = USAGE, f"{exc.path} exists; --force replaces it"
    except (FileNotFoundError, FileExistsError, UnsupportedStateError) as exc:  # NoCheckpointError too
        status, text = USAGE, str(exc)
    except CorruptCheckpointError as exc:
        status, text = DAMAGED, str(exc)
    except OSError as exc:
        status, text = DAMAGED, f"cannot write {args.out}: {exc.strerror or exc}"
    else:
        status, text = OK, ""
    finally:
        bar.close()
    if status != OK:
        print(f"{prog} export: {text}", file=sys.stderr)
        return status
    print(f"exported step {summary.step}: {summary.tensors} tensors, {format_size(summary.nbytes)} to {summary.path}")
    return OK


def _timeline(prog: str, args: argparse.Namespace) -> int:
    from tierckpt.cliversions import DAMAGED, OK

    try:
        events = [event for path in args.events for event in read_events(path)]
    except FileNotFoundError as exc:
        return _usage(prog, "timeline", f"{exc.filename}: no such file")
    except (OSError, ValueError) as exc:  # a directory, an unreadable file; a line that is not an event
        return _usage(prog, "timeline", str(exc))
    if args.rank is not None:
        there = sorted({event["rank"] for event in events})
        events = [event for event in events if event["rank"] == args.rank]
        if not events:
            return _usage(prog, "timeline", f"no events of rank {args.rank} (ranks there: {', '.join(map(str, there)) or 'none'})")
    title = args.title or "tierckpt timeline: " + ", ".join(Path(path).name for path in args.events)
    try:
        drawn = draw_timeline(events, args.out, title=title)
    except (ConfigError, ValueError) as exc:  # matplotlib missing; nothing to draw, a format it cannot write
        return _usage(prog, "timeline", str(exc))
    except OSError as exc:
        print(f"{prog} timeline: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return DAMAGED
    ranks = f"rank {drawn.ranks[0]}" if len(drawn.ranks) == 1 else f"ranks {', '.join(map(str, drawn.ranks))}"
    lanes = dict.fromkeys(lane.partition(": ")[2] if len(drawn.ranks) > 1 else lane for lane in drawn.lanes)
    span = f"{drawn.seconds:.1f} s" if drawn.seconds >= 1 else f"{drawn.seconds * 1000:.1f} ms"
    print(f"drew {drawn.events} events of {ranks} over {span} (lanes {', '.join(lanes)}) to {drawn.path}")
    return OK


def _usage(prog: str, command: str, text: str) -> int:
    from tierckpt.cliversions import USAGE

    print(f"{prog} {command}: {text}", file=sys.stderr)
    return USAGE


class _ExportBar:
    """One progress bar over an export's bytes (drawn when stderr is a terminal), made at the first
    tensor's report, which brings the total."""

    def __init__(self) -> None:
        self._bar: Progress | None = None
        self._done = 0

    def __call__(self, p: exporting.ExportProgress) -> None:
        if self._bar is None:
            self._bar = progress_bar(p.total_nbytes, f"export step {p.step}")
        self._bar.update(p.nbytes - self._done)
        self._done = p.nbytes

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
