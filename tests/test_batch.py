"""Padded batches (M3.10 0x07): every row of a left- or right-padded batch equals its unbatched run.

Evidence, per row: identical tokens, finish reason and frontier as the single-request runtime
(:func:`decodespec.impl.generate.generate`), logprobs and every decided score row within the
model's declared logit tolerance of the no-cache reference (one full forward of the unpadded
prompt and outputs), for the dynamic and the static cache.  The tensors handed to the model
agree with the spec's pure position functions (``decodespec.spec.positions``): the prompt
call's translation receipts, the decode calls' positions (``call_positions``), the greatest
valid column (``decision_column``) and the cached causal mask intersected with key validity.
Bad masks are refused with ``runtime.invalid_mask`` / ``runtime.empty_input_row``.

Tolerances: ``tests/runtime_helpers.py`` ``LOGIT_TOL`` (tiny 5e-5, SmolLM2 2e-4, float32 CPU).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from runtime_helpers import LOGIT_TOL, sampled_policy  # tests/ is on sys.path

from decodespec.checks.testing import requires_smollm2
from decodespec.impl.batch import (
    CACHE_LAYOUT,
    PaddedBatch,
    batch_generate,
    check_attention_mask,
    decision_columns,
    gather_decision_rows,
    position_ids_from_mask,
    translation_receipts,
)
from decodespec.impl.generate import generate
from decodespec.impl.model import build_attention_mask
from decodespec.spec.enums import FinishReason
from decodespec.spec.errors import Rejection
from decodespec.spec.policy import policy_config_from_json
from decodespec.spec.positions import (
    cached_causal_mask,
    call_positions,
    decision_column,
    intersect_key_validity,
    translation_receipt,
)

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [40, 41, 42, 43]]


# --------------------------------------------------------------------------------------------
# The mask contract.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mask", "code", "path"),
    [
        (torch.tensor([[0.0, float("-inf")]]), "runtime.invalid_mask", "$.attention_mask[0][1]"),  # an additive mask
        (torch.tensor([[1, 2, 1]]), "runtime.invalid_mask", "$.attention_mask[0][1]"),  # not Boolean
        (torch.tensor([1, 1]), "runtime.invalid_mask", "$.attention_mask"),  # rank 1
        (torch.tensor([[1, 1, 1], [1, 0, 1]]), "runtime.invalid_mask", "$.attention_mask[1]"),  # interior hole
        (torch.tensor([[1, 1, 1], [0, 0, 0]]), "runtime.empty_input_row", "$.attention_mask[1]"),  # no owner row
    ],
)
def test_bad_masks_are_refused_with_typed_errors(mask, code, path):
    """runtime.invalid_mask / runtime.empty_input_row, naming the row; the caller's tensor is unchanged."""
    before = mask.clone()
    with pytest.raises(Rejection) as err:
        check_attention_mask(mask)
    assert err.value.code == code and err.value.path == path
    assert torch.equal(mask, before)


def test_bad_batches_are_refused_before_any_call(tiny_model):
    """runtime.invalid_request / runtime.empty_input_row before the model runs."""
    cases = [
        ({"prompts": [[1], []]}, "runtime.empty_input_row"),
        ({"prompts": [[1], [2]], "max_new_tokens": [1]}, "runtime.invalid_request"),
        ({"prompts": [[1], [2]], "max_new_tokens": 0}, "runtime.invalid_request"),
        ({"prompts": [[1], [2]], "cache": "none"}, "runtime.invalid_request"),
        ({"prompts": [[1], [2]], "padding_side": "middle"}, "runtime.invalid_request"),
        ({"prompts": [[1], [2]], "policy": policy_config_from_json({"family": "beam", "num_beams": 2})}, "runtime.invalid_request"),
        ({"prompts": [[1], [2]], "identities": ["only-one"]}, "runtime.invalid_request"),
    ]
    for kwargs, code in cases:
        kwargs.setdefault("max_new_tokens", 2)
        with pytest.raises(Rejection) as err:
            batch_generate(tiny_model, **kwargs)
        assert err.value.code == code, kwargs


@st.composite
def _masks(draw):
    width = draw(st.integers(1, 9))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        length = draw(st.integers(1, width))
        start = draw(st.integers(0, width - length))
        rows.append([1 if start <= c < start + length else 0 for c in range(width)])
    return rows


