"""HF reconciliation: the spec under ``BeamParams.hf_compatible`` equals HF transformers' beam search.

HF ``generate(num_beams=K, length_penalty=a, early_stopping=...)`` runs on a tiny random Llama
(V = 10, one layer) whose log-probabilities are also the spec's ``score_fn`` (an uncached forward
of the whole prefix).  The returned sequences, ``sequences_scores`` (length-normalized) and
``beam_indices`` (the parent slot of every token) must equal the spec's best ``K`` hypotheses,
their normalized scores and their ancestry, for all three ``early_stopping`` settings and
several length penalties.  Differences between HF and the spec's normative parameters are
listed in docs/beam-expectations.md; this file pins the HF facts that page relies on.
"""

from __future__ import annotations

import numpy as np
import pytest

from decodespec.checks.testing import requires_hf
from decodespec.spec import beam as B

pytestmark = [requires_hf, pytest.mark.hf]

torch = pytest.importorskip("torch")

VOCAB, EOS, PAD, PROMPT, MAX_NEW = 10, 2, 0, (1, 5, 3), 7


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                      eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked rows: EOS completions and diverging beams
    return model


@pytest.fixture(scope="module", params=[0, 2], ids=lambda s: f"seed{s}")
def peer(request):
    model = tiny_llama(request.param)
    cache: dict[tuple[int, ...], np.ndarray] = {}

    def score_fn(prefix):
        if prefix not in cache:
            with torch.no_grad():
                logits = model(torch.tensor([prefix])).logits[0, -1].float()
            cache[prefix] = torch.log_softmax(logits, dim=-1).double().numpy()
        return cache[prefix]

    return model, score_fn


def hf_generate(model, num_beams, eos, **kw):
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=num_beams,
                              num_return_sequences=num_beams, max_new_tokens=MAX_NEW, do_sample=False,
                              return_dict_in_generate=True, output_scores=True, eos_token_id=eos, pad_token_id=PAD,
                              **kw)


def strip_fill(row, fill):
    """HF's output row after the prompt, without the trailing fill value."""
    out = list(row[len(PROMPT):])
    while out and out[-1] == fill:
        out.pop()
    return out


def assert_same_as_hf(out, params, result, num_beams, eos):
    for before, record, after in result.transitions():
        assert B.check_step(params, before, record, after) == ()
    fill = PAD or eos[0]  # HF: `pad_token_id or eos_token_id[0]`, so pad id 0 fills with EOS
    hyps = result.returned(num_beams)
    assert len(hyps) == out.sequences.shape[0] == num_beams
    for row, scores, parents, h in zip(out.sequences.tolist(), out.sequences_scores.tolist(),
                                       out.beam_indices.tolist(), hyps):
        ids = list(h.output_ids)
        # The fill value may equal the final EOS; compare the spec's ids after the same strip.
        stripped = ids[:]
        while stripped and stripped[-1] == fill:
            stripped.pop()
        assert strip_fill(row, fill) == stripped
        assert row[len(PROMPT):len(PROMPT) + len(ids)] == ids
        assert scores == pytest.approx(h.normalized, rel=1e-5, abs=1e-6)
        assert parents[: h.length] == list(h.ancestry) and all(p == -1 for p in parents[h.length:])


@pytest.mark.parametrize("early_stopping", [True, False, "never"], ids=lambda e: f"early_stopping={e}")
@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.5, 2.0], ids=lambda a: f"lp={a}")
@pytest.mark.parametrize("num_beams", [2, 3, 4])
def test_spec_with_hf_parameters_equals_hf_beam_search(peer, num_beams, alpha, early_stopping):
    """transition.beam_step, transition.beam_stop under BeamParams.hf_compatible: HF's sequences,
    sequences_scores and beam_indices are the spec's best K hypotheses, normalized scores, ancestry."""
    model, score_fn = peer
    out = hf_generate(model, num_beams, EOS, length_penalty=alpha, early_stopping=early_stopping)
    params = B.BeamParams.hf_compatible(num_beams, MAX_NEW, [EOS], length_penalty=alpha,
                                        early_stopping=early_stopping)
    assert_same_as_hf(out, params, B.beam_search(score_fn, PROMPT, params), num_beams, [EOS])


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_two_eos_ids_widen_hfs_window_but_not_the_answer(peer, early_stopping):
    """selector.beam_topk: HF keeps max(2, 1 + #EOS) * K candidates; the spec's refill gives the same set."""
    model, score_fn = peer
    eos = [EOS, 7]
    out = hf_generate(model, 2, eos, length_penalty=1.0, early_stopping=early_stopping)
    params = B.BeamParams.hf_compatible(2, MAX_NEW, eos, length_penalty=1.0, early_stopping=early_stopping)
    assert params.hf_candidate_window == 6
    assert_same_as_hf(out, params, B.beam_search(score_fn, PROMPT, params), 2, eos)


def test_width_one_hf_parameters_equal_hf_greedy(peer):
    """HF routes num_beams=1 to greedy search; the spec's width-1 beam under HF parameters is the same path."""
    model, score_fn = peer
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=1, max_new_tokens=MAX_NEW,
                             do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    result = B.beam_search(score_fn, PROMPT, B.BeamParams.hf_compatible(1, MAX_NEW, [EOS]))
    assert out[0, len(PROMPT):].tolist() == list(result.best.output_ids)


def test_hf_default_heuristic_misses_a_better_hypothesis_that_the_exact_bound_keeps():
    """transition.beam_stop: HF early_stopping=False (the default) with length_penalty=1 stops on
    s / lp(g) and returns a worse hypothesis than the finite-beam trace holds; the spec's normative
    exact bound (s / lp(G) for alpha > 0) keeps searching and returns the trace's best."""
    model = tiny_llama(1)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=2, max_new_tokens=12,
                             do_sample=False, return_dict_in_generate=True, output_scores=True, eos_token_id=EOS,
                             pad_token_id=PAD, length_penalty=1.0, early_stopping=False)

    def score_fn(prefix):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prefix])).logits[0, -1].float(), dim=-1).double().numpy()

    hf_best = strip_fill(out.sequences[0].tolist(), EOS) + [EOS]
    pen = B.LengthPenalty(alpha=1.0)
    exact = B.beam_search(score_fn, PROMPT, B.BeamParams(2, 12, [EOS], length_penalty=pen, early_stop="exact"))
    at_cap = B.beam_search(score_fn, PROMPT, B.BeamParams(2, 12, [EOS], length_penalty=pen, early_stop="at_cap"))
    assert hf_best == [6, 8, EOS]
    assert (exact.best.output_ids, exact.best.score) == (at_cap.best.output_ids, at_cap.best.score)
    assert exact.best.length == 12 and exact.best.normalized > out.sequences_scores[0].item()
