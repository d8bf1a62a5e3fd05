"""Restore: discover the versions the tiers hold, choose the newest that verifies, load it.

The modules, in the order a restore runs them:

- ``dispatch``: which of the restores below a Checkpointer's call runs, its step and tier checked
  first, how it ended reported as a ``restored`` or ``restore_failed`` event
  (:func:`~tierckpt.restore.dispatch.prepare_restore`);
- ``fallback``: the steps every rank can get, newest first, each rank's copies of a step fastest
  tier first, and the fallback to the next one; the ranks agree on one step and all load it or none
  does, one process being a group of one (:func:`restore_versions`); ``verdicts``: what it says of
  what it passed over; ``result``: what it returns (:class:`Restored`);
- ``read``: one version of one tier for this rank: its source or its saved layout, the template's
  keys, the staging area borrowed from the host pool (:func:`read_version`, :func:`check_keys`);
- ``plan``: the one planner, from a saved version and the template to targets and chunk jobs, with
  the exact-fit fast path (``exact``) and the general path through a saved layout, for another
  parallel layout (``reshard``, with ``boxes``: which part of a stored chunk lands where);
- ``landing``: where restored bytes land (new arrays, staged template pieces) and the final copy.

What a stored version holds in any layout (:class:`~tierckpt.format.saved_layout.SavedLayout`) and how a
tier reads it (:class:`~tierckpt.format.source.VersionSource`) live in :mod:`tierckpt.format`, below
the tiers: a tier builds them, and this package, above the tiers, reads them.

The planner is imported from its module (``from tierckpt.restore.plan import plan``): a function
``plan`` here would hide the module ``tierckpt.restore.plan``.
"""

from tierckpt.restore.fallback import restore_versions
from tierckpt.restore.read import check_keys, read_version
from tierckpt.restore.result import Restored, template_leaves

__all__ = ["Restored", "check_keys", "read_version", "restore_versions", "template_leaves"]
