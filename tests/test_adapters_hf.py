"""The HF transformers adapter (checks/adapters/hf.py) and the shared peer controller (checks/adapters/peer.py).

Semantics of reset / apply / observe on the tiny model (HF ``LlamaForCausalLM`` with our tiny
weights), rejected actions that change nothing, honest capabilities (every declared one is
exercised, every other op is refused with ``adapter.unsupported``), the policy -> HF
``GenerationConfig`` mapping, and the evidence that the step-wise path *is* HF's loop: it
returns what ``model.generate(...)`` returns (greedy ids and raw logits bit for bit; sampled ids
under the same global ``torch.manual_seed``).
"""

from __future__ import annotations

import numpy as np
import pytest

from decodespec.checks.adapters import ADAPTER_UNSUPPORTED, CAPABILITIES, CaseConfig
from decodespec.checks.testing import requires_hf, requires_smollm2
from decodespec.spec.errors import Rejection

pytestmark = [requires_hf, pytest.mark.hf]

torch = pytest.importorskip("torch")

PROMPT = (1, 40, 50, 60, 70)
SAMPLED = {"family": "multinomial", "order": "hf",
           "transforms": [{"name": "temperature", "temperature": 0.8}, {"name": "top_k", "k": 5}]}


@pytest.fixture(scope="module")
def adapter():
    from decodespec.checks.adapters.hf import create

    a = create()
    yield a
    a.close()


def tiny(**changes) -> CaseConfig:
    return CaseConfig(model="tiny", prompt_ids=PROMPT, max_new_tokens=5, eos_ids=[2], seed=3).evolve(**changes)


def run(adapter, config: CaseConfig, op: dict | None = None):
    adapter.reset(config)
    result = adapter.apply(op or {"op": "run"})
    assert result.ok, result
    return adapter.observe()


def test_hf_tiny_is_our_tiny_model(tiny_model):
    """hf_tiny: HF LlamaForCausalLM with our tiny weights computes our tiny logits (declared tiny tolerance)."""
    from decodespec.checks.adapters.hf import hf_tiny

    ids = torch.tensor([list(PROMPT)])
    with torch.no_grad():
        theirs = hf_tiny().eval()(ids).logits[0].float()
        ours = tiny_model(ids).logits[0].float()
    assert theirs.shape == ours.shape == (len(PROMPT), 512)
    assert torch.allclose(theirs, ours, atol=5e-5, rtol=0)


def test_reset_admits_and_observes_the_peer_state(adapter):
    """transition.admit: READY with nothing processed; HF's own cache length is P."""
    adapter.reset(tiny())
    obs = adapter.observe()
    assert obs.phase == "ready"
    assert obs.frontier == {"prompt_len": 5, "output_count": 0, "pending": 0, "processed": 0, "pending_tag": "EMPTY"}
    assert obs.output_ids == () and obs.score_row is None and obs.cache_committed == 0
    # Fields HF has no notion of are not exposed (None), never invented.
    assert obs.generation is None and obs.rng_counter is None and obs.quarantined is False


def test_chunked_prefill_advances_hfs_cache_length(adapter):
    """transition.launch_prefill, transition.complete_all_new: each chunk is one HF forward; P = cache.get_seq_length()."""
    adapter.reset(tiny(prefill_chunk=2))
    lengths = []
    for _ in range(3):
        assert adapter.apply({"op": "prefill", "chunk": 2 if len(lengths) < 2 else 1}).ok
        obs = adapter.observe()
        lengths.append(obs.frontier["processed"])
        assert obs.cache_committed == int(adapter.engine.cache.get_seq_length())
    assert lengths == [2, 4, 5]
    assert obs.phase == "scored" and obs.score_row.shape == (512,) and obs.score_output_count == 0
    assert obs.call == {"call_id": 2, "kind": "prefill", "start": 4, "length": 1, "position_ids": [4], "cache_position": [4],
                        "in_flight": False}
    assert obs.cache_probe.shape == (4, 2, 2, 5, 16)  # [layers, K/V, H_kv, P, D]


