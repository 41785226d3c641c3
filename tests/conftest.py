"""pytest configuration for the test suite: Hypothesis profiles, torch threads."""

import os
import sys

from decodespec.checks.testing import register_profiles

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
register_profiles()

# Session-scoped model fixtures shared by every test file (tiny, SmolLM2, the HF peer).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest_plugins = ["model_fixtures"]
