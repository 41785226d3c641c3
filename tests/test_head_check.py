"""checks/gate/head_check.py and ``decodespec head-check``: a user's loss/head implementation against M3.8 0x05.

Rules checked: invariant.head_loss_row, invariant.head_mean_from_sum_and_count, invariant.head_gradients
(the checker's layers ROWS, REDUCTION, GRADIENT); mutants killed: mutant.head_chunk_mean,
mutant.head_valid_count_all_rows, mutant.head_smoothing_non_target, mutant.head_ignored_rows_trained,
mutant.head_bias_gradient_dropped.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from decodespec.checks.commands.cli import main
from decodespec.checks.gate import head_check as hc
from decodespec.spec.errors import Rejection
from decodespec.spec.rules import RULES

#: Where each mutant must die: (layer, case, check).
KILLS = {
    "head_chunk_mean": ("REDUCTION", "plain", "loss"),
    "head_valid_count_all_rows": ("REDUCTION", "ignored_uneven", "valid_count"),
    "head_smoothing_non_target": ("ROWS", "label_smoothing", "row_losses"),
    "head_ignored_rows_trained": ("ROWS", "ignored_uneven", "ignored_rows"),
    "head_bias_gradient_dropped": ("GRADIENT", "plain", "grad.bias"),
}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("fn", [hc.torch_reference, hc.torch_chunked, hc.torch_tiled])
def test_correct_schedules_pass_every_case(fn, dtype):
    v = hc.check_loss(fn, dtype=dtype)
    assert v.passed and v.cases_run == len(hc.loss_cases()) == 7, v


@pytest.mark.parametrize("name", sorted(KILLS))
def test_each_mutant_is_killed_at_its_layer(name):
    v = hc.check_loss(hc.LOSS_MUTANTS[name])
    assert not v.passed
    assert (v.layer, v.case, v.check) == KILLS[name], v
    assert v.rule == hc.LOSS_LAYERS[v.layer] and v.rule in RULES
    assert RULES[f"mutant.{name}"].kind == "mutant" and RULES[f"mutant.{name}"].section.startswith("M3.8 0x12")
    assert set(hc.LOSS_MUTANTS) == set(KILLS)


def test_first_failure_names_the_worst_row_and_both_values():
    v = hc.check_loss(hc.LOSS_MUTANTS["head_smoothing_non_target"])
    case = next(c for c in hc.loss_cases() if c.name == "label_smoothing")
    assert v.index is not None and case.labels[v.index[0]] != -100  # a row id of the case, a supervised one
    assert v.bound is not None and abs(v.actual - v.expected) > v.bound
    assert json.loads(json.dumps(v.to_json()))["layer"] == "ROWS"


def test_declared_tolerance_separates_the_dtypes():
    def off_by(delta):
        def fn(hidden, weight, bias, labels, *, ignore_index, label_smoothing):
            out = hc.torch_reference(hidden, weight, bias, labels, ignore_index=ignore_index, label_smoothing=label_smoothing)
            rows = out["row_losses"] + delta * (labels != ignore_index)
            return {**out, "row_losses": rows}
        return fn

    assert hc.check_loss(off_by(1e-7), dtype="float64").check == "row_losses"
    assert hc.check_loss(off_by(1e-7), dtype="float32").passed
    assert hc.check_loss(off_by(1e-3), dtype="float32").layer == "ROWS"
    # float16 and bfloat16 are accepted now (tolerances derived from the unit roundoff, tests/test_head_contracts.py).
    with pytest.raises(Rejection) as err:
        hc.check_loss(hc.torch_reference, dtype="int8")
    assert err.value.code == "head.invalid_input"


def test_interface_failures_are_verdicts():
    def raises(*a, **k):
        raise RuntimeError("boom")

    def wrong_type(*a, **k):
        return 3.0

    def not_differentiable(hidden, weight, bias, labels, *, ignore_index, label_smoothing):
        out = hc.torch_reference(hidden.detach(), weight.detach(), None if bias is None else bias.detach(), labels,
                                 ignore_index=ignore_index, label_smoothing=label_smoothing)
        return out

    v = hc.check_loss(raises)
    assert (v.layer, v.check) == ("INTERFACE", "call") and "boom" in v.message
    assert (hc.check_loss(wrong_type).layer, hc.check_loss(wrong_type).check) == ("INTERFACE", "outputs")
    v = hc.check_loss(not_differentiable)
    assert (v.layer, v.check) == ("GRADIENT", "loss")


def test_load_callable_errors():
    assert hc.load_callable("decodespec.checks.gate.head_check:torch_reference") is hc.torch_reference
    for bad in ("nocolon", "decodespec_nosuch_mod:f", "decodespec.checks.gate.head_check:nosuch", "decodespec.checks.gate.head_check:PASSED"):
        with pytest.raises(Rejection) as err:
            hc.load_callable(bad)
        assert err.value.code == "head.invalid_callable" and err.value.path == "$.implementation"


def test_cli_checks_a_user_module(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_loss.py").write_text(textwrap.dedent('''
        import torch.nn.functional as F

        def good(hidden, weight, bias, labels, *, ignore_index, label_smoothing):
            logits = F.linear(hidden, weight, bias)
            rows = F.cross_entropy(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
            n = int((labels != ignore_index).sum())
            return rows, rows.sum(), n, rows.sum() / n

        def mean_only(hidden, weight, bias, labels, *, ignore_index, label_smoothing):
            logits = F.linear(hidden, weight, bias)
            loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing)
            rows = F.cross_entropy(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
            return rows, rows.sum(), labels.numel(), loss
    '''))
    monkeypatch.chdir(tmp_path)
    assert main(["head-check", "my_loss:good"]) == 0
    assert "passed (7 cases" in capsys.readouterr().out
    assert main(["head-check", "my_loss:mean_only", "--json"]) == 1
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert (line["layer"], line["check"], line["rule"]) == ("REDUCTION", "valid_count", "invariant.head_mean_from_sum_and_count")
    assert main(["head-check", "my_loss:absent"]) == 2
    assert json.loads(capsys.readouterr().err)["error"]["code"] == "head.invalid_callable"
    assert main(["head-check"]) == 2
    capsys.readouterr()


def test_cli_mutants_are_all_killed(capsys):
    assert main(["head-check", "--mutants"]) == 0
    out = capsys.readouterr().out
    assert out.count("killed") == len(KILLS) and "SURVIVED" not in out
    assert main(["head-check", "--reference", "--dtype", "float32"]) == 0


# -- 0x09: weight tying on our models -------------------------------------------------------------
# Rules checked: invariant.head_tied_one_parameter, invariant.head_tied_gradient_accumulates; mutant.head_copy_not_tie.

def _batch(seed=1):
    import torch

    ids = torch.randint(3, 500, (2, 6), generator=torch.Generator().manual_seed(seed))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    return ids, labels


def test_tiny_is_tied_by_identity_and_accumulates_both_gradients(tiny_model):
    import torch

    from decodespec.spec.head_tying import tying_violations

    obs = hc.observe_tying(tiny_model, torch.optim.SGD(tiny_model.parameters(), lr=0.1))
    assert obs.same_parameter and obs.same_storage and obs.optimizer_entries == 1 and tying_violations(obs) == ()
    ids, labels = _batch()
    before = {id(p): p.grad for p in tiny_model.parameters()}
    rep = hc.tied_gradient_check(tiny_model, ids, labels)
    assert rep.shared and rep.accumulated, rep
    # Sparse: the rows of the input ids whose positions reach a supervised logit (the last column only
    # feeds its own, ignored, row under the causal mask); dense: every vocabulary row.
    assert rep.input_rows == len(set(ids[:, :-1].reshape(-1).tolist())) and rep.output_rows == 512
    assert {id(p): p.grad for p in tiny_model.parameters()} == before  # the shared model's grads are restored


def test_a_loader_that_copies_the_embedding_is_caught():
    import torch

    from decodespec.impl.tiny import load_tiny
    from decodespec.spec.head_tying import tying_violations

    tied, copied = load_tiny(seed=0, device="cpu"), hc.TYING_MUTANTS["head_copy_not_tie"](load_tiny(seed=0, device="cpu"))
    ids, labels = _batch(2)
    with torch.no_grad():  # equal values: every logit agrees, so a value comparison cannot see the bug
        assert torch.equal(tied(ids).logits, copied(ids).logits)
    obs = hc.observe_tying(copied, torch.optim.Adam(copied.parameters(), lr=1e-2))
    assert obs.equal_values and not obs.same_parameter
    assert tying_violations(obs) == ("copied_not_tied", "optimizer_duplicate")
    rep = hc.tied_gradient_check(copied, ids, labels)
    assert not rep.shared and not rep.accumulated  # the classifier term went to another buffer
    # One optimizer step: the tied table stays one object with one moment slot; the copies diverge.
    for model in (tied, copied):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        logits = model(ids).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, 512), labels.reshape(-1)).backward()
        opt.step()
        obs = hc.observe_tying(model, opt)
        if model is tied:
            assert obs.optimizer_states == 1 and tying_violations(obs) == ()
        else:
            assert obs.optimizer_states == 2 and not obs.equal_values
            assert tying_violations(obs) == ("not_tied", "optimizer_duplicate")


def test_smollm2_is_tied_in_our_loader(smollm2_model):
    import torch

    from decodespec.spec.head_tying import tying_violations

    assert smollm2_model.config.tie_word_embeddings
    embed, head = smollm2_model.model.embed_tokens.weight, smollm2_model.lm_head.weight
    assert head is embed and head.data_ptr() == embed.data_ptr() and tuple(head.shape) == (49152, 576)
    obs = hc.observe_tying(smollm2_model, torch.optim.SGD(smollm2_model.parameters(), lr=0.0))
    assert obs.optimizer_entries == 1 and tying_violations(obs) == ()
    # Declaring it untied would be a different model: the rule sees the shared Parameter.
    assert tying_violations(hc.observe_tying(smollm2_model, declared_tied=False)) == ("tied_but_declared_untied",)
    # The tied head counts once in the model's parameters (V*d not allocated twice).
    assert sum(1 for p in smollm2_model.parameters() if p is embed) == 1
