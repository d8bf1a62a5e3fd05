"""One phase of a rollback scenario (test_rollback.py), in a process of its own.

Usage: ``python rollback_child.py <root> <config json> <ops json>``

Opens a Checkpointer on ``config`` (paths relative to ``root``), runs ``ops`` in order and prints one
JSON line per result, flushed at once:

- ``["save", step, value]``: saves ``{"w": a tensor filled with value}`` as ``step`` and waits until
  every tier took it (``wait()``);
- ``["save_nowait", step, value]``: saves without waiting;
- ``["committed", step, tier]``: waits until that save committed on ``tier`` (prints whether it did);
- ``["restore", step]``: ``restore(step)``; prints ``{"restored": step, "value": v, "serial": n}``;
- ``["latest"]``: ``restore_latest()``; prints the same (``null`` when none);
- ``["versions"]``: prints ``{"versions": [[tier, step, serial, abandoned], ...]}``;
- ``["open", tier]``: opens the gate of a gated tier (``gated`` in the config's tier names it);
  ``["allow", tier, n]``: lets its next ``n`` writes through, the gate staying closed;
- ``["kill"]``: SIGKILLs this process there and then (of several ranks, once every rank got there).

A config tier with ``"gated": true`` is a :class:`tierckpt.testing.GatedTier` whose writes wait until
an ``open`` op; its gate is also opened when the ops end.

Started as a rank of a job (``RANK`` and the rest set, :func:`tierckpt.testing.launch_ranks`), it joins a
gloo group first; its part of the state is ``value + rank / 4``, and its lines go to
``<root>/<PHASE>-rank-<rank>.jsonl`` (``PHASE`` from the environment).

With ``DUMP_AFTER=<seconds>`` in the environment, a phase still running then prints every thread's
stack to stderr (the ranks' output tail in a failing test's message), to see where a stall waits.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from tierckpt import Checkpointer
from tierckpt.config import TierConfig
from tierckpt.testing import GatedTier


RANK = int(os.environ.get("RANK", "0"))
_OUT: list[Any] = [sys.stdout]


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((64,), float(value) + RANK / 4)}


def _say(**line: Any) -> None:
    print(json.dumps(line), file=_OUT[0], flush=True)


def main(root: Path, config: dict[str, Any], ops: list[list[Any]]) -> None:
    if os.environ.get("DUMP_AFTER"):  # a phase that stalls: every thread's stack on stderr, once; it runs on
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["DUMP_AFTER"]), exit=False)
    gated = {t["name"] for t in config["tiers"] if t.pop("gated", False)}
    for t in config["tiers"]:
        if "path" in t:
            t["path"] = str(root / t["path"])
    gates: dict[str, GatedTier] = {}

    def factory(cfg: TierConfig) -> GatedTier | None:
        if cfg.name not in gated:
            return None
        gates[cfg.name] = GatedTier(cfg)
        return gates[cfg.name]

    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        _OUT[0] = open(root / f"{os.environ['PHASE']}-rank-{RANK}.jsonl", "w")
    ckpt = Checkpointer(config, tier_factory=factory)
    handles: dict[int, Any] = {}
    try:
        for op in ops:
            kind = op[0]
            if kind in ("save", "save_nowait"):
                handles[op[1]] = ckpt.save_sync(op[1], _state(op[2]))
                if kind == "save":
                    ckpt.wait_sync()
                _say(saved=op[1])
            elif kind in ("restore", "latest"):
                got = ckpt.restore_sync(op[1], _state(0)) if kind == "restore" else ckpt.restore_latest_sync(_state(0))
                if got is None:
                    _say(restored=None)
                else:
                    _say(restored=got.step, value=got.state["w"][0].item(), serial=got.serial, tier=got.tier)
            elif kind == "versions":
                _say(versions=[[v.tier, v.step, v.serial, v.abandoned] for v in ckpt.versions()])
            elif kind == "committed":
                _say(committed=op[1], tier=op[2], ok=handles[op[1]].committed_sync(op[2], timeout=60))
            elif kind == "open":
                gates[op[1]].gate.set()
            elif kind == "allow":
                gates[op[1]].allow(op[2])
            elif kind == "kill":
                if "RANK" in os.environ:  # every rank gets here first: a rank still saving would see its peer die
                    import torch.distributed as dist

                    dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                raise ValueError(f"unknown op {op!r}")
    finally:
        for tier in gates.values():
            tier.gate.set()
    ckpt.close_sync()
    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]))
