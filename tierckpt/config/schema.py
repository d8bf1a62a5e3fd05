"""The machinery under :mod:`tierckpt.config`: key tables, checks that say where a value came from.

A section of the config is a frozen dataclass plus a table of :class:`Key` rows, one per YAML key.
:func:`section` turns a table into a reader (a mapping spelled as YAML into the dataclass) and a writer
(the way back). A :class:`Site` is where the section being read sits: its key path, and the file and
the line of each key, so that an error can say ``tiers[1].flush.every: 0 is not allowed (in tiers.yaml,
line 12); use an integer >= 1``.

The dataclasses validate themselves in ``__post_init__``; :func:`build` lets them know the site they
are built at, and :func:`site` is how they ask for it.
"""

from __future__ import annotations

import contextvars
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from tierckpt.errors import ConfigError
from tierckpt.units import parse_duration, parse_size

KeyPath = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Site:
    """A section being read: its key path, and the file and the key lines it came from."""

    path: KeyPath = ()
    source: str | None = None
    lines: Mapping[KeyPath, int] = field(default_factory=dict)
    tier: str | None = None  # the name of the tier this section belongs to, named in errors

    def at(self, *keys: Any) -> Site:
        """The site of a key or an item inside this section."""
        return replace(self, path=self.path + keys)

    def of_tier(self, name: object) -> Site:
        """This site, inside the tier called ``name`` (ignored unless it is a usable name)."""
        return replace(self, tier=name) if isinstance(name, str) and name else self

    def key(self, *keys: Any) -> str:
        """The key path as written in messages: ``tiers[1].flush.every``."""
        text = ""
        for part in self.path + keys:
            text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
        return text

    def where(self, *keys: Any) -> str:
        """``in tiers.yaml, line 12``: the line of the key, or of the nearest key that encloses it."""
        full = self.path + keys
        line = next((self.lines[full[:n]] for n in range(len(full), 0, -1) if full[:n] in self.lines), None)
        parts = [f"tier {self.tier!r}"] if self.tier else []
        parts += [f"in {self.source}"] if self.source else []
        parts += [f"line {line}"] if line else []
        return ", ".join(parts)

    def error(self, *keys: Any, problem: str, hint: str | None = None) -> ConfigError:
        """``key: problem (tier 'name', in file, line n); hint``, with ``key`` and ``tier`` set on the error."""
        key = self.key(*keys)
        where = self.where(*keys) if key else ""
        message = f"{key or self.source or 'config'}: {problem}"
        message += f" ({where})" if where else ""
        message += f"; {hint}" if hint else ""
        return ConfigError(message, key=key or None, tier=self.tier)


# The loader sets the site of the section it builds, so that the section's own __post_init__ can name
# the full key path and its line; a section built directly in code names its keys from its own name.
_BUILDING: contextvars.ContextVar[Site | None] = contextvars.ContextVar("tierckpt_config_site", default=None)


def site(*section: str) -> Site:
    """The site of the section being validated: where the loader builds it, else ``section`` itself."""
    building = _BUILDING.get()
    return Site(path=section) if building is None else building


def build(cls: type[Any], at: Site, values: Mapping[str, Any]) -> Any:
    """``cls(**values)``, with errors from its ``__post_init__`` pointing at ``at``."""
    token = _BUILDING.set(at)
    try:
        return cls(**values)
    finally:
        _BUILDING.reset(token)


def check_int(
    at: Site, key: str, value: object, *, low: int, high: int | None = None, optional: bool = False
) -> None:
    """An ``int`` (not a ``bool``) in ``low..high``; ``None`` too when ``optional``."""
    if optional and value is None:
        return
    allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    allowed += ", or null" if optional else ""
    if not isinstance(value, int) or isinstance(value, bool):
        raise at.error(key, problem=f"{value!r} is not an integer", hint=f"use {allowed}")
    if value < low or (high is not None and value > high):
        raise at.error(key, problem=f"{value!r} is not allowed", hint=f"use {allowed}")


def check_bool(at: Site, key: str, value: object) -> None:
    """``True`` or ``False``."""
    if not isinstance(value, bool):
        raise at.error(key, problem=f"{value!r} is not allowed", hint="use true or false")


def check_seconds(at: Site, key: str, value: object, *, positive: bool = False, optional: bool = False) -> float | None:
    """A finite number of seconds, ``>= 0`` (``> 0`` when ``positive``), as a ``float``; ``None`` too when ``optional``.

    Durations read from YAML were parsed already (``"30s"``); this checks what code passes in.
    """
    if optional and value is None:
        return None
    allowed = "a number of seconds > 0" if positive else "a number of seconds >= 0"
    allowed += ", or null" if optional else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise at.error(key, problem=f"{value!r} is not allowed", hint=f"use {allowed}")
    if positive and value == 0:
        hint = "use a duration > 0, e.g. 10m" + (f", or leave {key} out" if optional else "")
        raise at.error(key, problem="0 is not allowed", hint=hint)
    return float(value)


def check_choice(at: Site, key: str, value: object, choices: tuple[str, ...]) -> None:
    """One of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise at.error(key, problem=f"{value!r} is not allowed", hint=f"use one of: {', '.join(choices)}")


def check_path(at: Site, key: str, value: object) -> Path:
    """A non-empty ``str`` or ``os.PathLike``, as a ``Path`` with ``~`` expanded."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text:
        raise at.error(key, problem=f"{value!r} is not allowed", hint="use a directory, e.g. ./checkpoints")
    try:
        return Path(text).expanduser()
    except RuntimeError as exc:  # "~user" where that user has no home directory
        raise at.error(key, problem=f"{value!r} cannot be expanded", hint="use a directory without '~'") from exc


