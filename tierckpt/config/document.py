"""The whole config document: :class:`Config` (the host pool, the tiers, the ranks), read from a mapping
or a YAML file and written back.

The sections it holds are in :mod:`tierckpt.config.sections` and :mod:`tierckpt.config.tier`; this
module adds the rules between tiers (unique names, where memory and peer tiers may stand), the ways in
(:meth:`Config.from_dict`, :meth:`Config.from_yaml`, :meth:`Config.coerce`) and out
(:meth:`Config.to_dict`, :meth:`Config.to_yaml`), and the table of top-level YAML keys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tierckpt.config.observe import MetricsConfig, read_events, read_metrics, write_metrics
from tierckpt.config.schema import (
    Key,
    optional,
    Site,
    build,
    check_mapping,
    read,
    read_yaml,
    section,
    site,
    write,
)
from tierckpt.config.sections import (
    _DISTRIBUTED_KEYS,
    _HOST_KEYS,
    DistributedConfig,
    HostConfig,
)
from tierckpt.config.tier import TierConfig, _read_tiers, _write_tiers
from tierckpt.errors import ConfigError

__all__ = ["Config"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """A whole configuration: the host pool and the tiers, fastest first.

    Attributes:
        host: the host memory that snapshots are captured into.
        distributed: how ranks coordinate when ``torch.distributed`` is initialized.
        events: the path of a JSON Lines file of events (``{rank}`` replaced by the rank), or None
            (docs/observability.md).
        metrics: a Prometheus endpoint to serve while open (:class:`~tierckpt.config.observe.MetricsConfig`), or None.
        tiers: at least one tier, names unique; a memory tier may only be the first; a peer tier may
            not be the first, and there is at most one. A list is stored as a tuple.

    Raises:
        ConfigError: a value is missing, of the wrong type or out of range, or the tiers break a rule above.

    Example:
        >>> config = Config(tiers=(TierConfig(name="nvme", type="filesystem", path="ckpt"),))
        >>> Config.from_dict(config.to_dict()) == config
        True
    """

    host: HostConfig = HostConfig()
    tiers: tuple[TierConfig, ...]
    distributed: DistributedConfig = DistributedConfig()
    events: str | None = None
    metrics: MetricsConfig | None = None

    def __post_init__(self) -> None:
        at = site()
        if self.events is not None:
            object.__setattr__(self, "events", read_events(self.events, at.at("events")))
        if self.metrics is not None and not isinstance(self.metrics, MetricsConfig):
            raise at.error("metrics", problem=f"{self.metrics!r} is not allowed", hint="use a MetricsConfig, or in YAML a mapping with a port")
        if not isinstance(self.host, HostConfig):
            raise at.error("host", problem=f"{self.host!r} is not allowed", hint="use a HostConfig")
        if isinstance(self.tiers, list):
            object.__setattr__(self, "tiers", tuple(self.tiers))
        if not isinstance(self.tiers, tuple):
            raise at.error("tiers", problem=f"{self.tiers!r} is not a list", hint="use a list of tiers")
        if not self.tiers:
            raise at.error("tiers", problem="no tier is given", hint="a config needs at least one tier")
        index_of: dict[str, int] = {}
        peer: int | None = None
        for index, tier in enumerate(self.tiers):
            if not isinstance(tier, TierConfig):
                raise at.error("tiers", index, problem=f"{tier!r} is not allowed", hint="use a TierConfig")
            if tier.name in index_of:
                problem = f"{tier.name!r} is already the name of tiers[{index_of[tier.name]}]"
                raise at.error("tiers", index, "name", problem=problem, hint="tier names must be unique")
            index_of[tier.name] = index
            if tier.type == "memory" and index > 0:
                hint = "a memory tier can only be the first tier"
                raise at.of_tier(tier.name).error("tiers", index, "type", problem="'memory' is not allowed here", hint=hint)
            if tier.type == "peer" and index == 0:
                hint = "a peer tier copies what the host memory tier captured; put a memory tier first"
                raise at.of_tier(tier.name).error("tiers", index, "type", problem="'peer' is not allowed first", hint=hint)
            if tier.type == "peer" and peer is not None:
                problem = f"'peer' is not allowed twice; tiers[{peer}] is a peer tier already"
                raise at.of_tier(tier.name).error("tiers", index, "type", problem=problem, hint="use at most one peer tier")
            if tier.type == "peer":
                peer = index

    def tier(self, name: str) -> TierConfig:
        """The tier called ``name``.

        Raises:
            KeyError: no tier has that name; the message lists the names there are.

        Example:
            >>> Config(tiers=(TierConfig(name="ram", type="memory"),)).tier("ram").type
            'memory'
        """
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier named {name!r}; the tiers are: {', '.join(t.name for t in self.tiers)}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str | None = None) -> Config:
        """Build a config from a mapping spelled as the YAML file (``capacity``, ``min_interval``, ...).

        ``tiers`` may be a list or a tuple; ``source``, where the mapping came from, is named in errors.

        Raises:
            ConfigError: a key is unknown or missing, or a value is not allowed.

        Example:
            >>> Config.from_dict({"tiers": [{"name": "ram", "type": "memory"}]}).host.on_full
            'block'
        """
        return _read_config(data, Site(source=source))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> Config:
        """Read a config from a YAML file (safe loading; errors name the file and the line of the key).

        Raises:
            ConfigError: the file cannot be read, is empty or is not valid YAML, or the config in it is
                not valid (see :meth:`from_dict`).

        Example:
            >>> Config.from_yaml("tiers.yaml")  # doctest: +SKIP
        """
        source = os.fspath(path)
        try:
            text = Path(source).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read the config file: {exc.strerror or exc}") from exc
        data, lines = read_yaml(text, source)
        return _read_config(data, Site(source=source, lines=lines))

    @classmethod
    def coerce(cls, value: Config | Mapping[str, Any] | str | os.PathLike[str]) -> Config:
        """A ``Config`` as is, a mapping through :meth:`from_dict`, a path through :meth:`from_yaml`.

        Raises:
            ConfigError: the value is none of these, or what it holds is not a valid config.

        Example:
            >>> Config.coerce({"tiers": [{"name": "ram", "type": "memory"}]}).tiers[0].name
            'ram'
        """
        if isinstance(value, Config):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if isinstance(value, (str, os.PathLike)):
            return cls.from_yaml(value)
        hint = "use a Config, a mapping, or the path of a YAML file"
        raise ConfigError(f"config: {value!r} is not allowed; {hint}")

    def to_dict(self) -> dict[str, Any]:
        """The config as a mapping spelled as the YAML file: sizes in bytes, durations in seconds, paths
        as ``str``; ``Config.from_dict(config.to_dict()) == config``."""
        return write(self, _CONFIG_KEYS, skip=frozenset(k for k in ("events", "metrics") if getattr(self, k) is None))

    def to_yaml(self) -> str:
        """The config as YAML text; ``Config.from_yaml`` of a file holding it gives an equal config."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _read_config(data: Any, at: Site) -> Config:
    check_mapping(Config, _CONFIG_KEYS, data, at)
    return build(Config, at, read(_CONFIG_KEYS, data, at))


# One row per YAML key: a new key is a row here, plus its field and its check in the dataclass.
_CONFIG_KEYS = (
    Key("host", "host", *section(HostConfig, _HOST_KEYS)),
    Key("tiers", "tiers", _read_tiers, _write_tiers),
    Key("distributed", "distributed", *section(DistributedConfig, _DISTRIBUTED_KEYS)),
    Key("events", "events", optional(read_events)),
    Key("metrics", "metrics", optional(read_metrics), write_metrics),  # both written only when set: to_dict skips None
)
