"""The adapter of our reference runtime (:class:`decodespec.impl.runtime.RequestRunner`).

It translates the contract's actions (:mod:`decodespec.checks.adapters`) into runner methods,
one for one where the runner has the method (``launch``, ``complete``, ``decide``, ``commit``,
``cancel``, ``stream_failure``, ``recover``, ``repair``, ``snapshot``, ``restore``) and as short
loops over :meth:`RequestRunner.step` for ``step`` and ``run``; it never decides anything
itself.  Typed errors the runner raises become ``rejected`` results (the runner validates
before it mutates, so a rejected action changed nothing).  Text triggers, the returned text and
stream chunks come from the runner's own output observer
(:class:`~decodespec.impl.output.OutputObserver`, built from the tokenizer).

Environment actions the runner takes from a declared :class:`~decodespec.impl.faults.FaultPlan`
are added to its plan when they happen: a ``fault`` on the in-flight call appends
``DeviceFault(call_id, layer)`` (the forward raises at that layer when the call completes) or
``MissingLane(call_id, layer)`` (the open cache call is re-opened, before any row is written,
with that layer's write dropped).

Observation extras the runner does not keep are recorded by the adapter as they happen: the
latest exposed score row (kept after its decision is committed), the latest launched call,
and the processed-row probe of the latest decision (the runtime's policy twin,
:func:`decodespec.impl.policy.process_scores`, re-run on the decision's inputs: the runner
does not keep its processed row).  A snapshot stores them with the runtime snapshot so a
restore gives back the same observation.

``ImplAdapter(runner_cls=...)`` plugs in a deliberately broken runner subclass (the mutants of
the failure lab).

Source: docs/design.md sections 6 and 11; M3.10 0x0BA (observable fields).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from decodespec.impl.faults import DeviceFault, FaultPlan, MissingLane
from decodespec.impl.policy import process_scores
from decodespec.impl.runtime import RequestRunner, RuntimeRequest
from decodespec.spec.enums import CallKind
from decodespec.spec.errors import DecodeSpecError, Rejection
from decodespec.spec.policy import RequestView, policy_config_from_json
from decodespec.spec.state import Phase
from decodespec.spec.transitions import NOT_ENABLED

from ..gate.vocab_check import runtime_vocab_hash
from . import (
    ADAPTER_INVALID_ACTION,
    ADAPTER_PROTOCOL,
    ADAPTER_UNSUPPORTED,
    ApplyResult,
    CaseConfig,
    Observation,
    check_action,
    corrupt_record,
    no_controller_action,
    required_capabilities,
)
from .features import names_at, sendable_features, undeclared

__all__ = ["IMPL_CAPABILITIES", "ImplAdapter", "available", "create", "load_model", "load_tokenizer",
           "model_window", "runtime_request"]

#: What our runtime supports (beams run in their own loop, not through this adapter).
IMPL_CAPABILITIES = frozenset({
    "cache:none", "cache:dynamic", "cache:static", "prefill_chunk", "decide_commit", "inflight", "faults", "snapshot",
    "sampling", "stream", "logits", "policy_rows", "cache_probe", "reuse", "stop_strings", "structured", "output.prompt_logprobs",
}) | (sendable_features() - names_at("policy.family", "policy.num_beams", "policy.length_penalty", "policy.early_stopping")) \
    | {"sampling"}
"""Every op and probe but the native kernel, and every envelope feature, policy field and transform the gate can send,
except beams (the request runner decodes one sequence; :mod:`decodespec.checks.gate.procedures` runs beams)."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def available() -> str | None:
    """Always usable (the tiny model needs no file; SmolLM2 cases report ``model.file_missing`` at reset)."""
    return None


def create(**options: Any) -> ImplAdapter:
    """The adapter (``options``: see :class:`ImplAdapter`; a ``model`` option is ignored: the config names it)."""
    options.pop("model", None)
    return ImplAdapter(**options)


