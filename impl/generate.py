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

from typing import Any, Callable, Collection, Sequence

import attrs
import torch

from decodespec.spec.enums import FinishReason
from decodespec.spec.policy.config import PolicyConfig
from decodespec.spec.policy.receipt import DecisionReceipt

from .events import EventSink
from .faults import FaultPlan
from .model import LlamaForCausalLM
from .runtime import INVALID_REQUEST, CommitObserver, RequestRunner, RuntimeRequest

__all__ = ["INVALID_REQUEST", "GenerationResult", "generate", "greedy_generate", "select_greedy"]


@attrs.frozen
class GenerationResult:
    """What one request returned (M3.10 0x06 output contract; docs/design.md section 8).

    Attributes:
        prompt_ids: The L prompt token ids.
        output_ids: The returned output ids under the alignment contract (``int[k]``; a final EOS
            included); every committed id when no cut applies or without the output observer.
        text: The returned text (UTF-8 of the output bytes ``[0, visible_end)``; EOS and other
            special tokens contribute no bytes; "" without a tokenizer).
        logprobs: ``float[k]``: per returned token, natural log-softmax of the raw float32 logits of
            its selecting row at that token (``<= 0``); ``len(logprobs) == len(output_ids)``.
        finish_reason: The canonical finish reason (``None`` for a suspended request).
        triggers: Every finish condition recorded, in precedence order.
        frontier: ``{"prompt_len", "output_count", "pending", "processed", "pending_tag"}``
            (L, O, |U|, P, tag) at finish; O counts every committed token.
        receipts: One M3.8 decision receipt per committed token (``impl.policy.decide``).
        rng_counter: Draws the request consumed (0 for greedy).
        num_committed: O, tokens committed (returned or not); ``None`` when unknown.
        alignment: ``token`` / ``text`` / ``span`` when the output observer aligned the result,
            else ``None``.
        overhang: Output bytes ``[visible_end, ids_byte_end)``: what the returned ids decode to
            beyond ``text`` (empty under ``token``; the documented mismatch under ``text``; the
            trimmed bytes under ``span``).
        token_spans: ``(start, end)`` byte span of each returned token in the output bytes.
        visible_end: End of the visible bytes (``len(text.encode())`` unless the text ends in an
            incomplete UTF-8 sequence), or ``None``.
        stop_match: ``(stop string, start byte, end byte)`` of the stop match that fired, or ``None``.
        structured_end: Byte offset where the JSON value completed, or ``None``.
        chunks: The stream chunks delivered (:class:`~decodespec.spec.stop.Chunk`).
        stream: The stream report (``chunks``, ``delivered_bytes``, ``delivered_tokens``,
            ``failed``, ``error``) of a streamed request, else ``None``.
        prompt_logprobs: The requested prompt logprobs
            (:class:`~decodespec.spec.prompt_logprobs.PromptLogprob` each, M3.10 0x02), or ``None``
            when not requested.
        timeline: When each model call launched and completed and each emission was published
            (:class:`decodespec.spec.latency.Timeline`, ns since admission; M3.10 0x0BA "Latency
            semantics"); ``None`` from a path that keeps no record.  Not part of equality.
    """

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...]
    finish_reason: FinishReason | None
    triggers: tuple[FinishReason, ...] = ()
    frontier: dict[str, Any] = attrs.field(factory=dict)
    receipts: tuple[DecisionReceipt, ...] = ()
    rng_counter: int = 0
    num_committed: int | None = None
    alignment: str | None = None
    overhang: bytes = b""
    token_spans: tuple[tuple[int, int], ...] = ()
    visible_end: int | None = None
    stop_match: tuple[str, int, int] | None = None
    structured_end: int | None = None
    chunks: tuple[Any, ...] = ()
    stream: dict[str, Any] | None = None
    prompt_logprobs: tuple[Any, ...] | None = None
    #: The request's recorded call and emission times (:class:`decodespec.spec.latency.Timeline`); not compared.
    timeline: Any = attrs.field(default=None, eq=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (``finish_reason`` and ``triggers`` as their string values, ``overhang`` as hex).

        ``stop_match`` is ``{"stop", "start", "end"}``; ``token_spans`` a list of ``[start, end]``;
        the chunks themselves are not included (``decodespec generate --stream --json`` prints
        them as lines), only the ``stream`` report; ``prompt_logprobs`` (a list of
        :meth:`~decodespec.spec.prompt_logprobs.PromptLogprob.to_json`) only when requested.
        """
        match = self.stop_match
        extra = {} if self.prompt_logprobs is None else {"prompt_logprobs": [e.to_json() for e in self.prompt_logprobs]}
        return {
            "prompt_ids": list(self.prompt_ids),
            "output_ids": list(self.output_ids),
            "text": self.text,
            "logprobs": list(self.logprobs),
            "finish_reason": None if self.finish_reason is None else self.finish_reason.value,
            "triggers": [t.value for t in self.triggers],
            "frontier": dict(self.frontier),
            "receipts": [r.to_json() for r in self.receipts],
            "rng_counter": self.rng_counter,
            "num_committed": self.num_committed,
            "alignment": self.alignment,
            "overhang": self.overhang.hex(),
            "token_spans": [list(span) for span in self.token_spans],
            "visible_end": self.visible_end,
            "stop_match": None if match is None else {"stop": match[0], "start": match[1], "end": match[2]},
            "structured_end": self.structured_end,
            "stream": None if self.stream is None else dict(self.stream),
            **extra,
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
