"""``python -m ddlc``: see :mod:`ddlc.cli`."""
from .cli import main

raise SystemExit(main())
