"""Checks of the padded-batch runtime (impl/batch.py) that kill Cosmic Ray's survivors.

The screen of a sampled Cosmic Ray session over ``impl/batch.py`` (tests/test_batch.py and the
other users of the module on the tiny model; docs/results/mutation-sampled-cache-beam-batch.md)
left some mutants alive: refusals whose path or bound is never compared, a text that only a
tokenizer shows, boundaries that the fixed prompts do not reach.  Each check here asserts a
value derived by hand or from the spec's position functions, and its docstring names the mutants
it kills (line, operator, occurrence, of ``impl/batch.py`` at commit 61ec8ad).

Rules: M3.10 0x07 (Boolean mask, empty rows, greatest valid column), 0x06 (finished rows),
0x0A (translation receipts).
"""

from __future__ import annotations

import attrs
import pytest
import torch

from decodespec.impl.batch import PaddedBatch, batch_generate, check_attention_mask, closed_result, commit_triggers
from decodespec.spec.enums import FinishReason
from decodespec.spec.errors import Rejection


def _refusal(fn, *args, **kwargs) -> Rejection:
    with pytest.raises(Rejection) as err:
        fn(*args, **kwargs)
    return err.value


def test_more_identities_than_rows_are_refused(tiny_model):
    """Three identities for two rows are ``runtime.invalid_request`` at ``$.identities``, as one is.

    Kills line 457 ``len(names) != num_rows`` -> ``<`` (NotEq_Lt 7).
    """
    for names in (["a"], ["a", "b", "c"]):
        err = _refusal(batch_generate, tiny_model, [[1], [2]], max_new_tokens=1, identities=names)
        assert (err.code, err.path) == ("runtime.invalid_request", "$.identities")


def test_the_first_row_with_a_hole_is_named():
    """Rows 1 and 2 both have an interior hole: the refusal names row 1, the first.

    Kills line 138 ``holes[0]`` -> ``holes[-1]`` (NumberReplacer 29).
    """
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 0, 1]])
    err = _refusal(check_attention_mask, mask)
    assert (err.code, err.path) == ("runtime.invalid_mask", "$.attention_mask[1]")


class _IdText:
    """A tokenizer whose text is the ids themselves (``decode([5, 6]) == "5,6"``): every dropped id shows."""

    def decode(self, ids):
        return ",".join(str(i) for i in ids)


def test_an_eos_closed_row_drops_only_its_final_eos_from_the_text():
    """``closed_result`` of ``[7, 8, 9, EOS]`` closed by EOS: the text holds ``7, 8, 9``; closed by length, all four.

    Kills line 580 ``ids[:-1]`` -> ``ids[:+1]`` (USub_UAdd 15).
    """
    ids = [7, 8, 9, 2]
    res = closed_result([1, 2], ids, [0.0] * 4, {FinishReason.EOS}, tokenizer=_IdText())
    assert res.text == "7,8,9"
    assert res.output_ids == (7, 8, 9, 2) and res.finish_reason is FinishReason.EOS
    assert res.frontier == {"prompt_len": 2, "output_count": 4, "pending": 1, "processed": 5, "pending_tag": "CLOSED_UNPROCESSED"}
    assert closed_result([1, 2], ids, [0.0] * 4, {FinishReason.LENGTH}, tokenizer=_IdText()).text == "7,8,9,2"


def test_a_commit_at_the_window_fires_context_length():
    """``L + O >= C`` fires ``context_length``: L = 3, O = 2 at C = 5 fires it, C = 6 does not.

    Kills line 558 ``num_prompt + num_output`` -> ``-`` (Add_Sub 4).
    """
    assert commit_triggers(7, 3, 2, 10, (), 5) == {FinishReason.CONTEXT_LENGTH}
    assert commit_triggers(7, 3, 2, 10, (), 6) == set()
    assert commit_triggers(7, 3, 2, 2, (7,), 5) == {FinishReason.EOS, FinishReason.LENGTH, FinishReason.CONTEXT_LENGTH}


def test_a_callers_rectangle_is_validated_and_runs_as_the_padded_prompts(tiny_model):
    """``PaddedBatch.from_tensors``: integer ids of the mask's shape are taken (prompts read from the valid
    columns, positions, decision columns) and generate as ``from_prompts``; bool, float or misshapen ids are
    ``runtime.invalid_mask`` at ``$.input_ids``.

    Kills line 276 ``input_ids.dtype == torch.bool`` -> ``>`` (Eq_Gt 1: dtypes have no order, so every
    integer rectangle raised TypeError), ``!=`` (Eq_NotEq 1), ``shape != valid.shape`` -> ``<`` (NotEq_Lt 5:
    a wider rectangle), the first ``or`` -> ``and`` (ReplaceOrWithAnd 3), and line 267's ``@classmethod``
    removed (RemoveDecorator 4).
    """
    ids = torch.tensor([[9, 9, 5, 6, 7], [11, 12, 13, 14, 15], [9, 9, 9, 40, 41]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    batch = PaddedBatch.from_tensors(ids, mask)
    assert batch.prompt_ids == ((5, 6, 7), (11, 12, 13, 14, 15), (40, 41))
    assert batch.position_ids.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 1]]
    assert batch.decision_columns.tolist() == [4, 4, 4] and batch.padding_side is None
    ours = batch_generate(tiny_model, batch, max_new_tokens=3, eos_token_ids=())
    ref = batch_generate(tiny_model, [list(p) for p in batch.prompt_ids], max_new_tokens=3, eos_token_ids=())
    assert [r.output_ids for r in ours.rows] == [r.output_ids for r in ref.rows]
    for bad in (ids.bool(), ids.float(), ids[:, :4], torch.cat([ids, ids[:, :1]], dim=1), ids[:2]):
        err = _refusal(PaddedBatch.from_tensors, bad, mask)
        assert (err.code, err.path) == ("runtime.invalid_mask", "$.input_ids")


