"""The on-disk format, version 3: manifests (manifest.py), tensor records (records.py), checksums
(checksum.py), layout constants (layout.py)."""

from tierckpt.format.checksum import CHECKSUM_ALGORITHM, checksum
from tierckpt.format.layout import (
    ALIGN,
    CHUNK_BYTES,
    DATA_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    RANK_MANIFEST_FILE,
    parse_version_dirname,
    version_dirname,
)
from tierckpt.format.manifest import CommitMarker, Manifest, decode_document
from tierckpt.format.records import DELTA_CODECS, BaseChunk, Chunk, Region, TensorInfo, TensorRecord

__all__ = [
    "ALIGN",
    "CHECKSUM_ALGORITHM",
    "CHUNK_BYTES",
    "DATA_FILE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "RANK_MANIFEST_FILE",
    "BaseChunk",
    "Chunk",
    "DELTA_CODECS",
    "CommitMarker",
    "Manifest",
    "Region",
    "TensorInfo",
    "TensorRecord",
    "checksum",
    "decode_document",
    "parse_version_dirname",
    "version_dirname",
]