@functools.lru_cache(maxsize=8)
def load_model(name: str, dtype: str = "float32", device: str = "cpu", attention: str = "sdpa", decode_kernel: str = "torch"):
    """The shared model instance of ``name`` (``tiny``: seed 0; ``smollm2``: the GGUF file), loaded once per process.

    Each decode kernel gets its own instance (the kernel is a setting of the instance).

    Raises:
        Rejection: ``model.file_missing`` when SmolLM2 is not installed; ``runtime.invalid_device``;
            ``runtime.kernel_unavailable`` for ``decode_kernel="native"`` where it cannot run.
    """
    if name == "tiny":
        from decodespec.impl.tiny import load_tiny

        model = load_tiny(seed=0, dtype=_DTYPES[dtype], device=device, attn_implementation=attention)
    else:
        from decodespec.impl.weights import load_smollm2

        model = load_smollm2(dtype=_DTYPES[dtype], device=device, attn_implementation=attention)
    return model.set_decode_kernel(decode_kernel)


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str):
    """The tokenizer of model ``name`` (``ByteTokenizer(512)`` for tiny, the GGUF tokenizer for SmolLM2)."""
    if name == "tiny":
        from decodespec.impl.tiny import TINY_VOCAB_SIZE
        from decodespec.impl.tokenizer import ByteTokenizer

        return ByteTokenizer(TINY_VOCAB_SIZE)
    from decodespec.impl.tokenizer import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


def model_window(name: str) -> int:
    """``max_position_embeddings`` of model ``name``."""
    return int(load_model(name).config.max_position_embeddings)


def runtime_request(config: CaseConfig, vocab_hash: str = "") -> RuntimeRequest:
    """The runner's request for ``config`` (identity :meth:`CaseConfig.identity`).

    ``vocab_hash`` is the ordered vocabulary hash of the runtime's tokenizer
    (:func:`decodespec.checks.gate.vocab_check.runtime_vocab_hash`), which every receipt carries.

    Raises:
        Rejection: ``policy.*`` for a policy object the M3.8 schema refuses.
    """
    return RuntimeRequest(
        identity=config.identity(),
        prompt_ids=config.prompt_ids,
        max_new_tokens=config.max_new_tokens,
        policy=policy_config_from_json(config.policy),
        eos_ids=frozenset(config.eos_ids),
        min_new_tokens=config.min_new_tokens,
        seed=config.seed,
        cache=config.cache,
        static_capacity=config.static_capacity,
        prefill_chunk=config.prefill_chunk,
        zero_new_tokens=config.zero_new_tokens,
        final_cache=config.final_cache,
        max_retries=config.max_retries,
        context_cap=config.context_cap,
        stream=config.stream,
        stop_strings=config.stop_strings,
        structured=config.structured,
        include_stop_str=config.include_stop_str,
        alignment=config.alignment,
        vocab_hash=vocab_hash,
    )


@attrs.frozen(eq=False)
class _Extras:
    """What the adapter records beside the runner (restored with a snapshot)."""

    score: tuple[str, torch.Tensor, int] | None = None  # (score_id, logits [V] float32 CPU, output_count)
    probes: tuple[tuple[str, Any, Any], ...] = ()  # (receipt_id, support ids int64, probs float32) per decision
    call: dict[str, Any] | None = None