def test_decide_then_commit_consumes_the_receipt_once(adapter):
    """transition.decide, transition.commit: the receipt commits once; duplicates and stale ids are refused."""
    adapter.reset(tiny())
    assert adapter.apply({"op": "prefill", "chunk": None}).ok
    decided = adapter.apply({"op": "decide"})
    assert decided.ok and decided.data["receipt_id"] == "receipt-0"
    obs = adapter.observe()
    row = obs.score_row.astype(np.float64)
    assert decided.data["token_id"] == int(np.argmax(row))  # HF's argmax: the lowest id among maxima
    assert decided.data["logprob"] == pytest.approx(row[decided.data["token_id"]] - np.log(np.exp(row).sum()), abs=1e-5)
    assert adapter.apply({"op": "commit", "receipt": "receipt-0"}).ok
    again = adapter.apply({"op": "commit", "receipt": "receipt-0"})
    assert not again.ok and again.code == "transition.not_enabled"
    obs = adapter.observe()
    assert obs.output_ids == (decided.data["token_id"],)
    assert obs.frontier["pending"] == 1 and obs.frontier["pending_tag"] == "PENDING_NEXT_CALL"


@pytest.mark.parametrize("action", [
    {"op": "decide"},
    {"op": "commit", "receipt": "receipt-7"},
    {"op": "launch", "kind": "prefill", "length": None},
    {"op": "prefill", "chunk": 3},
    {"op": "complete"},
    {"op": "restore", "snapshot": "nope", "corrupt": None},
    {"op": "fault", "kind": "device_fault", "layer": 0},
    {"op": "stream_fail"},
    {"op": "frobnicate"},
], ids=lambda a: a["op"])
def test_rejected_actions_change_nothing(adapter, action):
    """A refused action answers `rejected` with a registered code and leaves the observation as it was."""
    adapter.reset(tiny())
    assert adapter.apply({"op": "step"}).ok
    before = adapter.observe()
    result = adapter.apply(action)
    assert not result.ok and result.code
    after = adapter.observe()
    assert after.summary() == before.summary()
    assert np.array_equal(after.score_row, before.score_row) and np.array_equal(after.cache_probe, before.cache_probe)


def test_capabilities_are_honest(adapter):
    """Every declared capability is exercised by an accepted op; ops needing an undeclared one are refused."""
    caps = adapter.capabilities()
    assert caps <= CAPABILITIES
    assert {"faults", "stream", "beam", "structured"}.isdisjoint(caps)
    for cache in ("none", "dynamic", "static"):
        assert f"cache:{cache}" in caps
        obs = run(adapter, tiny(cache=cache))
        assert obs.finish_reason == "length" and len(obs.output_ids) == 5
        assert obs.cache_committed == (0 if cache == "none" else 9)
        assert obs.cache_physical == {"none": 0, "dynamic": 9, "static": 11}[cache]
    assert run(adapter, tiny(policy=SAMPLED)).support_ids.size == 5  # sampling, policy_rows
    adapter.reset(tiny())
    assert adapter.apply({"op": "launch", "kind": None, "length": None}).data["kind"] == "prefill"  # inflight
    assert adapter.apply({"op": "cancel", "kind": "cancelled"}).data == {"at": "in_flight"}
    assert adapter.apply({"op": "complete"}).data == {"selection": "ALL_OLD", "reason": "cancelled"}
    obs = adapter.observe()
    assert obs.finish_reason == "cancelled" and obs.cache_committed == 0  # HF's crop(-n) dropped the call's rows
    for op in ({"op": "fault", "kind": "device_fault", "layer": 1}, {"op": "recover"}, {"op": "stream_fail"}):
        result = adapter.apply(op)
        assert not result.ok and result.code == ADAPTER_UNSUPPORTED