@given(_masks())
def test_receipts_positions_and_decision_columns_agree_with_the_spec(rows):
    """The tensors agree with spec.positions translation_receipt (rectangular) and decision_column."""
    valid = check_attention_mask(torch.tensor(rows))
    positions = position_ids_from_mask(valid)
    receipts = translation_receipts(valid, positions, torch.arange(valid.shape[1]))
    for b, row in enumerate(rows):
        spec = translation_receipt(row, cache_layout=CACHE_LAYOUT)
        assert receipts[b] == spec
        assert tuple(positions[b].tolist()) == spec.position_ids()
        assert int(decision_columns(valid)[b]) == decision_column(row) == spec.decision_column


def test_the_decision_row_is_the_greatest_valid_column_not_the_last_or_count_minus_one(tiny_model):
    """M3.10 0x07: out[:, -1] reads a PAD row under right padding, lengths - 1 under left padding."""
    for side in ("left", "right"):
        batch = PaddedBatch.from_prompts(PROMPTS, padding_side=side)
        with torch.inference_mode():
            logits = tiny_model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits  # [B, T, V]
            alone = [tiny_model(torch.tensor([p])).logits[0, -1] for p in PROMPTS]
        gathered = gather_decision_rows(logits, batch.decision_columns)  # [B, V]
        naive = logits[:, -1] if side == "right" else gather_decision_rows(logits, batch.attention_mask.sum(-1) - 1)
        for b in range(len(PROMPTS)):
            torch.testing.assert_close(gathered[b], alone[b], rtol=0, atol=LOGIT_TOL["tiny"])
        short = 1  # the 2-token prompt: its naive row is a PAD column
        assert float((naive[short] - alone[short]).abs().max()) > 0.5


# --------------------------------------------------------------------------------------------
# Generation: rows equal their unbatched runs.
# --------------------------------------------------------------------------------------------


def _reference_scores(model, prompt, output_ids) -> torch.Tensor:
    """No-cache reference: the score row of every decision from one full forward, ``[O, V]``."""
    ids = torch.tensor([list(prompt) + list(output_ids[:-1])])
    with torch.inference_mode():
        return model(ids).logits[0, len(prompt) - 1:].float()


def _assert_rows_equal_unbatched(model, result, prompts, limits, tol, *, policies=None, seeds=None, identities=None, eos=()):
    for b, prompt in enumerate(prompts):
        kwargs = {}
        if policies is not None:
            kwargs = {"policy": policies[b], "seed": seeds[b], "identity": identities[b]}
        alone = generate(model, prompt, max_new_tokens=limits[b], eos_token_ids=eos, **kwargs)
        row = result.rows[b]
        assert row.output_ids == alone.output_ids, b
        assert (row.finish_reason, row.triggers, row.frontier) == (alone.finish_reason, alone.triggers, alone.frontier)
        assert row.rng_counter == alone.rng_counter
        assert [r.draws for r in row.receipts] == [r.draws for r in alone.receipts]
        assert max(abs(x - y) for x, y in zip(row.logprobs, alone.logprobs)) <= tol
        scores = torch.stack(result.scores[b])  # [O, V]
        torch.testing.assert_close(scores, _reference_scores(model, prompt, row.output_ids), rtol=0, atol=tol)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_greedy_rows_equal_their_unbatched_runs_tiny(tiny_model, side, cache):
    limits = [5, 3, 7]
    result = batch_generate(tiny_model, PROMPTS, max_new_tokens=limits, padding_side=side, cache=cache, eos_token_ids=(), return_scores=True)
    assert [len(r.output_ids) for r in result.rows] == limits
    _assert_rows_equal_unbatched(tiny_model, result, PROMPTS, limits, LOGIT_TOL["tiny"])


@pytest.mark.parametrize("side", ["left", "right"])
def test_sampled_rows_own_their_policy_and_rng(tiny_model, side):
    """Each row's draws come from its own RequestRng (identity, seed); finished rows draw nothing."""
    greedy = policy_config_from_json({"family": "greedy"})
    policies = [sampled_policy(), greedy, sampled_policy()]
    seeds, identities, limits = [3, None, 11], ["req-a", "req-b", "req-c"], [6, 4, 2]
    result = batch_generate(tiny_model, PROMPTS, max_new_tokens=limits, policy=policies, seeds=seeds, identities=identities,
                            padding_side=side, eos_token_ids=(), return_scores=True)
    assert [r.rng_counter for r in result.rows] == [6, 0, 2]  # one draw per sampled decision, none after finishing
    _assert_rows_equal_unbatched(tiny_model, result, PROMPTS, limits, LOGIT_TOL["tiny"], policies=policies, seeds=seeds, identities=identities)
    swapped = batch_generate(tiny_model, PROMPTS, max_new_tokens=limits, policy=policies, seeds=[4, None, 11], identities=identities,
                             padding_side=side, eos_token_ids=())
    assert swapped.rows[0].output_ids != result.rows[0].output_ids  # row 0's seed drives row 0 ...
    assert swapped.rows[2].output_ids == result.rows[2].output_ids  # ... and nothing else


