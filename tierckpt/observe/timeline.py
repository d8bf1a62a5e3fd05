"""An events file drawn as a timeline (``tierckpt timeline``): where each save's time went, lane by lane.

Lanes, top to bottom: ``training`` (each ``save()`` call, a thin bar: what the training loop waited
for), ``capture`` (from the start of a save call until its snapshot was in host memory), then one lane
per tier (each flush a bar; a restore a bar in its own colour), in the order their first flush or
restore began, then tiers with marks only (the memory tier's evictions), in the order first named.
Marks on a lane's centre line: a red x for a failure (flush, capture, delete, restore), grey for a
version deleted by retention, orange for one evicted from host memory, a hollow circle for a save a
tier passed over, a purple tick on ``training`` for a save skipped. Bars carry their step number where
it fits. The x axis is seconds since the first thing drawn began.

Events of several ranks (one file holding them, or several files) get one set of lanes per rank,
headed ``rank N:``; ``tierckpt timeline --rank N`` keeps one rank's.

matplotlib (the extra ``tierckpt[plot]``) is imported only when a timeline is drawn, and only its Agg
canvas is used: no display, no GUI toolkit, no pyplot state.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

from tierckpt.errors import ConfigError
from tierckpt.observe.events import Event

__all__ = ["Drawn", "read_events", "draw_timeline"]

_FIELDS = tuple(f.name for f in fields(Event))  # the keys of each line, as the events file writes them

# What each event draws, a bar or a mark: (its lane, its legend entry). The lane "tier" is the event's
# own tier's; the others are fixed.
_BARS = {"save": ("training", "save call"), "captured": ("capture", "capture"), "flushed": ("tier", "flush"),
         "restored": ("tier", "restore")}
_MARKS = {
    "save_skipped": ("training", "save skipped"),
    "capture_failed": ("capture", "failed"),
    "flush_failed": ("tier", "failed"),
    "delete_failed": ("tier", "failed"),
    "restore_failed": ("tier", "failed"),  # a restore of no tier (the newest failed): on training
    "deleted": ("tier", "deleted"),
    "evicted": ("tier", "evicted"),
    "passed_over": ("tier", "passed over"),
}
_BAR_STYLE = {"save call": "#555555", "capture": "#1f77b4", "flush": "#2ca02c", "restore": "#9467bd"}
_MARK_STYLE: dict[str, dict[str, Any]] = {
    "failed": {"marker": "x", "color": "#d62728", "s": 70, "linewidths": 2.2, "zorder": 5},
    "deleted": {"marker": "v", "color": "#8c8c8c", "s": 40, "zorder": 4},
    "evicted": {"marker": "D", "color": "#ff7f0e", "s": 36, "zorder": 4},
    "passed over": {"marker": "o", "facecolors": "none", "edgecolors": "#333333", "s": 40, "linewidths": 1.2, "zorder": 4},
    "save skipped": {"marker": "|", "color": "#9467bd", "s": 120, "linewidths": 2, "zorder": 4},
}
_THICK, _THIN = 0.6, 0.22  # bar heights, in lanes
_LABEL_PT = 7.0  # step labels' font size
_FIG_WIDTH_IN, _LEFT_IN, _RIGHT_IN = 13.0, 1.6, 1.9  # fixed margins, so a second's width in points is known


@dataclass(frozen=True)
class Drawn:
    """What :func:`draw_timeline` drew: the number of events, the ranks, the lanes (``rank N: lane``
    with several ranks), the seconds the x axis spans, and the file written."""

    events: int
    ranks: tuple[int, ...]
    lanes: tuple[str, ...]
    seconds: float
    path: Path


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of an events file, in its order, each a dict with every field (None where absent).

    A last line without its newline that does not parse is left out: a process killed mid-write leaves
    one. Blank lines are skipped. Event names this version does not know are kept (the drawing skips
    them), so a newer writer's file still reads.

    Raises:
        OSError: the file cannot be read (FileNotFoundError when it is missing).
        ValueError: a line that is not an event (not a JSON object with a number ``time`` and a string
            ``event``), naming the file and the line.

    Example:
        >>> read_events("events-0.jsonl")[0]["event"]  # doctest: +SKIP
        'save'
    """
    lines = Path(path).read_bytes().split(b"\n")
    tail = lines.pop()  # what follows the last newline: empty when the file ends with a whole line
    events = [_parse(line, path, number) for number, line in enumerate(lines, 1) if line.strip()]
    if tail.strip():
        try:
            events.append(_parse(tail, path, len(lines) + 1))
        except ValueError:
            pass  # the half-written line of a killed process
    return events


