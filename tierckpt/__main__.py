"""``python -m tierckpt ls|verify DIR``: see :mod:`tierckpt.cli`."""

from tierckpt.cli import main

raise SystemExit(main())
