"""A node-local filesystem tier (``scope: node``): each node's own directory, a version committed on
every node or none.

``tier``: the tier and its three-phase commit; ``plan``: which steps are committed across the
nodes' reports (pure); ``fetch``: a rank's part fetched from another node's directory in a restore.
"""
