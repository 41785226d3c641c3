"""pytest plugin for a Cosmic Ray screen: a small, derandomized Hypothesis profile without shrinking.

Loaded with ``-p decodespec.checks.lab.mutation.screen_profile --hypothesis-profile=mutation-screen``
(``checks/lab/mutation/policy.toml``).  The profile is Hypothesis' ``ci`` profile (derandomized, no
example database, so a verdict can be reproduced and no mutant inherits another mutant's failing
example) with 25 examples per property instead of 100 and no shrink phase: a screen only needs
to know that a property fails, not its smallest counterexample, and shrinking a killed mutant's
example costs seconds apiece over some 1,600 mutants.  Survivors are re-run under the fuller
command of docs/results/mutation.md (the tests' own profile, with shrinking).

Source: docs/results/mutation.md (the ``impl/policy.py`` section); Hypothesis settings profiles
and phases (``hypothesis.settings.register_profile``, ``hypothesis.Phase``).
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "mutation-screen",
    parent=settings.get_profile("ci"),
    max_examples=25,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
