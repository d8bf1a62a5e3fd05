"""What a DeepSpeed ``save_dir`` holds under tierckpt: a directory of pointers per tag, and ``latest``.

DeepSpeed finds a checkpoint by its files: ``load_checkpoint`` reads the tag from ``save_dir/latest``
and globs ``save_dir/<tag>/*model_states.pt``. The state itself lives in the tiers; once a tag's step
is durable on every rank, ``save_dir/<tag>/`` gets, at each file name DeepSpeed saved on any rank, a
small JSON pointer naming the step (:mod:`tierckpt.integrations.pointer`), and then, for a save made
with ``save_latest``, ``save_dir/latest`` is replaced atomically by the tag. So after a crash
``latest`` names only a tag whose step can be restored, and DeepSpeed's own reading of it (and of its
glob) works unchanged; what reads the files with ``torch.load`` (``zero_to_fp32.py``) cannot
follow a pointer (``tierckpt export`` gives what it gives: :mod:`tierckpt.export.zero`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable

from tierckpt.errors import CorruptCheckpointError, NoCheckpointError
from tierckpt.integrations.pointer import aside_name, read_pointer, remove_leftovers, write_pointer
from tierckpt.storage.posix import fsync_dir, replace_durably

__all__ = ["LATEST", "check_tag", "every_rank_names", "latest", "publish", "refuse_unknown_latest", "tag_step", "tags", "written"]

LATEST = "latest"  # DeepSpeed's name for the file naming the newest tag
_TMP_PREFIX = ".tierckpt-latest-"
_RANK0 = re.compile(r"^((?:bf16_)?zero_pp_rank_)0(_)")  # DeepSpeed's per-rank file names, as rank 0 has them


def check_tag(tag: str) -> None:
    """Raise ``ValueError`` for a tag that is not one directory name (tierckpt makes ``save_dir/<tag>``)."""
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or tag.startswith("."):
        raise ValueError(f"DeepSpeed checkpoint tag {tag!r}: tierckpt needs a tag that is one directory name (no '/', not starting with '.')")


def every_rank_names(rank0_names: Iterable[str], world: int) -> list[str]:
    """The file names every data-parallel rank saved for a tag, from rank 0's: a per-rank file
    (``zero_pp_rank_0_…``) once per rank, the others once."""
    names: list[str] = []
    for name in rank0_names:
        if _RANK0.match(name):
            names.extend(_RANK0.sub(rf"\g<1>{r}\g<2>", name) for r in range(world))
        else:
            names.append(name)
    return names


def publish(save_dir: Path, tag: str, step: int, tier: str, names: Iterable[str], *, latest: bool) -> None:
    """Make ``save_dir/<tag>/<name>`` a pointer naming ``step`` (durable on ``tier``) for each of
    ``names``, and then, with ``latest``, ``save_dir/latest`` name ``tag``; each file atomically and
    durably. The model-states files go last: their pointer is the one a load reads (:func:`tag_step`),
    so a crash half-way through rewriting a tag still names one step."""
    directory = save_dir / tag
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        fsync_dir(save_dir)
    for name in sorted(names, key=lambda n: n.endswith("model_states.pt")):
        write_pointer(directory / name, step, tier)
    if latest:
        replace_durably(save_dir / LATEST, tag.encode(), save_dir / aside_name(_TMP_PREFIX, "tmp"))
        remove_leftovers(save_dir, _TMP_PREFIX)


def written(save_dir: Path, tag: str) -> bool:
    """Whether ``save_dir/<tag>/`` holds a model-states pointer (what DeepSpeed's load globs for)."""
    directory = save_dir / tag
    return directory.is_dir() and any(p.name.endswith("model_states.pt") for p in directory.iterdir())


def tag_step(save_dir: Path, tag: str) -> int:
    """The step ``save_dir/<tag>/`` names (its first model-states pointer, as DeepSpeed globs them).

    Raises:
        NoCheckpointError: there is no such tag directory, or it holds no model-states file.
        CorruptCheckpointError: the file is not a pointer (a checkpoint of DeepSpeed's own engine, say).
    """
    directory = save_dir / tag
    names = sorted(p.name for p in directory.iterdir() if p.name.endswith("model_states.pt")) if directory.is_dir() else []
    if not names:
        raise NoCheckpointError(f"{directory}: no checkpoint of tag {tag!r} here")
    try:
        return read_pointer(directory / names[0])
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{exc}; a tag saved by DeepSpeed's own checkpoint engine loads without tierckpt.integrations.deepspeed.attach"
        ) from None


def latest(save_dir: Path) -> str | None:
    """The tag ``save_dir/latest`` names, or None where there is none."""
    try:
        return (save_dir / LATEST).read_text().strip() or None
    except OSError:
        return None


def tags(save_dir: Path) -> list[str]:
    """The tag directories under ``save_dir`` that hold pointers, for an error message."""
    return sorted(p.name for p in save_dir.iterdir() if written(save_dir, p.name)) if save_dir.is_dir() else []


def refuse_unknown_latest(save_dir: Path) -> None:
    """Raise when the tiers hold nothing but ``save_dir/latest`` names a tag: starting over would throw
    that training away without a word.

    Raises:
        NoCheckpointError: naming the tag, and what to do (a tag DeepSpeed's own engine saved is
            loaded once without tierckpt; a tag of tierckpt's, with the tier config that saved it).
    """
    tag = latest(save_dir)
    if tag is None:
        return
    try:
        step = tag_step(save_dir, tag)
    except CorruptCheckpointError:
        raise NoCheckpointError(
            f"{save_dir / LATEST} names tag {tag!r}, saved by DeepSpeed's own checkpoint engine (torch.save files), and the "
            "tiers hold no checkpoint: tierckpt does not unpickle those files. Load it once without attach(), then save through tierckpt"
        ) from None
    except NoCheckpointError:
        step = None
    raise NoCheckpointError(
        f"{save_dir / LATEST} names tag {tag!r}{'' if step is None else f' (step {step})'}, but no tier holds a checkpoint: "
        "attach() the tier config that saved it, or remove the latest file to start over", step=step)
