"""Restoring into another parallel layout than the one that saved a version (universal checkpoints).

``layout`` reads every rank's manifest of a version into the keys' global shapes and stored pieces;
``load`` plans, for this rank's template, which chunks of which pieces overlap each destination, and
copies just those (``boxes``). Used by :func:`tierckpt.restore.read_version` whenever a version's
records are not exactly this rank's template, and by ``python -m tierckpt export``.
"""
