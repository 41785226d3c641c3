"""decodespec.spec: the contract as pure, executable Python (no torch).

The spec mirrors the seeds: M3.10 (single-request inference execution) and M3.8 (output head
and decoding policy).  The model is an uninterpreted function from a token prefix to a score
row; caching, chunking, padding and static capacity are refinements that must be invisible at
the declared comparison level.

Parameters are frozen ``attrs`` values; transitions are pure functions
``step(params, state, action) -> state`` that raise a typed
:class:`~decodespec.spec.errors.Rejection` when the action's guard does not hold; invariants
are named predicates.  Every rule is registered in :data:`decodespec.spec.rules.RULES` under a
stable id so docs, checks and tests can name it.

``impl/`` may import the enums and value types from here, never the transitions.
"""
