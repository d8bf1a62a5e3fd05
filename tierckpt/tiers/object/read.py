"""Finding the versions under a bucket prefix, each a :class:`~tierckpt.tiers.stored.source.StoreVersion`
of the bucket read through the same checks as on a file system (:mod:`tierckpt.tiers.stored.read`).

A version's objects are named by its container's listing, so a name a manifest makes up (``..``,
another prefix) is simply missing: nothing outside the container is read.
"""

from __future__ import annotations

from collections.abc import Mapping

from tierckpt.format import MANIFEST_FILE, parse_version_dirname, version_dirname
from tierckpt.storage.s3 import Bucket
from tierckpt.tiers.stored.source import StoreVersion

__all__ = ["containers", "list_versions", "open_bucket"]


def open_bucket(url: str, endpoint: str | None = None) -> Bucket:
    """The bucket prefix ``url`` (``s3://bucket/prefix``) for reading outside a Checkpointer (the CLI,
    export). Raises ConfigError when the URL or the endpoint is malformed."""
    from tierckpt.config import TierConfig

    return Bucket(TierConfig(name="cli", type="object", url=url, endpoint=endpoint))


def list_versions(bucket: Bucket) -> list[tuple[int, StoreVersion]]:
    """Every committed version under the bucket's prefix (a container holding a commit object), by
    step; or, when the prefix is itself a version's container, that one (blocking)."""
    import asyncio

    listing = asyncio.run(bucket.listing())
    own = parse_version_dirname(bucket.prefix.rpartition("/")[2])
    if own is not None and MANIFEST_FILE in listing:
        parent = open_bucket(bucket.url.rpartition("/")[0], bucket.endpoint)
        return [(own, StoreVersion(parent, version_dirname(own), listing))]
    return [(step, StoreVersion(bucket, version_dirname(step), names)) for step, names in containers(listing).items() if MANIFEST_FILE in names]


def containers(listing: Mapping[str, int]) -> dict[int, dict[str, int]]:
    """A prefix's listing (key -> size) grouped by version container (``step-...``), by step: each
    container's object names -> sizes. Keys outside a container, or deeper, are no version's."""
    found: dict[int, dict[str, int]] = {}
    for key, size in listing.items():
        container, _, name = key.partition("/")
        step = parse_version_dirname(container)
        if step is not None and name and "/" not in name:
            found.setdefault(step, {})[name] = size
    return dict(sorted(found.items()))
