"""decodespec.checks: the machinery that judges a runtime against the spec.

The abstraction from runtime observations to spec state, trace validation, the exhaustive
small-scope explorer, the Hypothesis state machines, the STATE..RESUME ladder, adapters for
other runtimes, the failure lab's mutants, and the ``decodespec`` CLI.  ``pytest checks/`` is
the conformance gate.
"""
