"""``python -m decodespec.checks`` runs the CLI."""

import sys

from decodespec.checks.commands.cli import main

sys.exit(main())
