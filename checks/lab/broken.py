"""Deliberately broken variants of our runtime that the gate must catch (failure-lab examples).

Each is a small subclass of the real component with one shape-preserving bug from M3.10 0x0B,
named in :data:`BROKEN_RUNTIMES` (which :func:`decodespec.checks.modelcheck.traces.open_runtime` adds to
:data:`decodespec.checks.modelcheck.traces.RUNTIMES`) so that a trace recording its failure replays with
``decodespec replay``:

==================================  ==========================================================  ==============
runtime name                        bug (M3.10 0x0B)                                            caught at
==================================  ==========================================================  ==============
``impl.broken.next_step_logprob``   "generated token logprob read from next-step logits"         DECISION
``impl.broken.frozen_rng``          the commit does not advance the request RNG counter          STATE
``impl.broken.stale_static_row``    a reused static cache exposes one stale row of the previous  TENSOR
                                    request ("read stale static-cache slots")
==================================  ==========================================================  ==============

Source: M3.10 0x0B "Shape-correct failure lab"; research/formal-anchors-survey.md 7 (mutants
killed by the gate).
"""

from __future__ import annotations

import attrs
import torch

from decodespec.impl.cache import StaticCache
from decodespec.impl.runtime import RequestRunner
from decodespec.spec.request import static_capacity

from ..adapters.impl import ImplAdapter

__all__ = ["BROKEN_RUNTIMES", "FrozenRngRunner", "LeakyStaticCache", "NextStepLogprobRunner"]


class NextStepLogprobRunner(RequestRunner):
    """Records each committed token's logprob again from the *next* call's score row (off by one step)."""

    def complete(self):
        selection = super().complete()
        if self.score is not None and self.logprobs:
            row = torch.log_softmax(self.score.logits.float(), dim=-1)  # [V] of the following position
            self.logprobs[-1] = float(row[self.output_ids[-1]])
        return selection


class FrozenRngRunner(RequestRunner):
    """Consumes the receipt but keeps the RNG counter where it was (the next draw repeats the address)."""

    def commit(self, receipt=None):
        counter = self.policy_state.rng_counter
        triggers = super().commit(receipt)
        self.policy_state = attrs.evolve(self.policy_state, rng_counter=counter)
        return triggers


class LeakyStaticCache(StaticCache):
    """A reused static cache that keeps one stale row: the first call of a new request leaves the old K/V in its last slot.

    The bug of a cache that tracks a high-water mark instead of the request generation: after
    :meth:`reset`, a write below the previous request's high-water mark "already has" its last
    row, so slot ``end - 1`` keeps the previous request's keys and values while every integer
    (committed length, validity) says the new row is there.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.high_water = 0
        self.reused = False

    def reset(self) -> None:
        super().reset()
        self.reused = self.high_water > 0

    def _store(self, key_states, value_states, layer_idx, start):
        end = start + key_states.shape[2]
        keys, values = self._buffers(layer_idx, key_states)
        stale = self.reused and self._committed == 0 and end - 1 < self.high_water
        old = (keys[:, :, end - 1].clone(), values[:, :, end - 1].clone()) if stale else None  # [B, H_kv, D] each
        out = super()._store(key_states, value_states, layer_idx, start)
        if old is not None:
            keys[:, :, end - 1], values[:, :, end - 1] = old
        if layer_idx == self.abi.num_layers - 1:
            self.high_water = max(self.high_water, end)
        return out


def _leaky_cache(request, model):
    if request.cache != "static":
        return None
    capacity = static_capacity("static", request.static_capacity, len(request.prompt_ids), request.max_new_tokens,
                               model.config.max_position_embeddings)
    return LeakyStaticCache(model.cache_abi, capacity)


#: name -> adapter factory (:func:`decodespec.checks.modelcheck.traces.open_runtime` opens them by name).
BROKEN_RUNTIMES = {
    "impl.broken.next_step_logprob": lambda: ImplAdapter(runner_cls=NextStepLogprobRunner, name="impl.broken.next_step_logprob"),
    "impl.broken.frozen_rng": lambda: ImplAdapter(runner_cls=FrozenRngRunner, name="impl.broken.frozen_rng"),
    "impl.broken.stale_static_row": lambda: ImplAdapter(cache_factory=_leaky_cache, name="impl.broken.stale_static_row"),
}
