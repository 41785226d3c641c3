"""The adapter contract (checks/adapters): case configs, actions, results, the wire codec, our runtime's adapter.

Source: docs/design.md section 11; research/formal-anchors-survey.md 5.4 (Bowtie-style protocol).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from decodespec.checks.adapters import (
    CAPABILITIES,
    CORRUPTIONS,
    OPS,
    Adapter,
    ApplyResult,
    CaseConfig,
    Observation,
    check_action,
    corrupt_record,
    open_adapter,
    required_capabilities,
    wire,
)
from decodespec.checks.adapters.impl import IMPL_CAPABILITIES, ImplAdapter
from decodespec.spec.enums import PendingTag
from decodespec.spec.errors import Rejection
from decodespec.spec.snapshot import SnapshotRecord
from decodespec.spec.state import Phase

CONFIG = CaseConfig(model="tiny", prompt_ids=[1, 75, 105], max_new_tokens=3, eos_ids=[2])


def test_case_config_round_trips_and_has_a_stable_identity() -> None:
    again = CaseConfig.from_json(json.loads(json.dumps(CONFIG.to_json())))
    assert again == CONFIG and again.identity() == CONFIG.identity()
    assert CONFIG.identity().startswith("sha256:") and len(CONFIG.identity()) == 71
    assert CONFIG.evolve(seed=1).identity() != CONFIG.identity()


@pytest.mark.parametrize("bad", [
    {"model": "gpt"}, {"prompt_ids": []}, {"cache": "paged"}, {"max_new_tokens": -1}, {"min_new_tokens": 9},
    {"policy": {"x": 1}}, {"seed": -1}, {"num_beams": 0}, {"final_cache": "all_outputs", "cache": "none"}, {"unknown": 1},
])
def test_case_config_refuses_bad_fields(bad) -> None:
    with pytest.raises(Rejection) as err:
        CaseConfig.from_json({**CONFIG.to_json(), **bad})
    assert err.value.code == "adapter.invalid_config"


def test_actions_are_validated_and_filled() -> None:
    assert check_action({"op": "prefill"}) == {"op": "prefill", "chunk": None}
    assert check_action({"op": "commit", "receipt": "receipt-0"})["receipt"] == "receipt-0"
    for bad in ({}, {"op": "fly"}, {"op": "cancel"}, {"op": "cancel", "kind": "abort"}, {"op": "prefill", "chunk": -1},
                {"op": "decode", "extra": 1}, {"op": "reuse", "prompt_ids": []}, {"op": "restore", "snapshot": "s", "corrupt": "x"}):
        with pytest.raises(Rejection) as err:
            check_action(bad)
        assert err.value.code == "adapter.invalid_action"
    assert required_capabilities(check_action({"op": "prefill", "chunk": 2})) == {"prefill_chunk"}
    assert set(OPS) == {"prefill", "decode", "launch", "complete", "decide", "commit", "step", "run", "cancel", "fault", "recover",
                        "repair", "snapshot", "restore", "reuse", "stream_fail"}


def test_apply_result_and_observation_travel_over_the_wire() -> None:
    for result in (ApplyResult.accepted({"token_id": 5}), ApplyResult.rejected("transition.not_enabled", "no")):
        assert ApplyResult.from_json(json.loads(wire.encode_line(wire.response_ok(1, result=result)))["result"]) == result
    obs = Observation(phase="scored", output_ids=[3], logprobs=[-0.5], score_row=np.arange(5, dtype=np.float32) / 3,
                      support_ids=[1, 4], support_probs=[0.25, 0.75], cache_probe=np.ones((2, 2, 1, 3, 4), dtype=np.float32),
                      chunks=[{"chunk_idx": 0, "text": "é"}])
    back = wire.observation_from_json(json.loads(wire.encode_line(wire.observation_to_json(obs))))
    assert back.summary() == obs.summary()
    np.testing.assert_array_equal(back.score_row, obs.score_row)
    np.testing.assert_array_equal(back.support_ids, [1, 4])
    assert back.cache_probe.shape == (2, 2, 1, 3, 4)
    with pytest.raises(Rejection):
        wire.observation_from_json({"bogus": 1})
    with pytest.raises(Rejection):
        wire.array_from_json({"dtype": "float32", "shape": [3], "base64": "AAAA"})
    start = wire.start_response("x", "1", {"cache:dynamic"})
    assert start["version"] == wire.PROTOCOL_VERSION and start["implementation"]["capabilities"] == ["cache:dynamic"]
    with pytest.raises(Rejection):
        wire.start_response("x", "1", {"warp_drive"})
    assert wire.request("reset", 3, config=CONFIG)["config"] == CONFIG.to_json()


def test_open_adapter_names() -> None:
    adapter = open_adapter("impl")
    from decodespec.impl.native import unavailable_reason

    native = set() if unavailable_reason() is not None else {"decode_kernel:native"}
    assert isinstance(adapter, Adapter) and adapter.capabilities() == IMPL_CAPABILITIES | native <= CAPABILITIES
    with pytest.raises(Rejection):
        open_adapter("nonesuch")
    with pytest.raises(Rejection):
        open_adapter("impl:extra")


def test_corrupt_record_breaks_each_field() -> None:
    record = SnapshotRecord(identity="sha256:" + "0" * 64, form="pending_suffix", phase=Phase.READY, processed=3, output_ids=(7,),
                            pending_ids=(7,), pending_tag=PendingTag.PENDING_NEXT_CALL, lanes=(("self_kv", 3),), generation=2,
                            score=None, issued=("receipt-0",), consumed=(), scores=(), rng_counter=0, finish_reason=None,
                            triggers=frozenset(), num_calls=2, num_retries=0)
    broken = {c: corrupt_record(record, c) for c in CORRUPTIONS}
    assert broken["identity"].identity != record.identity
    assert broken["processed_plus_one"].processed == 4
    assert broken["pending_dropped"].pending_ids == () and broken["pending_dropped"].pending_tag is PendingTag.EMPTY
    assert broken["repaired_with_pending"].form == "repaired"
    assert broken["rng_counter"].rng_counter == 1


def test_impl_adapter_rejections_change_nothing(tiny_model) -> None:
    """A refused action (transition.not_enabled, adapter.*) leaves the observation unchanged."""
    adapter = ImplAdapter()
    adapter.reset(CONFIG)
    assert adapter.apply({"op": "prefill"}).ok
    before = adapter.observe().summary()
    for action in ({"op": "commit"}, {"op": "recover"}, {"op": "repair"}, {"op": "fault", "kind": "device_fault"},
                   {"op": "stream_fail"}, {"op": "restore", "snapshot": "nope"}, {"op": "snapshot", "form": "pending_suffix"},
                   {"op": "bogus"}):
        result = adapter.apply(action)
        assert not result.ok and result.code, action
        assert adapter.observe().summary() == before, action
    decided = adapter.apply({"op": "decide"})
    assert decided.ok and decided.data["receipt_id"] == "receipt-0"
    obs = adapter.observe()
    assert obs.decision["token_id"] == decided.data["token_id"] and obs.score_row.shape == (512,)
    assert obs.support_ids.size == obs.support_probs.size > 0


def test_impl_adapter_refuses_configs_it_cannot_run() -> None:
    adapter = ImplAdapter()
    with pytest.raises(Rejection) as err:
        adapter.reset(CONFIG.evolve(num_beams=2))
    assert err.value.code == "adapter.unsupported"
    with pytest.raises(Rejection) as err:
        adapter.reset(CONFIG.evolve(max_new_tokens=0, zero_new_tokens="reject"))
    assert err.value.code == "envelope.zero_new_tokens_rejected"
