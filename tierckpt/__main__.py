"""``python -m tierckpt``: the ``tierckpt`` command line (:mod:`tierckpt.cli`), under the name it was run by."""

from tierckpt.cli import main

raise SystemExit(main(prog="python -m tierckpt"))
