"""M3.10 0x03 Decoder-only serving loop: ``generate`` as a thin driver over the request controller.

:func:`generate` builds a :class:`~decodespec.impl.runtime.RuntimeRequest` and drives a
:class:`~decodespec.impl.runtime.RequestRunner` to the end (:meth:`RequestRunner.run`): prefill
(one shot or in chunks), one decode call per committed token, each selection by the M3.8
policy twin (:func:`decodespec.impl.policy.decide`: greedy with ties to the lowest id, or one
inverse-CDF draw from the request's counter-based stream), its ``logprob`` = natural
log-softmax of the same raw row at the selected id, recorded before the next model call;
finish triggers at each commit with the canonical reason by the declared precedence
(:data:`decodespec.spec.enums.FINISH_PRECEDENCE`).

Declared choices implemented by the controller (docs/design.md section 2):

* ``max_new_tokens = 0``: no model call; finish ``length``, O = 0, P = 0 (``"no_call"``).
* EOS is included in ``output_ids`` (and its logprob) and never in ``text``.
* Context window C = ``max_position_embeddings`` (and the static capacity): a prompt needs
  ``L < C``; generation stops with ``context_length`` when ``L + O == C``.
* The last committed token is never processed: it is ``CLOSED_UNPROCESSED`` at finish
  (P = L + O - 1, |U| = 1), M3.10 0x00 "The first-output off-by-one".

Stop strings, ``include_stop_str``, the output ``alignment``, structured (JSON) completion and
streaming (``stream`` / ``on_chunk``) are carried out by the runner's output observer
(:class:`decodespec.impl.output.OutputObserver`) when ``tokenizer`` has ``token_bytes``; the
result then follows the alignment contract (M3.10 0x06).

``cache="none"`` (or ``use_cache=False``) runs the no-cache loop (full recomputation of the
committed prefix every call), the reference answer the cached families must match (M3.10 0x09).

Source: M3.10 0x03 "Decoder-only serving loop", 0x08 "Output, input, and cache frontiers",
0x06 "Finish reason and RNG precedence"; M3.8 (greedy selector, raw-logit logprob); HF
``GenerationMixin._sample`` (last row in float32, argmax, append).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from decodespec.spec.policy.config import PolicyConfig

from .events import EventSink
from .faults import FaultPlan
from .model import LlamaForCausalLM
from .runtime import INVALID_REQUEST, CommitObserver, RequestRunner, RuntimeRequest
from .values import GenerationResult

__all__ = ["INVALID_REQUEST", "GenerationResult", "generate", "greedy_generate", "select_greedy"]


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
    cache: str | None = None,
) -> GenerationResult:
    """Greedy generation: :func:`generate` with the plain greedy policy (see there)."""
    return generate(model, prompt_ids, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, tokenizer=tokenizer,
                    use_cache=use_cache, cache=cache)


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
    cache: str | None = None,
    prefill_chunk: int | None = None,
    static_capacity: int | None = None,
    sink: EventSink | None = None,
    faults: FaultPlan | None = None,
    observer: CommitObserver | None = None,
    stop_strings: Sequence[str] = (),
    include_stop_str: bool = False,
    alignment: str = "token",
    structured: str = "none",
    stream: bool = False,
    on_chunk: Callable[[Any], None] | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` under a decoding policy.

    Args:
        model: The decoder (its device and dtype are used as they are).
        prompt_ids: L >= 1 token ids in ``[0, V)``.
        max_new_tokens: G >= 0.
        policy: The M3.8 policy (greedy or multinomial family); default plain greedy.
        eos_token_ids: Ids that finish with ``eos``; default ``{model.config.eos_token_id}``
            (empty when the config has none); pass ``()`` to disable.
        min_new_tokens: EOS is outside the support while O < this.
        tokenizer: Anything with ``decode(ids) -> str`` for ``text``; ``None``: ``text == ""``.
        use_cache: ``False`` is ``cache="none"``.
        identity: Request identity (keys the RNG stream with ``seed``); an admitted envelope's
            identity when the caller has one (``RequestRunner`` with
            ``RuntimeRequest.from_admitted``).
        seed: Request seed, or ``None``.
        vocab_hash: Ordered vocabulary hash recorded in the receipts.
        cache: ``"none"``, ``"dynamic"`` (default) or ``"static"``.
        prefill_chunk: Prefill in chunks of at most this many tokens (cached families).
        static_capacity: Slots of the static cache (default L + G + 1, at most the model window).
        sink: Event sink for a ``decodespec.events.v1`` trace.
        faults: A declared :class:`~decodespec.impl.faults.FaultPlan`.
        observer: A :class:`~decodespec.impl.runtime.CommitObserver`; default the runner's
            :class:`~decodespec.impl.output.OutputObserver` when ``tokenizer`` has ``token_bytes``.
        stop_strings: Stop strings, matched on the output's UTF-8 bytes (needs the output observer).
        include_stop_str: Keep the matched stop string in the returned text.
        alignment: ``"token"`` (default, as the envelope), ``"text"`` or ``"span"``.
        structured: ``"json"``: finish ``structured`` where one JSON value completes
            (``structured_error`` on an invalid prefix).
        stream: Stream the output (publishes chunks; enables ``stream_error``).
        on_chunk: Consumer of each published chunk (needs ``stream``); if it raises, the request
            finishes with ``stream_error``.

    Returns:
        A :class:`GenerationResult` with one receipt per output token.

    Raises:
        Rejection: ``runtime.invalid_request`` (empty prompt, id out of range, negative or
            non-integer ``max_new_tokens``, ``on_chunk`` without ``stream``), before any model
            call; ``stop.*`` for bad stop strings, alignment or counts; ``policy.*`` for a beam
            policy, a bad view (negative seed) or a decision the policy refuses.
        ResourceLimit: ``model.context_window_exceeded`` when ``L >= max_position_embeddings``.
    """
    if eos_token_ids is None:
        eos_token_ids = () if model.config.eos_token_id is None else (model.config.eos_token_id,)
    family = cache if cache is not None else ("dynamic" if use_cache else "none")
    request = RuntimeRequest(
        identity=identity,
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=max_new_tokens,
        policy=PolicyConfig.greedy() if policy is None else policy,
        eos_ids=frozenset(int(i) for i in eos_token_ids),
        min_new_tokens=min_new_tokens,
        seed=seed,
        cache=family,
        prefill_chunk=prefill_chunk,
        static_capacity=static_capacity,
        vocab_hash=vocab_hash,
        stream=stream,
        stop_strings=tuple(stop_strings) if not isinstance(stop_strings, str) else stop_strings,
        include_stop_str=include_stop_str,
        alignment=alignment,
        structured=structured,
    )
    runner = RequestRunner(model, request, sink=sink, faults=faults, observer=observer, tokenizer=tokenizer, on_chunk=on_chunk)
    return runner.run().result()
