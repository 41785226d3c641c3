"""Subcommands of the ``decodespec`` CLI, one module each (see :mod:`decodespec.checks.commands.cli`)."""
