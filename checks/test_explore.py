"""Gate: exhaustive small-scope check of the request state machine (``pytest checks/``).

Every reachable state of each configuration below satisfies every invariant of
:mod:`decodespec.spec.invariants`, no controller deadlock exists, every refusal is typed, and
together the configurations exercise every rule of the request machine's transition table (including the
three G=0 branches, static capacity, the no-cache profile, chunked prefill, repair, retries,
stop strings and structured completion, and all four architecture profiles).

Source: M3.10 "One request as a transition system"; research/formal-anchors-survey.md 3.1.
"""

from __future__ import annotations

import itertools

import pytest

from decodespec.checks.modelcheck.explore import ExploreBounds, explore, params_for_bounds
from decodespec.spec.transitions import MACHINE

RICH = ExploreBounds(max_draws=1, stop_strings=True, structured=True)

CONFIGS: list[ExploreBounds] = [RICH]
for profile, cache in itertools.product(["decoder_only", "encoder_decoder", "prefix_lm", "hybrid"], ["none", "dynamic", "static"]):
    if profile == "hybrid" and cache == "none":
        continue  # recurrent state must be carried (envelope.cache_abi_incompatible)
    CONFIGS.append(ExploreBounds(
        profile=profile, cache=cache,
        prompt_len=1 if profile == "encoder_decoder" else 3,
        prefill_chunk=None if cache == "none" else (3 if profile == "prefix_lm" else 2),
        prefix_length=2 if profile == "prefix_lm" else None,
        final_cache="processed_inputs_only" if cache == "none" else "all_outputs",
    ))
CONFIGS += [
    ExploreBounds(max_new_tokens=0, zero_new_tokens=branch) for branch in ("reject", "no_call", "prefill_only")
] + [
    ExploreBounds(min_new_tokens=1, context_cap=5, final_cache="processed_inputs_only", max_retries=0),
    ExploreBounds(vocab=4, prompt_len=2, max_new_tokens=2, prefill_chunk=1, max_retries=2, stop_strings=True),
    ExploreBounds(cache="static", capacity=5, max_new_tokens=3, min_new_tokens=2, structured=True),
    # M3.10 0x0A: one call over two ranks with two collectives each (the rank_* transitions).
    ExploreBounds(vocab=2, prompt_len=1, max_new_tokens=1, prefill_chunk=None, ranks=2, collectives=2, max_retries=0,
                  interrupts=False, stream=False, final_cache="processed_inputs_only"),
]


def _id(b: ExploreBounds) -> str:
    return (f"{b.profile}-{b.cache}-V{b.vocab}-L{b.prompt_len}-G{b.max_new_tokens}-{b.zero_new_tokens if not b.max_new_tokens else 'g'}"
            + (f"-R{b.ranks}" if b.ranks > 1 else ""))


@pytest.fixture(scope="module")
def coverage() -> dict[str, int]:
    return {}


@pytest.mark.parametrize("bounds", CONFIGS, ids=[f"{i}-{_id(b)}" for i, b in enumerate(CONFIGS)])
def test_every_reachable_state_keeps_every_invariant(bounds: ExploreBounds, coverage: dict[str, int]) -> None:
    params = params_for_bounds(bounds)
    result = explore(params, bounds)
    assert result.ok, [(v.rule_id, v.message, [type(a).__name__ for a in v.actions]) for v in result.violations]
    assert result.num_terminal > 0
    for rule_id, count in result.rule_counts.items():
        coverage[rule_id] = coverage.get(rule_id, 0) + count
    print(f"{_id(bounds)}: {result.num_states} states, {result.num_transitions} transitions, "
          f"{result.states_per_second:.0f} states/s")


def test_every_transition_is_exercised(coverage: dict[str, int]) -> None:
    """Runs after the configurations above (same module): the union covers every transition rule."""
    if not coverage:
        pytest.skip("run with the configuration tests (same module) to collect coverage")
    missing = [rid for rid in MACHINE.rule_ids() if rid not in coverage]
    assert not missing, missing
