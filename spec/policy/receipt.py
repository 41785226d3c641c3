"""M3.8 0x0B The decision receipt: one score row -> one token, bound to everything that chose it.

A receipt binds the score-row identity, its kind and vocabulary map hash, the ordered
transforms with their parameters, the preset, the support size, the tie rule, the selected id
with its raw and processed log-probability, the draws and the RNG address (key id, counter
before and after), and the policy state before and after.  It is a frozen value with a
content-hash id: ``receipt_id = "sha256:" + sha256(rfc8785(body))`` over every other field,
so two receipts are equal exactly when their ids are.

Source: M3.8 0x0B ("The strongest replay artifact records the processed support and selected
draw metadata in addition to the seed"); M3.10 0x08 ("The M3.8 decision receipt binds score
kind, vocabulary axis/map, support, ordered transforms, parameters, tie rule, and RNG address
before M3.10 accepts a token").
"""

from __future__ import annotations

import hashlib
from typing import Any

import attrs
import rfc8785

from decodespec.spec.policy.config import TransformSpec
from decodespec.spec.policy.state import PolicyState

__all__ = ["DecisionReceipt", "RngRecord", "content_id"]


def content_id(body: dict[str, Any]) -> str:
    """``"sha256:" + hex(sha256(rfc8785(body)))``: the canonical content hash of a JSON object."""
    return "sha256:" + hashlib.sha256(rfc8785.dumps(body)).hexdigest()


@attrs.frozen
class RngRecord:
    """Where the decision's randomness came from.

    Attributes:
        key_id: The request's Philox key id (hex).
        addresses: ``((step, draw_idx), ...)`` of every draw consumed (empty when none).
        uniforms: The uniform variates drawn, in order.
        counter_before: Draws consumed by the request before this decision.
        counter_after: ``counter_before + len(addresses)``.
    """

    key_id: str
    addresses: tuple[tuple[int, int], ...]
    uniforms: tuple[float, ...]
    counter_before: int
    counter_after: int

    def to_json(self) -> dict[str, Any]:
        """The record as JSON."""
        return {
            "key_id": self.key_id,
            "addresses": [list(a) for a in self.addresses],
            "uniforms": list(self.uniforms),
            "counter_before": self.counter_before,
            "counter_after": self.counter_after,
        }


@attrs.frozen
class DecisionReceipt:
    """The M3.8 decision receipt (see the module docstring).  Build it with :meth:`build`.

    Attributes:
        receipt_id: Content hash of every other field.
        score_id: Identity of the score row decided on.
        score_kind: Kind of the raw row (``logits``/``logprobs``/``probs``).
        vocab_hash: Ordered vocabulary map hash of the row.
        vocab_size: V.
        step: Decision step (O at decision time).
        family: ``greedy``/``multinomial``/``beam``.
        preset: The order preset (``default``, ``hf``, ``vllm``, ``llama.cpp``, ``explicit``).
        transforms: The transforms in the order they were applied, with parameters.
        normalization: ``"softmax"``, ``"log_softmax"`` or ``None`` (none needed).
        selector: The selector that ran (``greedy`` also for the temperature-0 branch).
        greedy_reason: ``"family"``, ``"temperature_zero"``, ``"fallback_eos"`` or ``None``.
        tie_rule: ``"lowest_id"``.
        empty_support: The configured empty-support policy.
        fallback_used: Whether the empty-support fallback produced the token.
        support_size: Ids with a finite processed score before normalization (positive
            probability for a probability row): the finite support.
        selected_id: The chosen vocabulary id.
        raw_logprob: ``log_softmax(raw row)[selected_id]`` (natural log).
        processed_logprob: ``log`` of the selected id's probability under the processed row
            the selector saw (natural log; ``log_softmax`` of the processed scores).
        draws: Number of uniforms consumed (== ``rng.counter_after - rng.counter_before``).
        rng: The :class:`RngRecord`.
        state_before / state_after: The :class:`PolicyState` around the decision.
    """

    receipt_id: str
    score_id: str
    score_kind: str
    vocab_hash: str
    vocab_size: int
    step: int
    family: str
    preset: str
    transforms: tuple[TransformSpec, ...]
    normalization: str | None
    selector: str
    greedy_reason: str | None
    tie_rule: str
    empty_support: str
    fallback_used: bool
    support_size: int
    selected_id: int
    raw_logprob: float
    processed_logprob: float
    draws: int
    rng: RngRecord
    state_before: PolicyState
    state_after: PolicyState

    @classmethod
    def build(cls, **fields: Any) -> "DecisionReceipt":
        """Construct a receipt from every field but ``receipt_id``, which is computed."""
        draft = cls(receipt_id="", **fields)
        body = draft.to_json()
        del body["receipt_id"]
        return attrs.evolve(draft, receipt_id=content_id(body))

    def to_json(self) -> dict[str, Any]:
        """The receipt as a JSON object (the ``receipt`` field of a ``decision`` trace event)."""
        return {
            "receipt_id": self.receipt_id,
            "score_id": self.score_id,
            "score_kind": self.score_kind,
            "vocab_hash": self.vocab_hash,
            "vocab_size": self.vocab_size,
            "step": self.step,
            "family": self.family,
            "preset": self.preset,
            "transforms": [t.to_json() for t in self.transforms],
            "normalization": self.normalization,
            "selector": self.selector,
            "greedy_reason": self.greedy_reason,
            "tie_rule": self.tie_rule,
            "empty_support": self.empty_support,
            "fallback_used": self.fallback_used,
            "support_size": self.support_size,
            "selected_id": self.selected_id,
            "raw_logprob": self.raw_logprob,
            "processed_logprob": self.processed_logprob,
            "draws": self.draws,
            "rng": self.rng.to_json(),
            "state_before": self.state_before.to_json(),
            "state_after": self.state_after.to_json(),
        }
