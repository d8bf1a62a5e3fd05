"""The tier path check: no two tiers may share a directory, or nest one inside the other.

It belongs with the config's validation, but it resolves paths on the file system (symbolic links,
the working directory), so it is a function run where the tiers are built, not a ``__post_init__``
check: a config may be built on one host and used on another.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tierckpt.config.tier import TierConfig
from tierckpt.errors import ConfigError

__all__ = ["check_disjoint_paths"]


def check_disjoint_paths(tiers: Sequence[TierConfig]) -> None:
    """Two tiers in one directory (or one inside the other) would prune each other's versions."""
    seen: list[tuple[str, Path]] = []
    for tier in tiers:
        if tier.path is None:
            continue
        path = Path(tier.path).expanduser().absolute().resolve()
        for name, other in seen:
            if path == other or path in other.parents or other in path.parents:
                raise ConfigError(
                    f"tiers {name!r} and {tier.name!r} share a directory ({other} and {path}); "
                    "each tier needs a directory of its own",
                    tier=tier.name,
                    key=f"tiers.{tier.name}.path",
                )
        seen.append((tier.name, path))
