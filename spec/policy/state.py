"""M3.8 0x0B Policy state is typed and partly mutable: the request view and the policy state.

* :class:`RequestView`: the read-only snapshot of the request the policy conditions on
  (prompt ids, output ids so far, step, EOS ids, ``min_new_tokens``, RNG identity).  M3.10
  owns it; the policy never mutates it.
* :class:`PolicyState`: what the policy itself owns and returns updated after each decision:
  the RNG counter (draws consumed so far), the constraint-automaton state and the Mirostat
  controller value ``mu``.

Source: M3.8 0x0B (state table: immutable config, read-only request view, constraint state,
adaptive controller, randomness), M3.8 0x12 item 61 ("Sharing one adaptive controller across
requests").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from decodespec.spec.errors import Rejection
from decodespec.spec.policy import codes
from decodespec.spec.policy.config import PolicyConfig

__all__ = ["MAX_SEED", "PolicyState", "RequestView", "initial_policy_state"]

#: Largest seed: RFC 8785 (I-JSON) serializes integers exactly only up to 2**53 - 1, and the
#: seed enters the RNG key through its canonical JSON.
MAX_SEED = 2**53 - 1


def _ids(values: Iterable[Any]) -> tuple[int, ...]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) and not hasattr(v, "__index__"):
            raise Rejection(codes.INVALID_VIEW, f"token ids must be integers, got {v!r}", "$.view")
        out.append(int(v))
    return tuple(out)


@attrs.frozen
class RequestView:
    """Read-only request view for one decision.

    Attributes:
        prompt_ids: The L prompt token ids.
        output_ids: The O committed output ids so far.
        step: Decision step; defaults to ``len(output_ids)`` (= O).  Addresses the RNG draw.
        eos_ids: Every EOS id of the request (``min_new_tokens`` suppresses all of them).
        min_new_tokens: EOS is illegal while ``len(output_ids) < min_new_tokens``.
        identity: Canonical request identity (keys the RNG stream).
        seed: Request seed in ``[0, MAX_SEED]``, or ``None``.
    """

    prompt_ids: tuple[int, ...] = attrs.field(converter=_ids)
    output_ids: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    step: int = attrs.field(default=attrs.Factory(lambda self: len(self.output_ids), takes_self=True))
    eos_ids: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    min_new_tokens: int = 0
    identity: str = ""
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise Rejection(codes.INVALID_VIEW, f"step must be a non-negative integer, got {self.step!r}", "$.view.step")
        if isinstance(self.min_new_tokens, bool) or not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise Rejection(codes.INVALID_VIEW, "min_new_tokens must be a non-negative integer", "$.view.min_new_tokens")
        if any(t < 0 for t in self.prompt_ids + self.output_ids + self.eos_ids):
            raise Rejection(codes.INVALID_VIEW, "token ids must be non-negative", "$.view")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED):
            raise Rejection(codes.INVALID_VIEW, f"seed must be an integer in [0, 2**53 - 1] (exact in canonical JSON) or None, got {self.seed!r}", "$.view.seed")

    def history(self, which: str) -> tuple[int, ...]:
        """The token history a rule reads: ``"prompt_and_output"`` or ``"output"``."""
        return self.prompt_ids + self.output_ids if which == "prompt_and_output" else self.output_ids

    def max_token_id(self) -> int:
        """Largest id in the view (-1 when empty)."""
        return max(self.prompt_ids + self.output_ids + self.eos_ids, default=-1)


@attrs.frozen
class PolicyState:
    """The policy-owned mutable state, as a value (each decision returns a new one).

    Attributes:
        rng_counter: Draws consumed so far by this request (>= 0).
        constraint_state: Current automaton state, or ``None`` without a ``constraint``.
        mirostat_mu: Mirostat v2 truncation threshold ``mu`` in bits, or ``None`` without
            ``mirostat_v2``.
    """

    rng_counter: int = 0
    constraint_state: str | None = None
    mirostat_mu: float | None = None

    def to_json(self) -> dict[str, Any]:
        """``{"rng_counter", "constraint_state", "mirostat_mu"}``."""
        return {"rng_counter": self.rng_counter, "constraint_state": self.constraint_state, "mirostat_mu": self.mirostat_mu}

    def check(self, config: PolicyConfig) -> None:
        """Raise ``policy.invalid_state`` unless this state fits ``config``."""
        if isinstance(self.rng_counter, bool) or not isinstance(self.rng_counter, int) or self.rng_counter < 0:
            raise Rejection(codes.INVALID_STATE, "rng_counter must be a non-negative integer", "$.state.rng_counter")
        constraint = config.find("constraint")
        if constraint is None:
            if self.constraint_state is not None:
                raise Rejection(codes.INVALID_STATE, "constraint_state set but the config has no constraint", "$.state.constraint_state")
        elif self.constraint_state not in constraint.get("automaton").states:
            raise Rejection(codes.INVALID_STATE, f"constraint_state {self.constraint_state!r} is not a state of the automaton", "$.state.constraint_state")
        if (config.find("mirostat_v2") is None) != (self.mirostat_mu is None):
            raise Rejection(codes.INVALID_STATE, "mirostat_mu must be set exactly when the config has mirostat_v2", "$.state.mirostat_mu")


def initial_policy_state(config: PolicyConfig) -> PolicyState:
    """The state before the first decision: counter 0, automaton initial state, ``mu = 2 tau``.

    Source: llama.cpp ``llama_sampler_init_mirostat_v2`` (``mu = 2.0f*tau``).
    """
    constraint = config.find("constraint")
    mirostat = config.find("mirostat_v2")
    return PolicyState(
        rng_counter=0,
        constraint_state=None if constraint is None else constraint.get("automaton").initial,
        mirostat_mu=None if mirostat is None else 2.0 * mirostat.get("tau"),
    )
