"""Fakes for tests, yours and ours: slow, gated and faulty tiers (all real filesystem tiers), and a clock.

Pass the tiers through ``Checkpointer(config, tier_factory=...)``::

    from tierckpt.testing import faulty, slow
    ckpt = Checkpointer(config, tier_factory=slow({"pfs": 0.5}))          # every pfs write takes 0.5 s longer
    ckpt = Checkpointer(config, tier_factory=faulty({"nvme": {3, 4}}))   # writes of steps 3 and 4 fail on nvme

and a :class:`ManualClock` through ``Checkpointer(config, clock=...)`` to test ``min_interval``,
``max_staleness`` and ``keep.within`` without waiting for them.

:class:`IOFaults` makes the system calls of a real filesystem tier fail, for the errors a real disk
cannot be made to produce on demand (EIO, EDQUOT, EACCES; ENOSPC at one exact call)::

    with IOFaults(errno.EIO, "fsync", under=nvme_dir, path="*/.tmp-*/data-*"):
        handle = ckpt.save_sync(2, state)
        handle.committed_sync("nvme")   # FlushError: tier 'nvme', step 2, EIO, the data file's path

:func:`launch_ranks` runs a script as the ranks of one torch.distributed job on localhost, for tests and
benchmarks of many ranks; :func:`failures` says which ranks did not exit as they should::

    exits = launch_ranks([sys.executable, "worker.py"], 4, env={"STEPS": "3"})
    failed = failures(exits)
    assert not failed, failed

The package: :mod:`~tierckpt.testing.tiers` (slow, gated and faulty tiers), :mod:`~tierckpt.testing.clock`
(:class:`ManualClock`), :mod:`~tierckpt.testing.faults` (:class:`IOFaults`, :func:`flip_bits`) and
:mod:`~tierckpt.testing.ranks` (:func:`launch_ranks`, :func:`failures`; :func:`~tierckpt.testing.ranks.end_job`,
a rank's clean exit).

The seams tests look through instead of private attributes, imported from their modules (not from here):
:mod:`~tierckpt.testing.inspect` reads a Checkpointer's parts (its host pool, tiers, flushers and engine;
a save handle's state without waiting; the CUDA copy stage), and :mod:`~tierckpt.testing.copies` holds
its copy threads at a gate (:class:`~tierckpt.testing.copies.HeldCopies`), stops or watches them::

    from tierckpt.testing.copies import HeldCopies
    from tierckpt.testing.inspect import captured_done, host_pool

    with HeldCopies(ckpt) as held:
        handle = ckpt.save_sync(1, state)
        assert not captured_done(handle)      # the copy waits at the gate
        held.release()
"""

from __future__ import annotations

from tierckpt.testing.clock import ManualClock
from tierckpt.testing.faults import IO_OPS, IOFaults, fallocate_hook, fd_path, flip_bits, path_of
from tierckpt.testing.ranks import TAIL_CHARS, RankExit, failures, free_port, launch_ranks
from tierckpt.testing.tiers import FaultyTier, GatedTier, Gates, SlowTier, faulty, slow

__all__ = [
    "SlowTier", "GatedTier", "FaultyTier", "Gates", "slow", "faulty", "ManualClock",
    "IO_OPS", "IOFaults", "fallocate_hook", "fd_path", "path_of", "flip_bits",
    "TAIL_CHARS", "RankExit", "free_port", "launch_ranks", "failures",
]
