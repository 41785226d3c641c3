"""The conformance gate: the case table, the lock-step harness and ladder, the machines, and what they need.

See docs/design.md "Module map".
"""