def _parse(line: bytes, path: str | os.PathLike[str], number: int) -> dict[str, Any]:
    try:
        value = json.loads(line)  # a bad UTF-8 byte raises UnicodeDecodeError, a ValueError too
    except ValueError as exc:
        raise ValueError(f"{os.fspath(path)}, line {number}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{os.fspath(path)}, line {number}: not an event (a JSON {type(value).__name__}, not an object)")
    if not isinstance(value.get("time"), (int, float)) or not isinstance(value.get("event"), str):
        raise ValueError(f"{os.fspath(path)}, line {number}: not an event (needs a number 'time' and a string 'event')")
    return _whole(value)


def _whole(value: dict[str, Any]) -> dict[str, Any]:
    """Every field of an event (None where absent; rank 0 where absent)."""
    event = {key: value.get(key) for key in _FIELDS}
    event["rank"] = event["rank"] if isinstance(event["rank"], int) else 0
    return event


def draw_timeline(events: Sequence[dict[str, Any]], out_path: str | os.PathLike[str], *, title: str | None = None) -> Drawn:
    """Draw ``events`` (as :func:`read_events` returns them, of one run or several ranks) to
    ``out_path``; its suffix names the format (``.png``, ``.svg``, ``.pdf``).

    Args:
        events: the events, in any order; names this version does not draw are left out.
        out_path: the image to write (replaced if it exists).
        title: the figure's title (default: ``tierckpt timeline``).

    Raises:
        ConfigError: matplotlib is not installed (``pip install 'tierckpt[plot]'``).
        ValueError: nothing to draw, or a suffix matplotlib cannot write.
        OSError: ``out_path`` cannot be written.

    Example:
        >>> draw_timeline(read_events("events-0.jsonl"), "timeline.png").lanes  # doctest: +SKIP
        ('training', 'capture', 'nvme', 'pfs')
    """
    drawable = [_whole(e) for e in events if e.get("event") in _BARS or e.get("event") in _MARKS]
    if not drawable:
        raise ValueError("no events to draw")
    out = Path(out_path)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as exc:
        # No "timeline:" of its own: the command line puts "tierckpt timeline:" before it.
        raise ConfigError(
            "matplotlib (which draws the timeline) is not installed: pip install 'tierckpt[plot]' "
            "(in a clone of tierckpt: .venv/bin/pip install matplotlib)"
        ) from exc

    drawable.sort(key=lambda e: e["time"])
    ranks = tuple(sorted({e["rank"] for e in drawable}))
    lanes, rank_rows = _lanes(drawable, ranks)
    origin = min(_start(e) for e in drawable)
    span = max(max(e["time"] for e in drawable) - origin, 1e-3)

    height_in = 1.3 + 0.5 * len(lanes)
    fig = Figure(figsize=(_FIG_WIDTH_IN, height_in), dpi=120)
    FigureCanvasAgg(fig)  # the Agg canvas, whatever the default backend is
    axes_width_in = _FIG_WIDTH_IN - _LEFT_IN - _RIGHT_IN
    ax = fig.add_axes((_LEFT_IN / _FIG_WIDTH_IN, 0.6 / height_in, axes_width_in / _FIG_WIDTH_IN, (height_in - 1.1) / height_in))
    points_per_s = axes_width_in * 72.0 / (span * 1.04)  # the x limits below pad the span by 2 % each side

    bars: dict[str, dict[str, list[tuple[float, float]]]] = {}  # legend entry -> lane -> (start, width)
    marks: dict[str, tuple[list[float], list[float]]] = {}  # legend entry -> (x, y)
    label_end: dict[str, float] = {}  # lane -> where its last step label ends, in seconds
    for e in drawable:
        kind = e["event"]
        if kind in _BARS:
            entry = _BARS[kind][1]
            lane = _lane(e, len(ranks) > 1)
            start, width = _start(e) - origin, e["time"] - _start(e)
            bars.setdefault(entry, {}).setdefault(lane, []).append((start, width))
            if e["step"] is not None:
                _label(ax, e["step"], start, width, lanes[lane], thin=kind == "save", points_per_s=points_per_s,
                       ends=label_end, lane=lane)
        else:
            entry = _MARKS[kind][1]
            xs, ys = marks.setdefault(entry, ([], []))
            xs.append(e["time"] - origin)
            ys.append(lanes[_lane(e, len(ranks) > 1)])

    for entry, per_lane in bars.items():
        thin = entry == "save call"
        h = _THIN if thin else _THICK
        for lane, spans in per_lane.items():
            # A zero-length bar (a clock's resolution) still shows as a sliver.
            spans = [(s, max(w, span * 1e-4)) for s, w in spans]
            ax.broken_barh(spans, (lanes[lane] - h / 2, h), facecolors=_BAR_STYLE[entry], edgecolors="white",
                           linewidth=0.4, alpha=0.9)
    for entry, (xs, ys) in marks.items():
        ax.scatter(xs, ys, **_MARK_STYLE[entry])

    ax.set_yticks(list(lanes.values()), list(lanes))
    ax.set_ylim(len(lanes) - 0.4, -0.6)  # the first lane on top
    ax.set_xlim(-span * 0.02, span * 1.02)
    ax.set_xlabel("seconds since the first event")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for i in range(1, len(lanes)):
        ax.axhline(i - 0.5, color="#eeeeee", linewidth=0.8)
    for row in rank_rows[1:]:
        ax.axhline(row - 0.5, color="#999999", linewidth=1.0)
    ax.set_title(title or "tierckpt timeline", loc="left")

    handles: list[Any] = [Patch(color=_BAR_STYLE[entry], label=entry) for entry in _BAR_STYLE if entry in bars]
    for entry, style in _MARK_STYLE.items():
        if entry in marks:
            face = "none" if style.get("facecolors") == "none" else style.get("color")
            edge = style.get("edgecolors", style.get("color"))
            handles.append(Line2D([], [], linestyle="none", marker=style["marker"], markersize=7, label=entry,
                                  markerfacecolor=face, markeredgecolor=edge, markeredgewidth=style.get("linewidths", 1.0)))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)

    try:
        fig.savefig(out, bbox_inches="tight")
    except ValueError as exc:  # a format matplotlib has no writer for
        raise ValueError(f"{out}: cannot draw this format ({exc})") from None
    return Drawn(len(drawable), ranks, tuple(lanes), span, out)


