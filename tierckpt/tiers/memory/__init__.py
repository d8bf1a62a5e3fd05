"""Host memory, the first tier every save lands in.

``tier``: the memory tier, captured snapshots in host-pool slots; ``hooks``: what it asks of the
pipeline; ``source``: a slot read as a version; ``shm``: the files behind a tier that outlives its
process (its pool and versions on a RAM-backed file system); ``adopt``: the versions a previous
process left there, placed back in their slots as captured snapshots.
"""
