"""M3.8 0x0B request-owned, counter-based randomness: Philox twin, addressing, replay, draw counts.

Rules: selector.multinomial (one draw per decision), selector.greedy (no draw).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from decodespec.impl.rng import RequestRng, philox4x64_10
from decodespec.spec.errors import Rejection
from decodespec.spec.policy import PolicyConfig, PolicyState, RequestView, ScoreRow, decide, policy_config_from_json, rng_key, uniform

U64 = st.integers(0, 2**64 - 1)


@given(st.tuples(U64, U64, U64, U64), st.tuples(U64, U64))
def test_runtime_philox_block_equals_numpy_philox(counter, key):
    """impl/rng.py's pure-Python Philox4x64-10 equals numpy's (which increments the counter first)."""
    bits = np.random.Philox(counter=np.array(counter, dtype=np.uint64), key=np.array(key, dtype=np.uint64))
    incremented = (sum(c << (64 * i) for i, c in enumerate(counter)) + 1) % 2**256
    words = tuple((incremented >> (64 * i)) & (2**64 - 1) for i in range(4))
    assert philox4x64_10(words, key) == tuple(int(w) for w in bits.random_raw(4))


def test_philox_known_answer():
    """Random123 known-answer vector philox4x64-10, counter 0, key 0."""
    assert philox4x64_10((0, 0, 0, 0), (0, 0)) == (0x16554D9ECA36314C, 0xDB20FE9D672D0FDC, 0xD7E772CEE186176B, 0x7E68B68AEC7BA23B)


@given(st.text(max_size=20), st.one_of(st.none(), st.integers(0, 2**53 - 1)), st.integers(0, 10**6), st.integers(0, 3))
def test_runtime_and_spec_streams_agree_at_every_address(identity, seed, step, draw_idx):
    """The runtime's RequestRng and the spec's rng_key/uniform give the same key id and uniform."""
    key = rng_key(identity, seed)
    rng = RequestRng(identity, seed)
    assert rng.key_id == key.key_id
    u = rng.uniform(step, draw_idx)
    assert u == uniform(key, step, draw_idx) and 0.0 <= u < 1.0


def test_streams_are_keyed_by_identity_and_seed():
    """Different identities or seeds give different keys; None and 0 are different seeds."""
    keys = {rng_key(i, s).key_id for i in ("a", "b") for s in (None, 0, 1)}
    assert len(keys) == 6


def test_greedy_run_leaves_the_rng_counter_at_zero():
    """selector.greedy consumes no draw: a 20-step greedy run ends with rng_counter 0 and no addresses."""
    config = PolicyConfig.greedy()
    state, output = PolicyState(), []
    rng = np.random.default_rng(0)
    for _ in range(20):
        receipt, state = decide(ScoreRow.create(rng.standard_normal(16)), config, state, RequestView(prompt_ids=(1,), output_ids=output, identity="g", seed=1))
        output.append(receipt.selected_id)
        assert receipt.draws == 0 and receipt.rng.addresses == ()
    assert state.rng_counter == 0


def test_draws_are_addressed_by_step_not_by_history_of_draws():
    """selector.multinomial: the uniform at (step, 0) does not depend on the counter, on other requests or on rejected attempts."""
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 1.0}]})
    z = ScoreRow.create(np.linspace(-2, 2, 32))
    view = RequestView(prompt_ids=(1,), output_ids=(3,) * 5, identity="req", seed=42)
    fresh, _ = decide(z, config, PolicyState(), view)
    later, after = decide(z, config, PolicyState(rng_counter=17), view)
    assert fresh.selected_id == later.selected_id and fresh.rng.addresses == later.rng.addresses == ((5, 0),)
    assert after.rng_counter == 18
    # another request drawing in between changes nothing
    decide(z, config, PolicyState(), RequestView(prompt_ids=(1,), output_ids=(3,) * 5, identity="other", seed=42))
    # a rejected attempt (empty support) consumes nothing: the state is a value and stays as it was
    masked = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "bad_words", "sequences": [[i] for i in range(32)]}]})
    with pytest.raises(Rejection):
        decide(z, masked, PolicyState(), view)
    again, _ = decide(z, config, PolicyState(), view)
    assert again == fresh


REPLAY = textwrap.dedent(
    """
    import json, sys, numpy as np, torch
    torch.set_num_threads(1)
    from decodespec.impl import policy as twin
    from decodespec.spec.policy import PolicyState, RequestView, initial_policy_state, policy_config_from_json
    config = policy_config_from_json(json.loads(sys.argv[1]))
    state, output, receipts = initial_policy_state(config), [], []
    table = np.random.default_rng(7).standard_normal((64, 257)).astype(np.float32)
    for step in range(24):
        row = torch.from_numpy(table[(sum(output) + step) % 64])
        receipt, state = twin.decide(row, config, state, RequestView(prompt_ids=(5, 6), output_ids=output, identity="replay", seed=2024))
        output.append(receipt.selected_id)
        receipts.append(receipt.receipt_id)
    print(json.dumps({"output": output, "receipts": receipts, "rng_counter": state.rng_counter}))
    """
)


def test_replay_gives_the_same_tokens_in_two_processes():
    """Replay: the same identity, seed, steps and parameters give the same tokens and receipt ids in two CPU processes."""
    policy = {"family": "multinomial", "order": "hf", "transforms": [
        {"name": "temperature", "temperature": 1.3}, {"name": "top_k", "k": 50}, {"name": "top_p", "p": 0.95},
        {"name": "repetition_penalty", "penalty": 1.2}]}
    runs = [
        json.loads(subprocess.run([sys.executable, "-c", REPLAY, json.dumps(policy)], capture_output=True, text=True, check=True,
                                  env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}).stdout)
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert runs[0]["rng_counter"] == 24 and len(set(runs[0]["output"])) > 3
