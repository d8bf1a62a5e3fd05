"""The on-disk format, version 3: manifests, checksums, layout constants."""

from tierckpt.format.checksum import CHECKSUM_ALGORITHM, checksum
from tierckpt.format.manifest import (
    ALIGN,
    CHUNK_BYTES,
    DATA_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    RANK_MANIFEST_FILE,
    Chunk,
    CommitMarker,
    Manifest,
    Region,
    TensorRecord,
    decode_document,
    version_dirname,
    parse_version_dirname,
)

__all__ = [
    "ALIGN",
    "CHECKSUM_ALGORITHM",
    "CHUNK_BYTES",
    "DATA_FILE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "RANK_MANIFEST_FILE",
    "Chunk",
    "CommitMarker",
    "Manifest",
    "Region",
    "TensorRecord",
    "checksum",
    "decode_document",
    "parse_version_dirname",
    "version_dirname",
]
