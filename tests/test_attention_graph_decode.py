"""The captured decode step (impl/graphs.py): slot-tensor cache writes, in-graph validity, ledger outside.

On the CPU the step function runs eagerly (there is no CUDA graph), which exercises everything
the graph assumes: the ``index_copy_`` write at a device slot, the validity mask derived from
that slot, and the call ledger advanced after the step.  Its greedy run must commit exactly the
ids and logprobs of the runtime's static-cache greedy run (same model forward, same numerics).
With CUDA present, the replayed graph must agree with the runtime too (skipped here otherwise;
``python -m decodespec.checks.gpu_check`` runs the same comparison).

Tolerances on logprobs: the model's float32 ``LOGIT_TOL`` (tiny 5e-5, SmolLM2 2e-4), and 0.05
for the tiny model in bfloat16: the decoder's static capacity (``L + G - 1``) differs from the
runtime's (``L + G + 1``), so SDPA reduces over a different key axis (masked slots, same math).
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import attention  # tests/ is on sys.path
from runtime_helpers import LOGIT_TOL

from decodespec.checks.testing import requires_smollm2
from decodespec.impl.generate import generate
from decodespec.impl.graphs import GraphDecoder, SlotStaticCache, graph_greedy_generate
from decodespec.spec.errors import Rejection, ResourceLimit

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _same_as_runtime(model, prompt, new_tokens, decoder=None, tol=LOGIT_TOL["tiny"]):
    ours = graph_greedy_generate(model, prompt, max_new_tokens=new_tokens, eos_token_ids=(), decoder=decoder)
    ref = generate(model, prompt, max_new_tokens=new_tokens, eos_token_ids=(), cache="static")
    assert ours.output_ids == ref.output_ids
    # The same forward; only the static capacity (the key axis SDPA reduces over) differs.
    assert max(abs(a - b) for a, b in zip(ours.logprobs, ref.logprobs)) <= tol
    assert (ours.finish_reason, ours.frontier) == (ref.finish_reason, ref.frontier)
    return ours


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_graph_step_commits_the_runtime_ids_tiny(tiny_model, attn):
    with attention(tiny_model, attn):
        _same_as_runtime(tiny_model, PROMPT, 24)


def test_graph_step_in_bfloat16_tiny():
    from decodespec.impl.tiny import load_tiny

    _same_as_runtime(load_tiny(seed=0, dtype=torch.bfloat16, device="cpu"), PROMPT, 12, tol=0.05)


def test_a_reused_decoder_never_reads_the_previous_request(tiny_model):
    """A longer earlier request leaves stale rows in the buffers; validity comes from the slot, so they stay invisible."""
    decoder = GraphDecoder(tiny_model, 40)
    _same_as_runtime(tiny_model, list(range(20, 40)), 18, decoder)
    assert decoder.cache.committed_length == 20 + 18 - 1
    _same_as_runtime(tiny_model, [3, 4], 6, decoder)
    assert decoder.cache.committed_length == 2 + 6 - 1 and decoder.cache.generation == 6


def test_the_ledger_refuses_a_write_past_capacity(tiny_model):
    decoder = GraphDecoder(tiny_model, 3)
    decoder.prefill([5, 6, 7])
    before = (decoder.cache.committed_length, decoder.cache.layer_lengths(), decoder.cache.generation)
    with pytest.raises(ResourceLimit) as err:
        decoder.decode(8)
    assert err.value.code == "cache.capacity_exceeded"
    assert (decoder.cache.committed_length, decoder.cache.layer_lengths(), decoder.cache.generation) == before


def test_a_step_that_misses_a_layer_is_refused(tiny_model, monkeypatch):
    """runtime.graph_capture_incomplete: a replay could not complete the lane roster."""
    original = SlotStaticCache.update

    def skip_layer_1(self, key_states, value_states, layer_idx, cache_position=None):
        keys, values = original(self, key_states, value_states, layer_idx, cache_position)
        if self._slot_mode and layer_idx == 1:
            self.slot_layers.pop()
        return keys, values

    monkeypatch.setattr(SlotStaticCache, "update", skip_layer_1)
    decoder = GraphDecoder(tiny_model, 10)
    decoder.prefill(PROMPT)
    with pytest.raises(Rejection) as err:
        decoder.decode(3)
    assert err.value.code == "runtime.graph_capture_incomplete"


def test_bad_requests_are_refused(tiny_model):
    for prompt, new in (([], 3), ([5, 512], 3), ([5], 0)):
        with pytest.raises(Rejection) as err:
            graph_greedy_generate(tiny_model, prompt, max_new_tokens=new)
        assert err.value.code == "runtime.invalid_request"


@requires_smollm2
@pytest.mark.smollm2
def test_graph_step_commits_the_runtime_ids_smollm2(smollm2_model, smollm2_tokenizer):
    _same_as_runtime(smollm2_model, smollm2_tokenizer.encode("The capital of France is"), 6, tol=LOGIT_TOL["smollm2"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a captured graph replays only on a GPU)")
def test_captured_graph_replays_match_the_runtime_on_cuda():
    from decodespec.impl.tiny import load_tiny

    model = load_tiny(seed=0, device="cuda")
    decoder = GraphDecoder(model, 64)
    assert decoder.use_graph
    _same_as_runtime(model, PROMPT, 24, decoder)
    _same_as_runtime(model, [3, 4, 5], 30, decoder)  # the same graph replays for a second request
