"""The peer tier: copies of each rank's snapshots in the RAM of ranks on other nodes (Gemini-style).

``replicas`` keeps the copies a rank holds for others, ``tier`` is the tier itself, and ``recovery``
serves those copies back in a restore; the bytes move between two ranks through
:mod:`tierckpt.tiers.wire` (shared with a node-local tier's fetches).
"""

from tierckpt.tiers.peer.tier import PeerTier, check_peer

__all__ = ["PeerTier", "check_peer"]
