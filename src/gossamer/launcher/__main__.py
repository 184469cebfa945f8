"""``python -m gossamer.launcher`` is the same as the ``gossamer`` command."""

from gossamer.launcher.cli import main

raise SystemExit(main())
