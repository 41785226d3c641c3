"""``python -m decodespec.checks`` runs the CLI."""

import sys

from decodespec.checks.cli import main

sys.exit(main())