def _as_given(value: Any, *_: Any) -> Any:
    return value


@dataclass(frozen=True, slots=True)
class Key:
    """A YAML key of a section: the field it fills, how its value is read, and how it is written back."""

    name: str
    attr: str
    read: Callable[[Any, Site], Any] = _as_given
    write: Callable[[Any], Any] = _as_given


def is_default(section: object, key: Key) -> bool:
    """Whether the section holds its field's default for ``key`` (``False`` for a required field)."""
    default = next(f.default for f in fields(section) if f.name == key.attr)  # type: ignore[arg-type]
    return default is not MISSING and getattr(section, key.attr) == default


def check_mapping(cls: type[Any], keys: tuple[Key, ...], data: Any, at: Site) -> None:
    """A mapping with known keys only, holding every key whose field ``cls`` requires."""
    names = [key.name for key in keys]
    if not isinstance(data, Mapping):
        raise at.error(problem=f"{data!r} is not a mapping", hint=f"use a mapping with keys: {', '.join(names)}")
    for name in data:
        if name not in names:
            shown = name if isinstance(name, str) else repr(name)
            raise at.error(shown, problem="unknown key", hint=f"allowed: {', '.join(names)}")
    defaults = {f.name: f.default for f in fields(cls)}
    required = [key.name for key in keys if defaults[key.attr] is MISSING]
    for name in required:
        if name not in data:
            raise at.error(name, problem="missing", hint=f"required here: {', '.join(required)}")


def read(keys: tuple[Key, ...], data: Mapping[str, Any], at: Site) -> dict[str, Any]:
    """The dataclass fields filled by the keys present in ``data``."""
    return {key.attr: key.read(data[key.name], at.at(key.name)) for key in keys if key.name in data}


def write(section: Any, keys: tuple[Key, ...], *, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The section as a mapping spelled as YAML, without the keys in ``skip``."""
    return {key.name: key.write(getattr(section, key.attr)) for key in keys if key.name not in skip}


def _parsed(parse: Callable[..., Any], value: Any, at: Site) -> Any:
    """``parse`` (a :mod:`tierckpt.units` parser) of the key's value; its error names the key's tier."""
    try:
        return parse(value, key=at.key(), where=at.where())
    except ConfigError as exc:
        exc.tier = at.tier
        raise


def read_size(value: Any, at: Site) -> int:
    """A size key's value in bytes (``4GiB``, see :mod:`tierckpt.units`)."""
    return int(_parsed(parse_size, value, at))


def read_duration(value: Any, at: Site) -> float:
    """A duration key's value in seconds (``30s``, see :mod:`tierckpt.units`)."""
    return float(_parsed(parse_duration, value, at))


def optional(reader: Callable[[Any, Site], Any]) -> Callable[[Any, Site], Any]:
    """``reader`` for a key whose default is null: an explicit null stays ``None``."""
    return lambda value, at: None if value is None else reader(value, at)


def section(
    cls: type[Any], keys: tuple[Key, ...]
) -> tuple[Callable[[Any, Site], Any], Callable[[Any], Any]]:
    """The reader and the writer of a nested section, for the ``read`` and ``write`` of its :class:`Key`."""

    def read_section(data: Any, at: Site) -> Any:
        check_mapping(cls, keys, data, at)
        return build(cls, at, read(keys, data, at))

    return read_section, lambda value: write(value, keys)


def read_yaml(text: bytes, source: str) -> tuple[Any, dict[KeyPath, int]]:
    """Safe-load one YAML document, and map the key path of every key and list item to its line.

    Raises:
        ConfigError: the text is empty, is not valid YAML, or repeats a key in a mapping.
    """
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            raise ConfigError(f"{source}: the file is empty; a config needs at least a list of tiers")
        lines: dict[KeyPath, int] = {}
        return _to_python(loader, root, Site(source=source, lines=lines)), lines
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{source}: not valid YAML: {exc.problem or exc.context}{where}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    finally:
        loader.dispose()


def _to_python(loader: yaml.SafeLoader, node: yaml.Node, at: Site) -> Any:
    """The value of ``node``, recording in ``at.lines`` the line of every key and item under it."""
    lines: dict[KeyPath, int] = at.lines  # type: ignore[assignment]
    if isinstance(node, yaml.ScalarNode):
        return loader.construct_object(node, deep=True)
    if len(at.path) > 32:  # an alias inside itself would never end
        raise at.error(problem="nested too deeply", hint="a config is a few levels deep; check the YAML aliases")
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[at.path + (index,)] = item.start_mark.line + 1
        return [_to_python(loader, item, at.at(index)) for index, item in enumerate(node.value)]
    assert isinstance(node, yaml.MappingNode)  # a composed document holds no other kind of node
    # PyYAML keeps the last of two equal keys; a repeated key in a config is a mistake, so say so.
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            raise at.error(problem=f"a key is a YAML {key_node.id}", hint="keys are plain names")
        if key_node.tag != "tag:yaml.org,2002:merge":
            key = loader.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                lines[at.path + (key,)] = line
                raise at.error(key, problem=f"given twice, first on line {seen[key]}", hint="keep one")
            seen[key] = line
    loader.flatten_mapping(node)  # resolves "<<: *alias" merge keys; keys written here win
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node)
        lines[at.path + (key,)] = key_node.start_mark.line + 1
        mapping[key] = _to_python(loader, value_node, at.at(key))
    return mapping
