"""Model checking and traces: the explorer, ITF, conformance traces, trace validation and the rows-in judge.

See docs/design.md "Module map".
"""