def test_finished_rows_are_masked_out_and_never_expand(tiny_model):
    """M3.10 0x06/0x0B: a row finished by EOS is fed PAD at an invalid column and gets no decision."""
    first = generate(tiny_model, PROMPTS[1], max_new_tokens=1, eos_token_ids=()).output_ids[0]
    eos = (first,)
    result = batch_generate(tiny_model, PROMPTS, max_new_tokens=6, eos_token_ids=eos, padding_side="right", return_scores=True)
    short = result.rows[1]
    assert short.output_ids == (first,) and short.finish_reason is FinishReason.EOS and short.text == ""
    assert short.frontier == {"prompt_len": 2, "output_count": 1, "pending": 1, "processed": 2, "pending_tag": "CLOSED_UNPROCESSED"}
    _assert_rows_equal_unbatched(tiny_model, result, PROMPTS, [6, 6, 6], LOGIT_TOL["tiny"], eos=eos)
    for call in result.calls[1:]:
        assert call.active[1] is False and call.decision_columns[1] is None and call.receipts[1] is None
        assert call.key_validity[1][call.cache_position[0]] is False  # the PAD column is never a key
        assert call.position_ids[1] == (0,)
    assert len(short.receipts) == 1


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_every_call_agrees_with_the_spec_positions(tiny_model, side, cache):
    """Receipts, positions (call_positions), post-append masks and the cached causal mask per call."""
    limits = [4, 2, 3]
    result = batch_generate(tiny_model, PROMPTS, max_new_tokens=limits, padding_side=side, cache=cache, eos_token_ids=())
    batch = PaddedBatch.from_prompts(PROMPTS, padding_side=side)
    width = batch.width
    prompt_call = result.calls[0]
    for b, row in enumerate(batch.attention_mask.tolist()):
        assert prompt_call.receipts[b] == translation_receipt(row, cache_layout="rectangular")
        assert prompt_call.decision_columns[b] == decision_column(row)
    previous = None
    for call in result.calls:
        start, length = call.cache_position[0], len(call.cache_position)
        assert call.cache_position == tuple(range(start, start + length))
        validity = torch.tensor(call.key_validity)  # [B, S_k]
        if previous is not None:  # the post-append revision: previous columns, then this call's column
            assert torch.equal(validity[:, :start], previous[:, :start])
            assert validity[:, start].tolist() == list(call.active)
        if cache == "static":
            assert validity.shape[1] == width + max(limits) - 1 and not validity[:, start + length:].any()
        model_mask = build_attention_mask(torch.tensor(call.cache_position), torch.arange(validity.shape[1]), validity, torch.float32)
        for b in range(len(PROMPTS)):
            spec = intersect_key_validity(cached_causal_mask(start, length), validity[b, : start + length].tolist())
            assert (model_mask[b, 0, :, : start + length] == 0).tolist() == [list(r) for r in spec]
            if call.call_id > 0 and call.active[b]:
                semantic = len(PROMPTS[b]) + call.call_id - 1  # L_b + k: the row's own next position
                assert call.position_ids[b] == call_positions(semantic, 1)
                entry = call.receipts[b].entries[0]
                assert (entry.row_idx, entry.position_id, entry.cache_slot) == (semantic, semantic, width + call.call_id - 1)
        previous = validity


# --------------------------------------------------------------------------------------------
# The real model.
# --------------------------------------------------------------------------------------------


@requires_smollm2
@pytest.mark.smollm2
@pytest.mark.parametrize(("side", "cache"), [("left", "dynamic"), ("right", "static")])
def test_greedy_rows_equal_their_unbatched_runs_smollm2(smollm2_model, smollm2_tokenizer, side, cache):
    texts = ["The capital of France is", "Hello", "def add(a, b):\n    return"]
    prompts = [smollm2_tokenizer.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == 3  # three different lengths: real padding on both sides
    limits = [4, 4, 4]
    result = batch_generate(smollm2_model, prompts, max_new_tokens=limits, padding_side=side, cache=cache, eos_token_ids=(),
                            return_scores=True, tokenizer=smollm2_tokenizer)
    _assert_rows_equal_unbatched(smollm2_model, result, prompts, limits, LOGIT_TOL["smollm2"])
    assert result.rows[0].text == smollm2_tokenizer.decode(list(result.rows[0].output_ids))
