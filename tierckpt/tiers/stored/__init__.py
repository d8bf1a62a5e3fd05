"""What every tier that keeps versions in a byte store shares: the format (v2) and its checks.

``tier``: :class:`~tierckpt.tiers.stored.tier.StoredTier`, the index, reading, the keeper's open;
``write``: executes a version's write plan; ``encoding``: which codec each tensor gets; ``commit``:
renaming a staged version into place and taking it back; ``read``: reading that trusts no manifest;
``check``: records against the files they point into; ``source``: the version source both stores
open; ``layout``: a version's saved layout from its manifests; ``sweep``: what an open finds and
removes; ``find``: whether a directory is a tier's, for the CLI.
"""
