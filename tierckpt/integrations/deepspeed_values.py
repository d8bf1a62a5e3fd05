"""DeepSpeed's own value types in its checkpoint state dicts, stored without pickle.

The dicts DeepSpeed hands its checkpoint engine hold, beside tensors and plain values, a few objects
of its own: ``torch.Size`` parameter shapes, ``fragment_address`` slice mappings, the loss scaler,
the ``ZeroStageEnum``. tierckpt stores plain values only (:mod:`tierckpt.state`), so each such
object is replaced by plain values, and where it was goes *beside* the state, out of band: a list
of ``[key path, kind]``. Nothing in the stored values is read as a type tag, so no user value (a
``client_state`` entry) can pass for one. On restore each kind is rebuilt from a fixed list of
classes, its fields checked to be plain values first: bytes read from storage never choose what to
construct, as an unpickler would.

Any other object is left as it is, for :mod:`tierckpt.state` to refuse naming its key path.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from tierckpt.errors import CorruptCheckpointError

__all__ = ["KINDS", "to_plain", "from_plain"]

_SCALAR = (type(None), bool, int, float, str)


def _scaler_classes() -> dict[str, type]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    return {"LossScaler": LossScaler, "DynamicLossScaler": DynamicLossScaler}


def _fragment_address() -> type:
    from deepspeed.utils.tensor_fragment import fragment_address

    return fragment_address


def _zero_stage() -> type[enum.Enum]:
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return ZeroStageEnum


def _encode(value: Any) -> tuple[str, Any] | None:
    """``(kind, plain value)`` for one of DeepSpeed's objects; None for anything else."""
    kind = type(value)
    if kind is torch.Size:
        return "Size", tuple(value)
    module, name = kind.__module__, kind.__qualname__
    if module == "deepspeed.utils.tensor_fragment" and name == "fragment_address":
        return "fragment_address", {"numel": value.numel, "start": value.start}
    if module == "deepspeed.runtime.fp16.loss_scaler" and name in ("LossScaler", "DynamicLossScaler"):
        return name, dict(vars(value))
    if module == "deepspeed.runtime.zero.config" and name == "ZeroStageEnum":
        return "ZeroStageEnum", int(value)
    return None


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int for v in value):
        raise CorruptCheckpointError(f"a stored {what} is not a sequence of ints: {value!r}")
    return tuple(value)


def _scaler(name: str) -> Callable[[Any], Any]:
    def rebuild(fields: Any) -> Any:
        if not isinstance(fields, dict) or not all(type(k) is str for k in fields):
            raise CorruptCheckpointError(f"a stored {name} is not a dict of its fields")
        for key, value in fields.items():
            if not isinstance(value, _SCALAR) and not isinstance(value, torch.dtype):
                raise CorruptCheckpointError(f"a stored {name}'s field {key!r} is not a plain value: {type(value).__name__}")
        scaler: Any = object.__new__(_scaler_classes()[name])  # its fields as saved, as torch.load would set them
        vars(scaler).update(fields)
        return scaler

    return rebuild


def _address(fields: Any) -> Any:
    if not isinstance(fields, dict) or set(fields) != {"numel", "start"} or not all(type(v) is int for v in fields.values()):
        raise CorruptCheckpointError(f"a stored fragment_address is not {{numel: int, start: int}}: {fields!r}")
    return _fragment_address()(numel=fields["numel"], start=fields["start"])


def _stage(value: Any) -> Any:
    if type(value) is not int:
        raise CorruptCheckpointError(f"a stored ZeroStageEnum is not an int: {value!r}")
    try:
        return _zero_stage()(value)
    except ValueError:
        raise CorruptCheckpointError(f"a stored ZeroStageEnum {value} is no ZeRO stage") from None


# kind -> how to rebuild it from its plain value (checked first)
KINDS: dict[str, Callable[[Any], Any]] = {
    "Size": lambda v: torch.Size(_ints(v, "torch.Size")),
    "fragment_address": _address,
    "LossScaler": _scaler("LossScaler"),
    "DynamicLossScaler": _scaler("DynamicLossScaler"),
    "ZeroStageEnum": _stage,
}


def to_plain(state: Any) -> tuple[Any, list[list[Any]]]:
    """``state`` with DeepSpeed's objects replaced by plain values, and where each was: ``[[path, kind], ...]``
    (``path``: the list of keys and indices from the root). Containers are copied; tensors and
    other leaves are the caller's own objects (no tensor is copied)."""
    kinds: list[list[Any]] = []

    def walk(value: Any, path: list[Any]) -> Any:
        encoded = _encode(value)
        if encoded is not None:
            kinds.append([list(path), encoded[0]])
            return encoded[1]
        kind = type(value)
        if kind is dict or kind is OrderedDict:
            return kind((k, walk(v, [*path, k])) for k, v in value.items())
        if kind is list or kind is tuple:
            return kind(walk(v, [*path, i]) for i, v in enumerate(value))
        return value

    return walk(state, []), kinds


def from_plain(state: Any, kinds: Any) -> Any:
    """Undo :func:`to_plain`: each ``[path, kind]`` of ``kinds`` rebuilt in ``state`` (changed in place).

    Raises:
        CorruptCheckpointError: ``kinds`` is malformed, names an unknown kind or a path that is not
            in ``state``, or a value that is not what its kind stores.
    """
    if not isinstance(kinds, list):
        raise CorruptCheckpointError(f"the stored DeepSpeed value kinds are not a list: {type(kinds).__name__}")
    for entry in kinds:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and entry[1] in KINDS):
            raise CorruptCheckpointError(f"a stored DeepSpeed value kind is malformed or unknown: {entry!r}")
        path, kind = entry
        if not path:  # the state itself was one of them
            state = KINDS[kind](state)
            continue
        parent = state
        try:
            for key in path[:-1]:
                parent = parent[key]
            plain = parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            raise CorruptCheckpointError(f"a stored DeepSpeed {kind} at {path!r} is not in the state") from None
        rebuilt = KINDS[kind](plain)
        if isinstance(parent, tuple):  # tuples are rebuilt around the new item, up from the root
            state = _replace(state, path, rebuilt)
        else:
            parent[path[-1]] = rebuilt
    return state


def _replace(state: Any, path: list[Any], value: Any) -> Any:
    """``state`` with the item at ``path`` replaced, tuples on the way rebuilt."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(state, tuple):
        items = list(state)
        items[head] = _replace(items[head], rest, value)
        return tuple(items)
    state[head] = _replace(state[head], rest, value)
    return state
