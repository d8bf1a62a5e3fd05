"""The peer tier: copies of each rank's snapshots in the RAM of ranks on other nodes (Gemini-style).

``wire`` moves a version's bytes between two ranks, ``replicas`` keeps the copies a rank holds for
others, ``tier`` is the tier itself, and ``recovery`` serves those copies back in a restore.
"""

from tierckpt.tiers.peer.tier import PeerTier, check_peer

__all__ = ["PeerTier", "check_peer"]