def _start(event: dict[str, Any]) -> float:
    """When the event began: ``time - seconds`` for a bar, ``time`` for a mark."""
    seconds = event["seconds"] if event["event"] in _BARS else None
    return float(event["time"]) - float(seconds or 0.0)


def _lanes(events: Sequence[dict[str, Any]], ranks: tuple[int, ...]) -> tuple[dict[str, int], list[int]]:
    """Each lane's name and its row (per rank: training, capture, then the tiers), and the first row of
    each rank."""
    names: list[str] = []
    firsts: list[int] = []
    for rank in ranks:
        firsts.append(len(names))
        mine = [e for e in events if e["rank"] == rank]
        wheres = [_where(e) for e in mine]
        fixed = [lane for lane in ("training", "capture") if lane in wheres]
        # Tiers as their first flush (or restore) began: the order data moves down the tiers, where the
        # order of any first event would put a tier that passed over step 1 before the one that took it.
        began = dict.fromkeys(_where(e) for e in sorted(mine, key=_start) if e["event"] in _BARS)
        tiers = [lane for lane in dict.fromkeys([*began, *wheres]) if lane not in ("training", "capture")]
        prefix = f"rank {rank}: " if len(ranks) > 1 else ""
        names += [prefix + lane for lane in fixed + tiers]
    return {name: row for row, name in enumerate(names)}, firsts


def _where(event: dict[str, Any]) -> str:
    """The lane of an event, without its rank: training, capture, or its tier's name."""
    where = (_BARS.get(event["event"]) or _MARKS[event["event"]])[0]
    if where != "tier":
        return where
    return str(event["tier"]) if event["tier"] is not None else "training"


def _lane(event: dict[str, Any], ranked: bool) -> str:
    """The name of an event's lane: headed by its rank when several ranks are drawn."""
    return f"rank {event['rank']}: {_where(event)}" if ranked else _where(event)


def _label(ax: Any, step: int, start: float, width: float, row: int, *, thin: bool, points_per_s: float,
           ends: dict[str, float], lane: str) -> None:
    """The step number inside a thick bar, or above a thin one, if it fits the bar and does not run into
    the lane's previous label (flushes of one tier may overlap)."""
    text = str(step)
    need_s = (len(text) * _LABEL_PT * 0.62 + 3.0) / points_per_s
    if width < need_s and not thin:
        return
    centre = start + width / 2
    if thin:
        need_s = max(need_s, width)
    if centre - need_s / 2 < ends.get(lane, float("-inf")):
        return
    ends[lane] = centre + need_s / 2
    if thin:
        ax.text(centre, row - _THIN / 2 - 0.05, text, ha="center", va="bottom", fontsize=_LABEL_PT, color="#333333")
    else:
        ax.text(centre, row, text, ha="center", va="center", fontsize=_LABEL_PT, color="white", clip_on=True)
