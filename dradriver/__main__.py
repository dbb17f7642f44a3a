"""``python -m dradriver`` runs the command-line interface."""

from dradriver.cli import main

raise SystemExit(main())