@pytest.mark.parametrize(("config_pad", "fed"), [(7, 7), (None, 0)])
def test_padding_columns_and_finished_rows_are_fed_the_configs_pad_id(tiny_model, monkeypatch, config_pad, fed):
    """Without ``pad_token_id`` the batch feeds the config's ``pad_token_id`` (0 when it has none) at every
    padding column and to a finished row; read from the ``input_ids`` the model is called with.

    Kills line 448 ``config.pad_token_id is not None`` -> ``is None`` (IsNot_Is 0: the tiny config's pad is
    0, so only another pad id, or none, shows it).
    """
    monkeypatch.setattr(tiny_model, "config", attrs.evolve(tiny_model.config, pad_token_id=config_pad))
    seen = []
    handle = tiny_model.register_forward_pre_hook(lambda _m, args, kwargs: seen.append((args[0] if args else kwargs["input_ids"]).clone()),
                                                  with_kwargs=True)
    try:
        result = batch_generate(tiny_model, [[5, 6, 7], [11]], max_new_tokens=[3, 1], eos_token_ids=())
    finally:
        handle.remove()
    assert seen[0].tolist() == [[5, 6, 7], [fed, fed, 11]]  # left padding
    assert [ids[1].tolist() for ids in seen[1:]] == [[fed], [fed]]  # row 1 finished after one token
    assert [len(r.output_ids) for r in result.rows] == [3, 1]


def test_per_row_lists_longer_than_the_batch_are_refused(tiny_model):
    """A per-row ``max_new_tokens`` (or ``seeds``) list of three for two rows is ``runtime.invalid_request``
    naming the argument, as a list of one is.

    Kills line 371 ``len(value) != batch`` -> ``<`` (NotEq_Lt 6).
    """
    for name, values in (("max_new_tokens", [1, 1, 1]), ("max_new_tokens", [1]), ("seeds", [1, 2, 3])):
        kwargs = {"max_new_tokens": 1, name: values}
        err = _refusal(batch_generate, tiny_model, [[1], [2]], **kwargs)
        assert (err.code, err.path) == ("runtime.invalid_request", f"$.{name}")


@pytest.mark.parametrize("bad", [True, 1.0, "7"])
def test_a_prompt_id_that_is_not_an_int_is_refused(bad):
    """``from_prompts`` refuses a bool, a float or a str id with ``runtime.invalid_request`` at the prompt.

    Kills line 306 ``isinstance(t, bool) or not isinstance(t, int)`` -> ``and`` (ReplaceOrWithAnd 5).
    """
    err = _refusal(PaddedBatch.from_prompts, [[1, 2], [3, bad]])
    assert (err.code, err.path) == ("runtime.invalid_request", "$.prompts[1]")


def test_scores_are_kept_only_when_asked(tiny_model):
    """``return_scores`` defaults to False: ``BatchResult.scores`` is ``None``.

    Kills line 413 ``return_scores: bool = False`` -> ``True`` (ReplaceFalseWithTrue 3).
    """
    assert batch_generate(tiny_model, [[5, 6], [7]], max_new_tokens=2, eos_token_ids=()).scores is None


def test_the_mask_checks_path_is_keyword_only():
    """``check_attention_mask(mask, *, path=...)``: the path is named in the refusal and cannot be passed by position.

    Kills line 99 ``*`` -> ``/`` (Mul_Div 0).
    """
    err = _refusal(check_attention_mask, torch.tensor([[1, 0, 1]]), path="$.m")
    assert err.path == "$.m[0]"
    with pytest.raises(TypeError):
        check_attention_mask(torch.tensor([[1, 1]]), "$.m")  # type: ignore[misc]


@pytest.mark.parametrize("shape", [(0, 3), (2, 0), (0, 0)])
def test_an_empty_mask_is_refused_as_a_whole(shape):
    """A mask with no row or no column is ``runtime.invalid_mask`` at ``$.attention_mask`` (not an empty
    row, not a valid empty batch).

    Kills line 116 ``0 in attention_mask.shape`` -> ``-1 in`` (NumberReplacer 3).
    """
    err = _refusal(check_attention_mask, torch.ones(shape))
    assert (err.code, err.path) == ("runtime.invalid_mask", "$.attention_mask")


def test_an_id_outside_the_vocabulary_is_refused_without_quoting_it():
    """batch_generate refuses a prompt id outside [0, V) with runtime.invalid_request naming the row, and the message
    never quotes the ids (user content); the model's own check counts them too."""
    from decodespec.impl.tiny import load_tiny
    from decodespec.spec.errors import Rejection

    model = load_tiny(seed=0)
    with pytest.raises(Rejection) as refused:
        batch_generate(model, [[5, 6], [5, 600]], max_new_tokens=2)
    assert refused.value.code == "runtime.invalid_request" and refused.value.path == "$.prompts[1]"
    assert "600" not in refused.value.message and "1 id(s)" in refused.value.message
    with pytest.raises(Rejection) as model_refusal:
        model(torch.tensor([[5, 600, 700]]))
    assert model_refusal.value.code == "model.invalid_input" and "600" not in model_refusal.value.message
    assert model_refusal.value.details["outside"] == 2
