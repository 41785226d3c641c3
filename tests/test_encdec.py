"""The encoder-decoder profile (M3.10 0x01): fixed memory and cross K/V, a growing target self cache.

Evidence (the profile's architecture-qualified conformance test, M3.10 0x01): cached and uncached
target decoding agree (log-probabilities at every step within ``TOL``, identical tokens, with
the reference top-2 margin checked to exceed ``2 * TOL`` first); the encoder memory and the
cross K/V are computed once and never written (version counters and SHA-256 before and after
generation, and a deliberate in-place write is caught); the source mask matters (a padded
source equals its unpadded source only under the mask; dropping it changes the answer).

Declared tolerance ``TOL = 1e-5`` on float32 log-probabilities (CPU; cached and uncached differ
only in matmul shapes).
"""

from __future__ import annotations

import pytest
import torch

from decodespec.impl.encdec import LANES, greedy_decode, make_model, subsequent_mask
from decodespec.spec.errors import Rejection
from decodespec.spec.profiles import PROFILES

TOL = 1e-5
VOCAB, START, PAD = 64, 1, 0
SRC = torch.tensor([[5, 9, 12, 40, 33, 7, 21, 8, 60, 2], [3, 4, 5, 6, 0, 0, 0, 0, 0, 0]])


@pytest.fixture(scope="module")
def model():
    return make_model(VOCAB, VOCAB, N=2, d_model=64, d_ff=128, h=4, seed=0)


def _mask(src: torch.Tensor) -> torch.Tensor:
    return (src != PAD)[:, None, :]  # [B, 1, S]


def test_annotated_transformer_inference_test_shapes():
    """The seed's ``inference_test``: make_model(11, 11, 2), src 1..10, ys [1, 10] starting with 0."""
    m = make_model(11, 11, 2)
    src = torch.arange(1, 11)[None]
    out = greedy_decode(m, src, torch.ones(1, 1, 10), 10, 0)
    assert out.ys.shape == (1, 10) and out.ys[0, 0] == 0 and out.scores.shape == (9, 1, 11)
    assert subsequent_mask(3).tolist() == [[[True, False, False], [True, True, False], [True, True, True]]]


def test_cached_and_uncached_target_decoding_agree(model):
    """Profile profile.encoder_decoder: cached target self-state versus full target-prefix decode."""
    cached = greedy_decode(model, SRC, _mask(SRC), 12, START)
    full = greedy_decode(model, SRC, _mask(SRC), 12, START, use_cache=False)
    top2 = full.scores.topk(2, dim=-1).values  # [steps, B, 2]
    assert float((top2[..., 0] - top2[..., 1]).min()) > 2 * TOL  # the margin premise of token equality
    assert float((cached.scores - full.scores).abs().max()) <= TOL
    assert torch.equal(cached.ys, full.ys)
    assert len(set(cached.ys[0, 1:].tolist())) > 2  # the test is not degenerate: varied tokens


def test_memory_and_cross_kv_are_fixed_and_computed_once(model):
    """Fixed lanes: unchanged version counters and bytes; cross K/V projected once per layer per request."""
    calls = []
    hooks = [layer.src_attn.linears[1].register_forward_hook(lambda *a: calls.append(1)) for layer in model.decoder.layers]
    try:
        out = greedy_decode(model, SRC, _mask(SRC), 12, START)
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == len(model.decoder.layers)  # once per layer for 11 target steps
    assert out.fingerprint_before == out.fingerprint_after
    assert len(out.fingerprint_before.versions) == 1 + 2 * len(model.decoder.layers)
    assert tuple(out.lanes) == LANES == PROFILES["encoder_decoder"].lane_names()
    fixed = set(PROFILES["encoder_decoder"].fixed_lanes())
    assert {lane for lane in LANES if out.lanes[lane] == SRC.shape[1]} == fixed  # fixed lanes: S source slots
    assert out.lanes["self_kv"] == 11  # the start token and 10 fed selections; the last selection is never fed


def test_an_in_place_write_to_the_memory_is_caught(model, monkeypatch):
    """The fingerprint check can fail: a decode step that mutates the memory changes version and bytes."""
    original = type(model).decode_step

    def mutating_step(self, tgt, cache):
        cache.memory.mul_(1.0 + 1e-3)  # the 0x0B bug: mutating memory inside the decoder loop
        return original(self, tgt, cache)

    monkeypatch.setattr(type(model), "decode_step", mutating_step)
    out = greedy_decode(model, SRC, _mask(SRC), 4, START)
    assert out.fingerprint_after.versions[0] > out.fingerprint_before.versions[0]
    assert out.fingerprint_after.sha256[0] != out.fingerprint_before.sha256[0]


@pytest.mark.parametrize("use_cache", [True, False])
def test_the_source_mask_is_applied_in_cross_attention(model, use_cache):
    """A padded source decodes like its unpadded source under the mask; dropping the mask changes the answer."""
    padded, unpadded = SRC[1:], SRC[1:, :4]
    with_mask = greedy_decode(model, padded, _mask(padded), 8, START, use_cache=use_cache)
    alone = greedy_decode(model, unpadded, _mask(unpadded), 8, START, use_cache=use_cache)
    assert float((with_mask.scores - alone.scores).abs().max()) <= TOL
    assert torch.equal(with_mask.ys, alone.ys)
    no_mask = greedy_decode(model, padded, torch.ones_like(_mask(padded)), 8, START, use_cache=use_cache)
    assert float((no_mask.scores - alone.scores).abs().max()) > 0.1  # PAD source columns became visible


def test_bad_inputs_are_refused(model):
    """model.training_mode, runtime.empty_input_row, runtime.invalid_mask."""
    with pytest.raises(Rejection) as err:
        greedy_decode(model.train(), SRC, _mask(SRC), 4, START)
    assert err.value.code == "model.training_mode"
    model.eval()
    empty = _mask(SRC).clone()
    empty[1] = False
    with pytest.raises(Rejection) as err:
        greedy_decode(model, SRC, empty, 4, START)
    assert err.value.code == "runtime.empty_input_row"
    with pytest.raises(Rejection) as err:
        greedy_decode(model, SRC, _mask(SRC)[:, :, :5], 4, START)
    assert err.value.code == "runtime.invalid_mask"
