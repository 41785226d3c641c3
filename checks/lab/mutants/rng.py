"""Failure lab, RNG group: the request-owned counter-based random stream is shared, consumed or lost.

Source: M3.10 0x0B "RNG and policy-state bugs"; M3.8 0x0B "Request-owned randomness and replay"
(greedy and forced paths draw nothing; the counter advances by the receipt's draws), 0x12 item 49.
"""

from __future__ import annotations

import random
from typing import Any, Callable

from . import Patch, mutant

_G = "rng"


def _process_wide_stream(original: Callable[..., float]) -> Callable[..., float]:
    """One stream for the whole process (seeded once at install), ignoring the request key and the address."""
    stream = random.Random(0)

    def uniform(self: Any, step: int, draw_idx: int) -> float:
        return stream.random()

    return uniform


@mutant(
    "global_rng", group=_G, representative=True,
    title="One global generator shared by every request",
    section="M3.10 0x0B RNG and policy-state bugs (one global RNG shared by unrelated requests); M3.8 0x12 item 49",
    statement="impl/rng.py RequestRng.uniform draws from one process-wide stream instead of the request key at "
    "address (step, draw index): each draw is valid locally, but a request's tokens depend on every draw taken "
    "before it by other requests. DECISION fails (the replayed draw selects another id) on sampled cases.",
)
def _global_rng():
    return [Patch("decodespec.impl.rng:RequestRng.uniform", wrap=_process_wide_stream)]


@mutant(
    "greedy_consumes_draws", group=_G,
    title="Greedy decisions consume an RNG draw",
    section="M3.8 0x0B Request-owned randomness (greedy and forced paths draw nothing); M3.10 0x0B RNG and policy-state bugs",
    statement="impl/policy.py decide takes a uniform at (step, 0) on the greedy path too and records it: the token is "
    "right, but the request's RNG counter advances by one per greedy decision, so a later sampled decision (or a "
    "resumed request) reads another address. STATE fails (RNG counter) / POLICY (draws).",
)
def _greedy_consumes_draws():
    return [Patch("decodespec.impl.policy:decide", edits=[(
        "addresses, uniforms = (), ()", "addresses, uniforms = ((view.step, 0),), (rng.uniform(view.step, 0),)")])]


@mutant(
    "rng_counter_not_restored", group=_G,
    title="Resume restarts the RNG counter",
    section="M3.10 0x0BA A completed output is not automatically a resumable snapshot; RNG and policy-state bugs",
    statement="impl/snapshot.py restore_runner restores the policy state with the request's initial RNG counter "
    "instead of the snapshot's: a resumed sampled request replays draw addresses it already consumed. STATE / RESUME "
    "fail (RNG counter after restore).",
)
def _rng_counter_not_restored():
    return [Patch("decodespec.impl.snapshot:restore_runner", edits=[(
        "policy_state=snapshot.policy_state,",
        "policy_state=attrs.evolve(snapshot.policy_state, rng_counter=runner.request.rng_counter_start),")])]
