"""The llama.cpp peer's prompt logprobs (M3.10 0x02 "Prompt logprobs versus generated-token logprobs").

``LlamaCppEngine.prompt_logprobs`` reads llama.cpp's ``logits_all`` rows: row ``i`` scores ``x_{i+1}``.  The first
test drives it over a stand-in ``Llama`` (no llama.cpp needed) whose rows are built so that each position's answer
is known; the others run the real llama-cpp-python 0.3.36 (skipped with the setup command when it is absent): our
reading of its rows agrees with the float64 reference, and its own echo API is one row late -- the reason the
adapter does not use it (``checks/gate/expectations/llamacpp.toml`` ``[prompt_logprobs]``).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from decodespec.checks.adapters import llamacpp
from decodespec.spec.errors import DecodeSpecError
from decodespec.spec.prompt_logprobs import PromptLogprobsSpec

V = 16


class _Ctx:
    def kv_cache_clear(self) -> None:
        pass


class _FakeLlama:
    """``reset`` / ``eval`` / ``scores`` as llama-cpp-python's ``Llama`` with ``logits_all=True``: ``eval`` writes one
    row per evaluated token at ``n_tokens ..``.  Row ``p`` puts its maximum on ``(token_p * 3 + 1) % V``."""

    def __init__(self) -> None:
        self._ctx = _Ctx()
        self.scores = np.zeros((64, V), dtype=np.float32)
        self.n_tokens = 0
        self.evals: list[list[int]] = []

    def reset(self) -> None:
        self.n_tokens = 0

    def eval(self, tokens: list[int]) -> None:
        self.evals.append(list(tokens))
        for token in tokens:
            row = -np.arange(V, dtype=np.float32) * 0.1
            row[(token * 3 + 1) % V] = 5.0
            self.scores[self.n_tokens] = row
            self.n_tokens += 1


class _Config:
    def __init__(self, prompt_ids, prefill_chunk=None, cache="dynamic", model="smollm2"):
        self.prompt_ids, self.prefill_chunk, self.cache, self.model = tuple(prompt_ids), prefill_chunk, cache, model


@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("first", ["none", "omitted"])
def test_row_i_scores_the_token_after_it(monkeypatch, chunk, first):
    fake = _FakeLlama()
    monkeypatch.setattr(llamacpp, "llama_all_rows", lambda: fake)
    prompt = [3, 10, 15, 14, 7]  # x_{i+1} = (x_i * 3 + 1) % 16 for i = 0, 1, 2; x_4 is not row 3's argmax (11)
    entries = llamacpp.LlamaCppEngine().prompt_logprobs(_Config(prompt, prefill_chunk=chunk), PromptLogprobsSpec(first_token=first, top_k=2))
    assert fake.evals == ([prompt] if chunk is None else [[3, 10], [15, 14], [7]])
    scored = [e for e in entries if e.logprob is not None]
    assert [e.position for e in entries] == ([0, 1, 2, 3, 4] if first == "none" else [1, 2, 3, 4])
    assert [e.token_id for e in scored] == prompt[1:]
    assert [e.rank for e in scored] == [1, 1, 1, 9]  # row 3: 11 first, then ids 0..6 (equal steps, lower id first), then 7
    assert scored[3].top[0][0] == (14 * 3 + 1) % V and scored[0].logprob > -0.1 > -5.0 > scored[3].logprob


def test_a_prompt_beyond_the_logits_all_context_is_refused(monkeypatch):
    monkeypatch.setattr(llamacpp, "llama_all_rows", _FakeLlama)
    with pytest.raises(DecodeSpecError) as err:
        llamacpp.LlamaCppEngine().prompt_logprobs(_Config(range(llamacpp.N_CTX_ALL + 1)), PromptLogprobsSpec())
    assert err.value.code == "adapter.unsupported"


needs_llamacpp = pytest.mark.skipif(llamacpp.available() is not None, reason=llamacpp.available() or "")


@needs_llamacpp
def test_the_rows_agree_with_the_reference_and_the_echo_api_is_one_row_late():
    """Our reading of llama.cpp's rows is within its declared tolerance of the float64 reference; llama-cpp-python's
    echo API, on a prompt without a leading BOS, reports for x_i the value of row i (one late), not row i - 1."""
    from decodespec.checks.gate.cases import cases_for
    from decodespec.checks.gate.prompt_logprobs import reference_rows
    from decodespec.checks.gate.tolerance import tolerance_for

    config = next(c for c in cases_for("smollm2") if c.id == "matrix.prompt_logprobs").config
    prompt = list(config.prompt_ids)
    entries = llamacpp.create().prompt_logprobs(config, PromptLogprobsSpec(first_token="omitted", top_k=1))
    ref = reference_rows("smollm2", prompt)
    tol = tolerance_for("llamacpp", "smollm2", "float32")
    gaps = [abs(e.logprob - ref[e.position][1][e.token_id]) for e in entries]
    assert len(gaps) == len(prompt) - 1 and max(gaps) <= 2 * min(tol.epsilon(ref[i][0]) for i in ref)

    ids = prompt[1:7]  # no leading BOS
    assert ids[0] != 1
    llm = llamacpp.llama_all_rows()
    llm.reset()
    llm._ctx.kv_cache_clear()
    text = llm.detokenize(ids, special=True).decode()
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
    echo = llm.create_completion(text, max_tokens=1, echo=True, logprobs=1, temperature=0)["choices"][0]["logprobs"]["token_logprobs"]
    llm.reset()
    llm._ctx.kv_cache_clear()
    rows = reference_rows("smollm2", ids)
    assert echo[0] is None
    for i in range(1, len(ids) - 1):
        right, late = rows[i][1][ids[i]], rows[i + 1][1][ids[i]]
        if abs(right - late) > 1.0:  # where the two rows differ clearly, the echo value is the late one
            assert abs(echo[i] - late) < abs(echo[i] - right), (i, echo[i], right, late)
    with pytest.raises(TypeError):  # echo with a token-id prompt: `prompt + text_str` on a list (L:1723)
        llm.create_completion(ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    llm.reset()
    llm._ctx.kv_cache_clear()


def test_the_llamacpp_skip_reason_names_the_setup_command():
    if importlib.util.find_spec("llama_cpp") is None:
        assert "DECODESPEC_LLAMACPP=1 .ci/setup" in (llamacpp.available() or "")
