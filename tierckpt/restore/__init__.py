"""Restore: discover the versions the tiers hold, choose the newest that verifies, load it.

The modules, in the order a restore runs them:

- ``dispatch``: which of the restores below a Checkpointer's call runs, its step and tier checked
  first (:func:`~tierckpt.restore.dispatch.prepare_restore`);
- ``choose``: candidates across tiers, newest first, and the fallback to the next one
  (:func:`restore_latest`, :class:`Restored`); or one step's copies, fastest tier first
  (:func:`restore_step`);
- ``agree``: the same for several ranks, which agree on one step and all load it or none does
  (:func:`restore_agreed`);
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

from tierckpt.restore.agree import restore_agreed
from tierckpt.restore.choose import Restored, restore_latest, restore_step, template_leaves
from tierckpt.restore.read import check_keys, read_version

__all__ = [
    "Restored",
    "check_keys",
    "read_version",
    "restore_agreed",
    "restore_latest",
    "restore_step",
    "template_leaves",
]
