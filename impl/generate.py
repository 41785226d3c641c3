"""M3.10 0x03 Decoder-only serving loop: the generation loop over the dynamic cache.

Prefill the prompt (one call, last row kept), then decode one token per call, each call
processing the one pending output token at the next cache slot.  Each selection reads one
score row (the raw logits of the last processed position, as float32) and hands it to the
M3.8 policy's torch twin (:func:`decodespec.impl.policy.decide`: greedy with ties to the
lowest id, or sampling with one draw from the request's counter-based stream), keeps its
decision receipt and records its ``logprob`` = natural log-softmax of that same raw row at the
selected id, computed before the next model call.  Finish triggers are evaluated at each
commit and the canonical reason is chosen by the declared precedence
(:data:`decodespec.spec.enums.FINISH_PRECEDENCE`).

Declared choices implemented here (docs/design.md section 2):

* ``max_new_tokens = 0``: no model call; finish ``length``, O = 0, P = 0 (``"no_call"``).
* EOS is included in ``output_ids`` (and its logprob) and never in ``text``.
* Context window C = ``max_position_embeddings``: a prompt needs ``L < C``; generation stops
  with ``context_length`` when ``L + O == C`` (total context never exceeds C, so a repair call
  of the closed token is always possible).
* The last committed token is never processed: it is ``CLOSED_UNPROCESSED`` at finish
  (P = L + O - 1, |U| = 1), M3.10 0x08 "The first-output off-by-one".

``use_cache=False`` runs the slow no-cache loop (full recomputation of the committed prefix
every step), the reference answer the cached loop must match (M3.10 0x09).

Source: M3.10 0x03 "Decoder-only serving loop", 0x08 "Output, input, and cache frontiers",
0x06 "Finish reason and RNG precedence"; M3.8 (greedy selector, raw-logit logprob); HF
``GenerationMixin._sample`` (last row in float32, argmax, append).
"""

from __future__ import annotations

import numbers
from typing import Any, Collection, Sequence

import attrs
import torch

from decodespec.spec.enums import FINISH_PRECEDENCE, FinishReason, PendingTag, canonical_finish_reason
from decodespec.spec.errors import Rejection, ResourceLimit, register_code

from decodespec.spec.policy.codes import FAMILY_MISMATCH
from decodespec.spec.policy.config import Family, PolicyConfig
from decodespec.spec.policy.receipt import DecisionReceipt
from decodespec.spec.policy.state import RequestView, initial_policy_state

from .model import CONTEXT_WINDOW_EXCEEDED, LlamaForCausalLM
from .policy import decide as policy_decide
from .rng import RequestRng

__all__ = ["INVALID_REQUEST", "GenerationResult", "generate", "greedy_generate", "select_greedy"]

INVALID_REQUEST = register_code(
    "runtime.invalid_request",
    "rejection",
    "M3.10 Immutable request envelope",
    "The generation request is malformed: empty prompt, a token id outside [0, V), or a negative max_new_tokens.",
)


