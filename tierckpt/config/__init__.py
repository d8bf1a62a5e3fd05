"""Configuration: frozen dataclasses for the host pool and the tiers, read from YAML or a mapping.

YAML is only a serialisation of the dataclasses. Keys are spelled as in YAML (``capacity``,
``min_interval``) and fill fields that carry their unit in their name (``capacity_bytes``,
``min_interval_s``); sizes and durations may be written with units (:mod:`tierckpt.units`). The
example file is in ARCHITECTURE.md, section 6.

Every section validates itself in ``__post_init__`` and raises :class:`~tierckpt.errors.ConfigError`
naming the key as written in YAML (``tiers[2].flush.every``), the value and what is allowed, and, when
the value came from a file, the file and the line. Unknown keys are errors too.

Tier paths are kept as given, with ``~`` expanded; relative paths are resolved by the user of the config,
against the working directory.

The package, each module importing only those before it:

- :mod:`~tierckpt.config.schema`: key tables, checks that name the key, the file and the line, YAML
  reading with line numbers;
- :mod:`~tierckpt.config.sections`: ``host``, ``distributed``, and a tier's ``flush``, ``keep`` and
  ``compression`` sections;
- :mod:`~tierckpt.config.observe`: ``events`` and the ``metrics`` section (where a running Checkpointer reports);
- :mod:`~tierckpt.config.tier`: :class:`TierConfig` and the ``tiers`` list;
- :mod:`~tierckpt.config.document`: :class:`Config`, from and to a mapping or YAML;
- :mod:`~tierckpt.config.paths`: :func:`check_disjoint_paths`, the check that needs the file system.
"""

from __future__ import annotations

from tierckpt.config.document import Config
from tierckpt.config.observe import MetricsConfig
from tierckpt.config.paths import check_disjoint_paths
from tierckpt.config.sections import (
    CompressionConfig,
    DeltaConfig,
    DistributedConfig,
    FlushPolicy,
    HostConfig,
    KeepPolicy,
)
from tierckpt.config.tier import TierConfig

__all__ = ["Config", "HostConfig", "TierConfig", "FlushPolicy", "KeepPolicy", "CompressionConfig", "DistributedConfig", "MetricsConfig", "check_disjoint_paths"]
