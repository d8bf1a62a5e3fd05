"""Reading a version of an object tier: its objects as :class:`~tierckpt.tiers.fsread.VersionFiles`.

The same checks as on a file system (:mod:`tierckpt.tiers.fsread`): a manifest is untrusted, its size is
checked before it is read, every record is checked against the sizes of the data objects it names
(:func:`~tierckpt.tiers.fscheck.check_records`) before anything is allocated, and each chunk is
verified as it lands. Object names come from the listing of the version's container, so a name a
manifest makes up (``..``, another prefix) is simply missing: nothing outside the container is read.
A read that fails is reported as a damaged copy, and restore moves on to the next candidate.
"""

from __future__ import annotations

from collections.abc import Mapping

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import MANIFEST_FILE, Manifest, parse_version_dirname, version_dirname
from tierckpt.format.layout import where
from tierckpt.format.manifest import MAX_MANIFEST_BYTES
from tierckpt.storage.coalesce import SMALL, CoalescingReader, group_spans, window_spans
from tierckpt.storage.s3 import Bucket
from tierckpt.tiers.fscheck import check_records
from tierckpt.tiers.versionfiles import StoredSource

__all__ = ["ObjectSource", "ObjectVersion", "containers", "list_versions", "open_bucket"]


class ObjectVersion:
    """The objects of container ``container`` of ``bucket``: ``sizes`` (name -> bytes) from a listing."""

    def __init__(self, bucket: Bucket, container: str, sizes: Mapping[str, int]) -> None:
        self.bucket, self.container, self.sizes = bucket, container, dict(sizes)

    def url(self, name: str) -> str:
        return self.bucket.url_of(f"{self.container}/{name}")

    def read_small(self, name: str, *, tier: str | None, step: int | None) -> bytes:
        size = self.sizes.get(name)
        if size is None:
            raise CorruptCheckpointError(f"{where(tier, step)}: {name} is missing ({self.url(name)})", tier=tier, step=step)
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"{where(tier, step)}: {name}: {size} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have", tier=tier, step=step
            )
        try:
            return self.bucket.get_sync(f"{self.container}/{name}", MAX_MANIFEST_BYTES)
        except (OSError, CorruptCheckpointError) as exc:
            raise CorruptCheckpointError(f"{where(tier, step)}: {name} cannot be read ({exc})", tier=tier, step=step) from exc

    def open_source(self, tier: str | None, manifest: Manifest, *, direct: bool, every_chunk: bool = True) -> StoredSource:
        return ObjectSource(tier, self, manifest, every_chunk=every_chunk)


class ObjectSource(StoredSource):
    """A committed version's data objects, read with ranged GETs from the reading threads, each chunk
    verified.

    ``every_chunk``: every chunk of the records will be read, so each object is fetched in fixed
    16 MiB windows, the raw client's GETs; else (a reshard reading the overlapping chunks only) a GET
    per chunk, only chunks under 1 MiB together, so that a GET fetches little that nothing reads."""

    def __init__(self, tier: str | None, version: ObjectVersion, manifest: Manifest, *, every_chunk: bool = True) -> None:
        super().__init__(tier, manifest)
        files = sorted({r.chunk_file(i) for r in manifest.records for i, c in enumerate(r.chunks) if c is not None})
        sizes = {}
        for name in files:
            if name not in version.sizes:
                raise CorruptCheckpointError(f"{where(tier, self.step)}: data object {name} is missing ({version.url(name)})", tier=tier, step=self.step)
            sizes[name] = version.sizes[name]
        check_records(manifest.records, sizes, tier=tier, step=self.step)
        spans: dict[str, list[tuple[int, int]]] = {name: [] for name in files}
        for r in manifest.records:
            for i, c in enumerate(r.chunks):
                if c is not None:
                    spans[r.chunk_file(i)].append((c.offset, c.stored))
        for name in files:  # a few large GETs rather than one per chunk (see tierckpt.storage.coalesce)
            reader = version.bucket.open_reader(f"{version.container}/{name}", sizes[name])
            groups = window_spans(spans[name]) if every_chunk else group_spans(spans[name], below=SMALL)
            self.readers[name] = CoalescingReader(reader, groups, ahead=every_chunk) if groups else reader


def open_bucket(url: str, endpoint: str | None = None) -> Bucket:
    """The bucket prefix ``url`` (``s3://bucket/prefix``) for reading outside a Checkpointer (the CLI,
    export). Raises ConfigError when the URL or the endpoint is malformed."""
    from tierckpt.config import TierConfig

    return Bucket(TierConfig(name="cli", type="object", url=url, endpoint=endpoint))


def list_versions(bucket: Bucket) -> list[tuple[int, ObjectVersion]]:
    """Every committed version under the bucket's prefix (a container holding a commit object), by
    step; or, when the prefix is itself a version's container, that one (blocking)."""
    import asyncio

    listing = asyncio.run(bucket.list())
    own = parse_version_dirname(bucket.prefix.rpartition("/")[2])
    if own is not None and MANIFEST_FILE in listing:
        parent = open_bucket(bucket.url.rpartition("/")[0], bucket.endpoint)
        return [(own, ObjectVersion(parent, version_dirname(own), listing))]
    return [(step, ObjectVersion(bucket, version_dirname(step), names)) for step, names in containers(listing).items() if MANIFEST_FILE in names]


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