class ImplAdapter:
    """Our runtime behind the adapter contract.

    Args:
        runner_cls: The runner class (a deliberately broken subclass for a mutant).
        name: Adapter name reported to the harness.
        cache_factory: Optional ``(runner_request, model) -> cache`` building the request's
            cache (a mutant cache); default the runner's own.
    """

    def __init__(self, *, runner_cls: type[RequestRunner] = RequestRunner, name: str = "impl",
                 cache_factory: Callable[[RuntimeRequest, Any], Any] | None = None):
        self.name = name
        self.runner_cls = runner_cls
        self.cache_factory = cache_factory
        self.config: CaseConfig | None = None
        self.runner: RequestRunner | None = None
        self.extras = _Extras()
        self.snapshots: dict[str, tuple[Any, _Extras, CaseConfig]] = {}
        self._faulted: set[int] = set()

    # -- contract ------------------------------------------------------------------------
    def capabilities(self) -> frozenset[str]:
        """:data:`IMPL_CAPABILITIES`, plus ``decode_kernel:native`` where the native kernel can run here."""
        from decodespec.impl.native import unavailable_reason

        return IMPL_CAPABILITIES if unavailable_reason() is not None else IMPL_CAPABILITIES | {"decode_kernel:native"}

    def reset(self, config: CaseConfig) -> None:
        """Build and admit the request of ``config`` (a fresh cache; snapshots of earlier requests are kept).

        Raises:
            Rejection: ``adapter.unsupported`` for a beam config or one that needs a capability this adapter does not
                declare (:func:`~decodespec.checks.adapters.config_capabilities`); the runner's typed errors
                (``runtime.invalid_request``, ``envelope.zero_new_tokens_rejected``, ``policy.*``,
                ``model.file_missing`` ...).
            ResourceLimit: ``model.context_window_exceeded``, ``cache.capacity_exceeded``.
        """
        self._start(config, cache=None)

    def _start(self, config: CaseConfig, cache: Any) -> None:
        if config.num_beams != 1 or config.policy.get("family") == "beam":
            raise Rejection(ADAPTER_UNSUPPORTED, "the request runner decodes one sequence; beams need the 'beam' capability", "$.num_beams")
        refusal = undeclared(config, self.capabilities(), self.name)
        if refusal is not None:
            raise refusal
        model = self.model_for(config)
        tokenizer = load_tokenizer(config.model)
        request = runtime_request(config, runtime_vocab_hash(tokenizer))
        if cache is None and self.cache_factory is not None and request.cache != "none":
            cache = self.cache_factory(request, model)
        runner = self.runner_cls(model, request, cache=cache, tokenizer=tokenizer,
                                 runtime_info={"device": config.device, "dtype": config.dtype, "attention": config.attention,
                                               "decode_kernel": config.decode_kernel})
        runner.admit()
        self.config, self.runner = config, runner
        self.extras = _Extras()
        self._faulted = set()

    def apply(self, action: Mapping[str, Any]) -> ApplyResult:
        """Apply one action (see the module docstring); typed refusals become ``rejected``."""
        try:
            act = check_action(action)
            missing = required_capabilities(act) - self.capabilities()
            if missing:
                raise Rejection(ADAPTER_UNSUPPORTED, f"op {act['op']!r} needs {sorted(missing)}", "$.op")
            if self.runner is None:
                raise Rejection(ADAPTER_PROTOCOL, "reset(config) must come before any action", "$")
            data = getattr(self, "_op_" + act["op"])(act)
        except DecodeSpecError as exc:
            return ApplyResult.rejected(exc.code, exc.message)
        return ApplyResult.accepted(data)

    def observe(self) -> Observation:
        """The runner's observable projection (every field of the contract)."""
        r = self.runner
        if r is None:
            raise Rejection(ADAPTER_PROTOCOL, "reset(config) must come before observe()", "$")
        latest = r.decision if r.decision is not None else (r.consumed[-1] if r.consumed else None)
        decision = None if latest is None else {"receipt_id": latest.receipt_id, "score_id": latest.score_id, "token_id": latest.token_id,
                                               "logprob": latest.logprob, "draws": latest.draws}
        score = self.extras.score
        probe = None if latest is None else next((p[1:] for p in self.extras.probes if p[0] == latest.receipt_id), None)
        cache = r.cache
        call = None
        if self.extras.call is not None:
            call = {**self.extras.call, "in_flight": r.in_flight is not None and r.in_flight.call_id == self.extras.call["call_id"]}
        return Observation(
            phase=r.phase.value,
            output_ids=r.output_ids,
            logprobs=r.logprobs,
            frontier=r.frontier(),
            finish_reason=None if r.finish_reason is None else r.finish_reason.value,
            triggers=[t.value for t in r.ordered_triggers()],
            rng_counter=r.policy_state.rng_counter,
            generation=r.generation,
            quarantined=r.quarantined,
            decision=decision,
            score_row=None if score is None else score[1].numpy(),
            score_id=None if score is None else score[0],
            score_output_count=None if score is None else score[2],
            support_ids=None if probe is None else probe[0],
            support_probs=None if probe is None else probe[1],
            text=self._text(),
            chunks=[c.to_json() for c in r.observer.chunks] if self.config.stream else None,
            cache_committed=0 if cache is None else cache.committed_length,
            cache_physical=0 if cache is None else (cache.reserved_length if hasattr(cache, "reserved_length") else max(cache.layer_lengths())),
            call=call,
            cache_probe=self._cache_probe(),
            vocab_hash=latest.receipt.vocab_hash if latest is not None and latest.receipt is not None else r.request.vocab_hash,
            vocab_rows=int(score[1].shape[0]) if score is not None else int(r.model.lm_head.weight.shape[0]),
            **self._returned(),
        )

    def prompt_logprobs(self, config: CaseConfig, spec: Any) -> tuple[Any, ...]:
        """The runner's prompt logprobs of ``config``'s prompt under ``spec`` (a separate request: the current one is untouched).

        The request runs its prefill calls only (one-shot or chunked, as the config declares) and
        answers :meth:`RequestRunner.prompt_logprobs` (M3.10 0x02).

        Raises:
            Rejection: ``adapter.unsupported`` for a config outside the declared capabilities; the
                runner's typed errors.
        """
        refusal = undeclared(config, self.capabilities(), self.name)
        if refusal is not None:
            raise refusal
        model = self.model_for(config)
        request = attrs.evolve(runtime_request(config), prompt_logprobs=spec)
        runner = self.runner_cls(model, request)
        runner.admit()
        while runner.processed < request.prompt_len and runner.next_call() is not None:
            runner.launch()
            runner.complete()
        return runner.prompt_logprobs()

    def close(self) -> None:
        """Drop the runner and the stored snapshots."""
        self.runner = None
        self.snapshots.clear()

    # -- helpers -------------------------------------------------------------------------
    def model_for(self, config: CaseConfig):
        """The model the runner of ``config`` calls (the shared instance of :func:`load_model`)."""
        return load_model(config.model, config.dtype, config.device, config.attention, config.decode_kernel)

    def _cache_probe(self):
        cache = self.runner.cache
        if cache is None or cache.committed_length == 0 or cache.dirty:
            return None
        try:
            tensors = cache.committed_tensors()
        except DecodeSpecError:
            return None
        # per layer [2, H_kv, P, D] -> [layers, 2, H_kv, P, D]
        return torch.stack([torch.stack((k[0], v[0])) for k, v in tensors]).detach().to("cpu", torch.float32).numpy()

    def _returned(self) -> dict[str, Any]:
        """``returned_ids`` / ``returned_logprobs`` of the observer's aligned output once finished."""
        output = self.runner.observer.output if self.runner.phase is Phase.FINISHED else None
        if output is None:
            return {}
        return {"returned_ids": output.output_ids, "returned_logprobs": output.logprobs}

    def _text(self) -> str:
        observer = self.runner.observer
        output = observer.output if self.runner.phase is Phase.FINISHED else None
        return output.text if output is not None else observer.text_so_far()

    def _record_call(self) -> None:
        call = self.runner.in_flight
        if call is not None:
            positions = list(range(call.start, call.end))
            self.extras = attrs.evolve(self.extras, call={"call_id": call.call_id, "kind": call.kind.value, "start": call.start,
                                                          "length": call.length, "position_ids": positions, "cache_position": positions})

    def _record_score(self) -> None:
        score = self.runner.score
        if score is not None and (self.extras.score is None or self.extras.score[0] != score.score_id):
            row = score.logits.detach().to("cpu", torch.float32).clone()
            self.extras = attrs.evolve(self.extras, score=(score.score_id, row, score.output_count))

    def _record_probe(self) -> None:
        r = self.runner
        if r.decision is None or r.score is None:
            return
        req = r.request
        view = RequestView(prompt_ids=req.prompt_ids, output_ids=r.output_ids, eos_ids=sorted(req.eos_ids),
                           min_new_tokens=req.min_new_tokens, identity=req.identity, seed=req.seed)
        with torch.inference_mode():
            processed = process_scores(r.score.logits, r.policy, r.policy_state, view)
        mask = processed.support_mask[0]
        ids = mask.nonzero().squeeze(-1)
        probs = processed.probs[0, ids]
        probe = (r.decision.receipt_id, ids.cpu().numpy(), probs.detach().to("cpu", torch.float32).numpy())
        kept = tuple(p for p in self.extras.probes[-1:] if p[0] != probe[0])  # the last committed decision's probe stays
        self.extras = attrs.evolve(self.extras, probes=kept + (probe,))

    def _launch(self, kind: CallKind | None, length: int | None = None):
        call = self.runner.launch(kind, length=length)
        self._record_call()
        return call

    def _complete(self) -> dict[str, Any]:
        selection = self.runner.complete()
        self._record_score()
        return {"selection": selection.value}

    def _steps(self, until_commit: bool) -> list[str]:
        names = []
        while True:
            name = self.runner.step()
            if name is None:
                break
            names.append(name)
            if name == "launch":
                self._record_call()
            elif name == "complete":
                self._record_score()
            elif name == "decide":
                self._record_probe()
            elif name == "commit" and until_commit:
                break
        if not names:
            raise no_controller_action(self.runner.phase.value)
        return names

    # -- ops -----------------------------------------------------------------------------
    def _op_prefill(self, act: dict[str, Any]) -> dict[str, Any]:
        self._launch(CallKind.PREFILL, act["chunk"])
        return self._complete()

    def _op_decode(self, act: dict[str, Any]) -> dict[str, Any]:
        self._launch(CallKind.DECODE)
        return self._complete()

    def _op_repair(self, act: dict[str, Any]) -> dict[str, Any]:
        self._launch(CallKind.REPAIR)
        return self._complete()

    def _op_launch(self, act: dict[str, Any]) -> dict[str, Any]:
        call = self._launch(None if act["kind"] is None else CallKind(act["kind"]), act["length"])
        return {"call_id": call.call_id, "kind": call.kind.value, "start": call.start, "length": call.length}

    def _op_complete(self, act: dict[str, Any]) -> dict[str, Any]:
        return self._complete()

    def _op_decide(self, act: dict[str, Any]) -> dict[str, Any]:
        d = self.runner.decide()
        if d is None:  # the support was empty: the request finished with constraint_error
            return {"finish_reason": self.runner.finish_reason.value}
        self._record_probe()
        return {"receipt_id": d.receipt_id, "token_id": d.token_id, "logprob": d.logprob, "draws": d.draws}

    def _op_commit(self, act: dict[str, Any]) -> dict[str, Any]:
        pending = self.runner.decision
        triggers = self.runner.commit(act["receipt"])
        assert pending is not None
        return {"receipt_id": pending.receipt_id, "token_id": pending.token_id, "triggers": [t.value for t in triggers]}

    def _op_step(self, act: dict[str, Any]) -> dict[str, Any]:
        return {"actions": self._steps(until_commit=True)}

    def _op_run(self, act: dict[str, Any]) -> dict[str, Any]:
        return {"actions": self._steps(until_commit=False)}

    def _op_cancel(self, act: dict[str, Any]) -> dict[str, Any]:
        return {"at": self.runner.cancel(act["kind"]).value}

    def _op_stream_fail(self, act: dict[str, Any]) -> dict[str, Any]:
        return {"at": self.runner.stream_failure().value}

    def _op_recover(self, act: dict[str, Any]) -> dict[str, Any]:
        self.runner.recover()
        return {}

    def _op_fault(self, act: dict[str, Any]) -> dict[str, Any]:
        r = self.runner
        kind, layer = act["kind"], act["layer"] or 0

        def refuse(guard: str) -> Rejection:
            return Rejection(NOT_ENABLED, f"transition.fault: guard '{guard}' is false in phase {r.phase.value}", "$.action",
                             details={"rule": "transition.fault", "guard": guard})

        call = r.in_flight
        if call is None:
            raise refuse("a call is in flight")
        if call.call_id in self._faulted:
            raise refuse("no fault recorded yet")
        if kind == "missing_lane" and r.cache is None:
            raise refuse("missing_lane needs a non-empty roster")
        if not 0 <= layer < r.model.config.num_hidden_layers:
            raise Rejection(ADAPTER_INVALID_ACTION, f"layer {layer} is outside the model", "$.layer")
        fault = DeviceFault(call.call_id, layer) if kind == "device_fault" else MissingLane(call.call_id, layer)
        r.faults = FaultPlan(r.faults.faults + (fault,))
        if kind == "missing_lane":
            # Nothing ran yet (the forward runs at complete): re-open the call with the layer's write dropped.
            r.cache.abandon_call()
            r.cache.begin_call(call.start, call.length, call.generation, drop_layers=r.faults.missing_lane_layers(call.call_id))
        self._faulted.add(call.call_id)
        return {"call_id": call.call_id}

    def _op_snapshot(self, act: dict[str, Any]) -> dict[str, Any]:
        r = self.runner
        if act["form"] == "repaired" and r.pending_ids and r.in_flight is None and not r.quarantined:
            # The append call RequestRunner.snapshot would run itself, run here through the same
            # runner methods so that the adapter sees the call and its score row.
            kind = CallKind.DECODE if r.phase is Phase.READY else (CallKind.REPAIR if r.repair_owed() else None)
            if kind is not None:
                self._launch(kind)
                self._complete()
        snapshot = r.snapshot(act["form"])
        handle = act["id"] or f"snapshot-{len(self.snapshots)}"
        self.snapshots[handle] = (snapshot, self.extras, self.config)
        return {"snapshot": handle}

    def _op_restore(self, act: dict[str, Any]) -> dict[str, Any]:
        entry = self.snapshots.get(act["snapshot"])
        if entry is None:
            raise Rejection(ADAPTER_INVALID_ACTION, f"no snapshot named {act['snapshot']!r}", "$.snapshot")
        snapshot, extras, _ = entry
        if act["corrupt"] is not None:
            snapshot = attrs.evolve(snapshot, record=corrupt_record(snapshot.record, act["corrupt"]))
        config = self.config
        model = self.model_for(config)
        # The current request as the runner admitted it (static capacity resolved): a snapshot of
        # another request (e.g. before a reuse) is refused with snapshot.identity_mismatch.
        runner = self.runner_cls.restore(model, snapshot, self.runner.request, tokenizer=load_tokenizer(config.model))
        self.runner, self.extras = runner, extras
        self._faulted = set()
        return {}

    def _op_reuse(self, act: dict[str, Any]) -> dict[str, Any]:
        changes: dict[str, Any] = {"prompt_ids": tuple(act["prompt_ids"])}
        if act["max_new_tokens"] is not None:
            changes["max_new_tokens"] = act["max_new_tokens"]
        config = self.config.evolve(**changes)
        self._start(config, cache=self.runner.cache)
        return {}
