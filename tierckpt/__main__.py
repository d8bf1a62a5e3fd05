"""``python -m tierckpt ls|verify DIR`` and ``python -m tierckpt export VERSION OUT``: see :mod:`tierckpt.cli`."""

from tierckpt.cli import main

raise SystemExit(main())
