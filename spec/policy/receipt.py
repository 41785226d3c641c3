"""M3.8 0x0B The decision receipt: one score row -> one token, bound to everything that chose it.

A receipt binds the score-row identity, its kind and vocabulary map hash, the ordered
transforms with their parameters (by reference: ``policy_digest`` is the content hash of the
whole policy, :func:`policy_digest`, and ``transforms`` names the transforms of that policy that
ran, in order), the preset, the support size, the tie rule, the selected id
with its raw and processed log-probability, the draws and the RNG address (key id, counter
before and after), and the policy state before and after.  It is a frozen value with a
content-hash id: ``receipt_id = "sha256:" + sha256(rfc8785(body))`` over every other field,
so two receipts are equal exactly when their ids are.

Declared choice (bounded output, M3.10 0x06 "total returned bytes"): a receipt references its
policy by digest instead of embedding it, so a receipt's size does not grow with the policy's
tables (a 4,096-state automaton, 4,096 bias entries).  Every output that carries receipts writes
the full policy once (the trace header's ``policy``, ``generate --json``'s ``policy``, the
snapshot's request), and every reader checks each receipt's ``policy_digest`` against it
(``checks/modelcheck/trace_validation.py``, :mod:`decodespec.impl.snapshot`).  The binding is as strong as
embedding: the digest is a SHA-256 over the policy's canonical JSON (every transform with every
parameter, the order, the family, tie rule and empty-support policy).

Source: M3.8 0x0B ("The strongest replay artifact records the processed support and selected
draw metadata in addition to the seed"); M3.10 0x08 ("The M3.8 decision receipt binds score
kind, vocabulary axis/map, support, ordered transforms, parameters, tie rule, and RNG address
before M3.10 accepts a token").
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from typing import Any

import attrs
import rfc8785

from decodespec.spec.errors import quote
from decodespec.spec.policy.config import PolicyConfig, TransformSpec
from decodespec.spec.policy.state import PolicyState

__all__ = ["DecisionReceipt", "RngRecord", "content_id", "policy_digest", "receipt_policy_mismatch"]


def content_id(body: dict[str, Any]) -> str:
    """``"sha256:" + hex(sha256(rfc8785(body)))``: the canonical content hash of a JSON object."""
    return "sha256:" + hashlib.sha256(rfc8785.dumps(body)).hexdigest()


@functools.lru_cache(maxsize=16)
def policy_digest(config: PolicyConfig) -> str:
    """``content_id(config.to_json())``: the content hash a receipt names its policy by.

    Args:
        config: The policy the decision ran under (the runner's effective policy, its
            ``min_new_tokens`` transform included).

    Returns:
        ``"sha256:<64 hex>"`` over the RFC 8785 bytes of the policy JSON (cached per config, so
        a large automaton is canonicalized once per request, not once per token).
    """
    return content_id(config.to_json())


def _is_subsequence(items: Any, of: Any) -> bool:
    it = iter(of)
    return isinstance(items, list) and all(any(item == known for known in it) for item in items)


def receipt_policy_mismatch(receipt: Mapping[str, Any], policy: PolicyConfig) -> tuple[str, str] | None:
    """Whether a receipt's JSON names ``policy``: ``None``, or ``(field, reason)`` of the first disagreement.

    The receipt's ``policy_digest`` must be :func:`policy_digest` of ``policy`` and its
    ``transforms`` (names) a subsequence of the policy's transforms, in order.  A receipt of the
    older embedded form (no ``policy_digest``; ``transforms`` as the applied transforms' JSON
    objects, parameters included) is read too: each object must be one of the policy's, in order.

    Args:
        receipt: A receipt as JSON (:meth:`DecisionReceipt.to_json`, or the older form).
        policy: The policy written once beside the receipts (trace header, snapshot request).
    """
    if "policy_digest" in receipt:
        if receipt["policy_digest"] != policy_digest(policy):
            return "policy_digest", f"names policy {quote(receipt['policy_digest'])}, not {policy_digest(policy)} (the written policy)"
        known: list[Any] = [t.name for t in policy.transforms]
    else:
        known = [t.to_json() for t in policy.transforms]
    if not _is_subsequence(receipt.get("transforms"), known):
        return "transforms", f"lists transforms {quote(receipt.get('transforms'))} that are not the written policy's, in order"
    return None


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
        policy_digest: :func:`policy_digest` of the policy decided under (binds every transform's
            parameters, the order and the family).
        transforms: Names of the policy's transforms that were applied, in order (a
            subsequence of the policy's; skipped ones, e.g. truncation under temperature 0, are absent).
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
    policy_digest: str
    transforms: tuple[str, ...]
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
    def build(cls, *, policy: PolicyConfig, transforms: tuple[TransformSpec, ...], **fields: Any) -> DecisionReceipt:
        """Construct a receipt from every field but ``receipt_id``, which is computed.

        Args:
            policy: The policy decided under (recorded as ``policy_digest``).
            transforms: The transforms applied, in order (recorded by name).
            **fields: Every other field.
        """
        draft = cls(receipt_id="", policy_digest=policy_digest(policy), transforms=tuple(t.name for t in transforms), **fields)
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
            "policy_digest": self.policy_digest,
            "transforms": list(self.transforms),
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