def test_static_reuse_forgets_every_row(adapter):
    """Static-cache reuse through HF's Cache.reset(): the shorter request equals a fresh one."""
    config = tiny(cache="static", static_capacity=12)
    fresh = run(adapter, config.evolve(prompt_ids=(1, 9)))
    adapter.reset(config)
    assert adapter.apply({"op": "run"}).ok
    cache = adapter.engine.cache
    assert adapter.apply({"op": "reuse", "prompt_ids": [1, 9], "max_new_tokens": None}).ok
    assert adapter.engine.cache is cache and adapter.observe().cache_committed == 0
    assert adapter.apply({"op": "run"}).ok
    again = adapter.observe()
    assert again.output_ids == fresh.output_ids and np.array_equal(again.score_row, fresh.score_row)


def test_snapshot_restore_continues_like_the_uninterrupted_run(adapter):
    """A pending-suffix snapshot (a deep copy of HF's cache) continues like the uninterrupted greedy run."""
    whole = run(adapter, tiny(max_new_tokens=6))
    adapter.reset(tiny(max_new_tokens=6))
    for _ in range(3):
        assert adapter.apply({"op": "step"}).ok
    assert adapter.apply({"op": "snapshot", "form": "pending_suffix", "id": "s"}).data == {"snapshot": "s"}
    assert adapter.apply({"op": "run"}).ok
    assert adapter.apply({"op": "restore", "snapshot": "s", "corrupt": None}).ok
    assert adapter.observe().output_ids == whole.output_ids[:3]
    assert adapter.apply({"op": "run"}).ok
    resumed = adapter.observe()
    assert resumed.output_ids == whole.output_ids and resumed.frontier == whole.frontier
    assert np.array_equal(resumed.score_row, whole.score_row)


