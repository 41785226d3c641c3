"""pytest configuration for the test suite: Hypothesis profiles, torch threads."""

import os

from decodespec.checks.testing import register_profiles

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
register_profiles()
