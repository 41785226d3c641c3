"""The failure lab: named shape-correct bugs of our runtime (mutants) and deliberately broken runtimes the gate must catch.

The outside mutation tester's sessions (Cosmic Ray) stay in ``checks/mutation/``.

See docs/design.md "Module map".
"""
