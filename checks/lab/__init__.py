"""The failure lab: named shape-correct bugs of our runtime (mutants) and deliberately broken runtimes the gate must catch.

The outside mutation tester's sessions (Cosmic Ray) live in ``checks/lab/mutation/``: its configurations,
the annotation pre-filter, the fork launcher and the report.

See docs/design.md "Module map".
"""