@attrs.frozen
class GenerationResult:
    """What one greedy request returned.

    Attributes:
        prompt_ids: The L prompt token ids.
        output_ids: The O committed output ids (a final EOS included).
        text: Decoded output without a final EOS ("" without a tokenizer).
        logprobs: Per output token, natural log-softmax of the raw float32 logits of its
            selecting row at that token (``<= 0``).
        finish_reason: The canonical finish reason.
        triggers: Every finish condition that fired at the final commit, in precedence order.
        frontier: ``{"prompt_len", "output_count", "pending", "processed", "pending_tag"}``
            (L, O, |U|, P, tag) at finish.
        receipts: One M3.8 decision receipt per output token (``impl.policy.decide``).
        rng_counter: Draws the request consumed (0 for greedy).
    """

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    triggers: tuple[FinishReason, ...] = ()
    frontier: dict[str, Any] = attrs.field(factory=dict)
    receipts: tuple[DecisionReceipt, ...] = ()
    rng_counter: int = 0

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (``finish_reason`` and ``triggers`` as their string values)."""
        return {
            "prompt_ids": list(self.prompt_ids),
            "output_ids": list(self.output_ids),
            "text": self.text,
            "logprobs": list(self.logprobs),
            "finish_reason": self.finish_reason.value,
            "triggers": [t.value for t in self.triggers],
            "frontier": dict(self.frontier),
            "receipts": [r.to_json() for r in self.receipts],
            "rng_counter": self.rng_counter,
        }


def select_greedy(logits_row: torch.Tensor) -> tuple[int, float]:
    """Greedy decision on one raw score row: ``(token_id, logprob)``.

    Args:
        logits_row: ``[V]`` raw logits (any float dtype; upcast to float32 first).

    Returns:
        The lowest id among the maximal logits and ``log_softmax(row)[id]`` (natural log),
        read back from the device in one transfer.

    Source: M3.8 greedy selector (tie rule: lowest id, declared in docs/design.md).
    """
    row = logits_row.float()  # [V]
    token = torch.argmax(row)  # first maximal index = lowest id
    logprob = torch.log_softmax(row, dim=-1)[token]
    token_id, value = torch.stack((token.double(), logprob.double())).tolist()
    return int(token_id), float(value)


def greedy_generate(
    model: LlamaForCausalLM,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    eos_token_ids: Collection[int] | None = None,
    tokenizer: Any = None,
    use_cache: bool = True,
) -> GenerationResult:
    """Greedy generation: :func:`generate` with the plain greedy policy (see there)."""
    return generate(model, prompt_ids, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, tokenizer=tokenizer, use_cache=use_cache)


def generate(
    model: LlamaForCausalLM,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    policy: PolicyConfig | None = None,
    eos_token_ids: Collection[int] | None = None,
    min_new_tokens: int = 0,
    tokenizer: Any = None,
    use_cache: bool = True,
    identity: str = "",
    seed: int | None = None,
    vocab_hash: str = "",
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` under a decoding policy.

    Each selection hands the raw logits row of the last processed position to
    :func:`decodespec.impl.policy.decide`, which applies the policy's transforms, selects
    (greedy, or one inverse-CDF draw from the request's counter-based Philox stream at address
    ``(step, 0)``) and returns the M3.8 receipt and the next policy state.

    Args:
        model: The decoder (its device and dtype are used as they are).
        prompt_ids: L >= 1 token ids in ``[0, V)``.
        max_new_tokens: G >= 0.
        policy: The M3.8 policy (greedy or multinomial family); default plain greedy.
        eos_token_ids: Ids that finish with ``eos``; default ``{model.config.eos_token_id}``
            (empty when the config has none); pass ``()`` to disable.
        min_new_tokens: Read by the policy's ``min_new_tokens`` transform (if configured).
        tokenizer: Anything with ``decode(ids) -> str`` for ``text``; ``None``: ``text == ""``.
        use_cache: ``True``: prefill + single-token decode over a :class:`DynamicCache`;
            ``False``: recompute the whole committed prefix at every step (reference loop).
        identity: Canonical request identity (keys the RNG stream with ``seed``).
        seed: Request seed, or ``None``.
        vocab_hash: Ordered vocabulary hash recorded in the receipts.

    Returns:
        A :class:`GenerationResult` with one receipt per output token.

    Raises:
        Rejection: ``runtime.invalid_request`` (empty prompt, id out of range, negative or
            non-integer ``max_new_tokens``), before any model call; ``policy.*`` for a beam
            policy, a bad view (negative seed) or a decision the policy refuses.
        ResourceLimit: ``model.context_window_exceeded`` when ``L >= max_position_embeddings``.
    """
    prompt = _validate(model, prompt_ids, max_new_tokens)
    if eos_token_ids is None:
        eos_token_ids = () if model.config.eos_token_id is None else (model.config.eos_token_id,)
    eos = frozenset(int(i) for i in eos_token_ids)
    policy = PolicyConfig.greedy() if policy is None else policy
    if policy.family is Family.BEAM:
        raise Rejection(FAMILY_MISMATCH, "generate runs one sequence; the beam family needs a beam loop", "$.policy.family")
    state = initial_policy_state(policy)
    view = RequestView(prompt_ids=prompt, eos_ids=sorted(eos), min_new_tokens=min_new_tokens, identity=identity, seed=seed)
    rng = RequestRng(identity, seed)
    window = model.config.max_position_embeddings
    prompt_len = len(prompt)
    if max_new_tokens == 0:
        frontier = _frontier(prompt_len, 0, processed=0)
        return GenerationResult(prompt, (), "", (), FinishReason.LENGTH, (FinishReason.LENGTH,), frontier)

    output_ids: list[int] = []
    logprobs: list[float] = []
    receipts: list[DecisionReceipt] = []
    with torch.inference_mode():
        device = model.device
        cache = model.new_cache() if use_cache else None
        input_ids = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, L]
        out = model(input_ids, past_key_values=cache, logits_to_keep=1)  # prefill: logits [1, 1, V]
        while True:
            step_view = RequestView(prompt_ids=prompt, output_ids=output_ids, eos_ids=view.eos_ids, min_new_tokens=min_new_tokens, identity=identity, seed=seed)
            receipt, state = policy_decide(out.logits[0, -1], policy, state, step_view, score_id=f"score-{len(output_ids)}", vocab_hash=vocab_hash, rng=rng)
            token_id = receipt.selected_id
            output_ids.append(token_id)
            logprobs.append(receipt.raw_logprob)
            receipts.append(receipt)
            fired = set()
            if token_id in eos:
                fired.add(FinishReason.EOS)
            if len(output_ids) == max_new_tokens:
                fired.add(FinishReason.LENGTH)
            if prompt_len + len(output_ids) == window:
                fired.add(FinishReason.CONTEXT_LENGTH)
            if fired:
                break
            if cache is not None:
                step_ids = torch.tensor([[token_id]], dtype=torch.long, device=device)  # [1, 1]
                out = model(step_ids, past_key_values=cache, logits_to_keep=1)  # decode: logits [1, 1, V]
            else:
                input_ids = torch.cat([input_ids, input_ids.new_tensor([[token_id]])], dim=1)  # [1, L + O]
                out = model(input_ids, logits_to_keep=1)  # full recomputation
    finish = canonical_finish_reason(fired)
    triggers = tuple(r for r in FINISH_PRECEDENCE if r in fired)
    text_ids = output_ids[:-1] if output_ids[-1] in eos else output_ids
    text = tokenizer.decode(text_ids) if tokenizer is not None else ""
    frontier = _frontier(prompt_len, len(output_ids), processed=prompt_len + len(output_ids) - 1)
    return GenerationResult(prompt, tuple(output_ids), text, tuple(logprobs), finish, triggers, frontier, tuple(receipts), state.rng_counter)


def _frontier(prompt_len: int, output_count: int, *, processed: int) -> dict[str, Any]:
    pending = prompt_len + output_count - processed if output_count else 0
    tag = PendingTag.CLOSED_UNPROCESSED if pending else PendingTag.EMPTY
    return {"prompt_len": prompt_len, "output_count": output_count, "pending": pending, "processed": processed, "pending_tag": tag.value}


def _validate(model: LlamaForCausalLM, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[int, ...]:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise Rejection(INVALID_REQUEST, f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}", "$.max_new_tokens")
    prompt = tuple(int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in prompt_ids)
    if not prompt:
        raise Rejection(INVALID_REQUEST, "the prompt is empty (L >= 1 is required)", "$.prompt_ids")
    vocab = model.config.vocab_size
    for idx, tok in enumerate(prompt):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
            raise Rejection(INVALID_REQUEST, f"prompt_ids[{idx}] = {tok!r} is not an id in [0, {vocab})", f"$.prompt_ids[{idx}]")
    window = model.config.max_position_embeddings
    if len(prompt) >= window:
        raise ResourceLimit(CONTEXT_WINDOW_EXCEEDED, f"prompt length {len(prompt)} leaves no room in the context window {window}", "$.prompt_ids")
    return prompt