@pytest.mark.parametrize("policy,path", [
    ({"family": "multinomial", "transforms": [{"name": "frequency_penalty", "penalty": 0.5}]}, "$.policy.transforms[0]"),
    ({"family": "multinomial", "transforms": [{"name": "top_n_sigma", "n": 1.0}]}, "$.policy.transforms[0]"),
    ({"family": "multinomial", "transforms": [{"name": "repetition_penalty", "penalty": 1.3, "history": "output"}]},
     "$.policy.transforms[0]"),
    ({"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.0}]}, "$.policy.transforms"),
    ({"family": "greedy", "empty_support": "fallback_eos"}, "$.policy.empty_support"),
])
def test_policies_hf_cannot_honour_are_refused(adapter, policy, path):
    """adapter.unsupported at reset (nothing built) for what HF has no processor or option for."""
    with pytest.raises(Rejection) as err:
        adapter.reset(tiny(policy=policy))
    assert err.value.code == ADAPTER_UNSUPPORTED and err.value.path == path


def test_a_refused_reset_observes_rejected_and_refuses_every_action(adapter):
    """transition.admit refused (peer.py): observe() reports phase 'rejected' with nothing built, every action is
    refused with transition.not_enabled and changes nothing, and the next reset admits a request again."""
    from decodespec.spec.transitions import NOT_ENABLED

    run(adapter, tiny())  # a finished request before the refused one: none of it may show through
    with pytest.raises(Rejection) as err:
        adapter.reset(tiny(policy={"family": "multinomial", "transforms": [{"name": "top_n_sigma", "n": 1.0}]}))
    assert err.value.code == ADAPTER_UNSUPPORTED
    obs = adapter.observe()
    assert obs.phase == "rejected" and obs.output_ids == () and obs.finish_reason is None
    assert obs.frontier is None and obs.score_row is None and obs.cache_committed is None  # nothing was built
    for op in ({"op": "step"}, {"op": "run"}, {"op": "snapshot", "form": "pending_suffix", "id": "s"}):
        result = adapter.apply(op)
        assert not result.ok and result.code == NOT_ENABLED, (op, result)
        assert adapter.observe().summary() == obs.summary()
    adapter.reset(tiny())
    assert adapter.observe().phase == "ready"

def test_generation_config_maps_each_transform_to_its_hf_field():
    """The GenerationConfig fields _get_logits_processor reads, one per transform."""
    from decodespec.checks.adapters.hf import generation_config

    policy = {"family": "multinomial", "order": "hf", "transforms": [
        {"name": "logit_bias", "bias": {"3": 1.5}}, {"name": "repetition_penalty", "penalty": 1.2},
        {"name": "no_repeat_ngram", "n": 3}, {"name": "bad_words", "sequences": [[4, 5]]}, {"name": "temperature", "temperature": 0.7},
        {"name": "top_k", "k": 9}, {"name": "top_p", "p": 0.9}, {"name": "min_p", "p": 0.05}, {"name": "typical", "p": 0.8},
        {"name": "epsilon", "epsilon": 0.01}, {"name": "eta", "epsilon": 0.02}]}
    gen = generation_config(tiny(policy=policy, min_new_tokens=2), max_length=10)
    assert gen.do_sample and gen.max_length == 10 and gen.min_new_tokens == 2 and gen.eos_token_id == [2]
    assert gen.sequence_bias == {(3,): 1.5} and gen.bad_words_ids == [[4, 5]] and gen.no_repeat_ngram_size == 3
    assert (gen.repetition_penalty, gen.temperature, gen.top_k, gen.top_p, gen.min_p, gen.typical_p) == (1.2, 0.7, 9, 0.9, 0.05, 0.8)
    assert (gen.epsilon_cutoff, gen.eta_cutoff) == (0.01, 0.02)


def _step_wise(adapter, config: CaseConfig) -> tuple[list[int], np.ndarray]:
    """The adapter's committed ids and every raw logits row ``float32[steps, V]``, one step at a time."""
    adapter.reset(config)
    rows = []
    while adapter.observe().phase != "finished":
        assert adapter.apply({"op": "step"}).ok
        rows.append(adapter.observe().score_row)
    return list(adapter.observe().output_ids), np.stack(rows)


@pytest.mark.parametrize("cache", ["dynamic", "static", "none"])
def test_step_wise_greedy_is_hfs_generate(adapter, cache):
    """The step-wise path is HF's own loop: the ids and every raw logits row of model.generate(...), bit for bit.

    Bitwise equality is asserted only where both sides provably make the same calls on the same
    shapes, so the same CPU kernels run whatever ``ATEN_CPU_CAPABILITY`` and thread count: the same
    cache object kind and, for a static cache, the same ``max_cache_len``.  ``generate`` sizes its
    static cache to ``max_length - 1`` = L + G - 1 slots (transformers' ``_prepare_cache_for_generation``:
    the last token is never written), so the static case runs the adapter with that capacity; it
    then reaches the capacity's ``context_length`` after G - 1 tokens, and those rows are compared.
    """
    from decodespec.checks.adapters.hf import generate_sequence

    config = tiny(cache=cache, max_new_tokens=6)
    want = generate_sequence(config)
    if cache == "static":
        config = config.evolve(static_capacity=config.prompt_len + config.max_new_tokens - 1)
    ids, rows = _step_wise(adapter, config)
    assert len(ids) == (5 if cache == "static" else 6)
    assert ids == want["output_ids"][0][:len(ids)]
    assert np.array_equal(rows, want["logits"][:len(rows)])


def test_step_wise_greedy_on_another_static_capacity_is_hfs_generate_within_the_tolerance(adapter):
    """A static cache of another capacity (the adapter's default S = L + G + 1 against generate's L + G - 1) is another
    call shape: SDPA reduces over S key slots (the unwritten ones masked), and on some CPUs (AVX-512, or another thread
    count) the blocking of that reduction and so the float32 rounding differ.  What is provably true then: the same ids
    (every step's greedy margin is far above the difference) and rows within the declared HF tiny logit tolerance."""
    from decodespec.checks.adapters.hf import generate_sequence
    from decodespec.checks.gate.tolerance import tolerance_for

    config = tiny(cache="static", max_new_tokens=6)
    want = generate_sequence(config)
    ids, rows = _step_wise(adapter, config)
    assert ids == want["output_ids"][0]
    tol = tolerance_for("hf", "tiny", "float32")
    eps = np.array([tol.epsilon(row) for row in want["logits"]])  # per row: absolute plus relative to the row's scale
    assert (np.max(np.abs(rows - want["logits"]), axis=-1) <= eps).all()
    top2 = np.sort(want["logits"], axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0] > 2 * eps).all()  # the ids are decided


def test_step_wise_sampling_is_hfs_generate_under_the_same_global_seed(adapter):
    """HF samples with the global torch RNG: under one manual_seed the adapter draws what generate(do_sample=True) draws."""
    from decodespec.checks.adapters.hf import generate_sequence

    config = tiny(policy=SAMPLED, max_new_tokens=8, seed=5)
    want = generate_sequence(config)["output_ids"][0]
    assert list(run(adapter, config).output_ids) == want


@requires_smollm2
@pytest.mark.smollm2
def test_smollm2_step_wise_greedy_is_hfs_generate(adapter, hf_smollm2):
    """On SmolLM2 (the session's HF model from the GGUF file): HF generate's ids and raw logits rows."""
    from decodespec.checks.adapters.hf import adopt_model, generate_sequence

    adopt_model(hf_smollm2, "smollm2")
    config = CaseConfig(model="smollm2", prompt_ids=(504, 3575, 282, 4649, 314), max_new_tokens=4, eos_ids=[2])
    want = generate_sequence(config, text=False)
    adapter.reset(config)
    rows = []
    while adapter.phase.value != "finished":  # the controller's own fields: observe() would also load HF's tokenizer
        assert adapter.apply({"op": "step"}).ok
        rows.append(adapter.latest_score[1])
    assert adapter.output_ids == want["output_ids"][0] == [7042, 30, 198, 198]  # " Paris.\n\n"
    assert np.array_equal(np.stack(rows), want["logits"])


def test_a_forced_constraint_is_hfs_prefix_allowed_tokens_fn(adapter):
    """policy constraint -> generate(prefix_allowed_tokens_fn=...): step-wise and generate both emit exactly the forced ids;
    an id without a transition leaves HF an empty allowed list, which is the spec's policy.empty_support: the decision
    finishes the request with constraint_error (M3.10 0x02 branch table), keeping the committed id."""
    from decodespec.checks.adapters.hf import constraint_fn, generate_sequence
    from decodespec.checks.gate.cases import forced

    config = tiny(policy=forced([77, 78, 79]), max_new_tokens=3)
    allowed = constraint_fn(config)
    ids = torch.tensor(list(PROMPT) + [77, 78])
    assert allowed(0, ids[:len(PROMPT)]) == [77] and allowed(0, ids) == [79] and allowed(0, torch.tensor([*PROMPT, 5])) == []
    assert constraint_fn(tiny()) is None
    assert list(run(adapter, config).output_ids) == [77, 78, 79] == generate_sequence(config)["output_ids"][0]
    adapter.reset(tiny(policy=forced([77]), max_new_tokens=3))
    assert adapter.apply({"op": "step"}).ok
    assert adapter.apply({"op": "decode"}).ok
    finished = adapter.apply({"op": "decide"})
    assert finished.ok and finished.data == {"finish_reason": "constraint_error"}
    obs = adapter.observe()
    assert list(obs.output_ids) == [77] and obs.phase == "finished" and obs.finish_reason == "constraint_error"
    assert not adapter.apply({"op": "decide"}).ok
