"""The vLLM server: vLLM's in-process ``LLMEngine`` behind the step-wise controller, served over the stdio protocol.

Runs in vLLM's own virtual environment (``.venv-vllm``, built by ``DECODESPEC_VLLM=1
.ci/setup``); the gate starts it through :mod:`decodespec.checks.adapters.vllm` (``--runtime
vllm``) or a user with ``--runtime stdio:'.venv-vllm/bin/python -m
decodespec.checks.adapters.vllm_engine'``.  The controller is the peers' one
(:class:`~decodespec.checks.adapters.peer.PeerAdapter`); every answer comes from vLLM:

* **Engine**: ``LLM(model=DIR, dtype="float32", enforce_eager=True, max_model_len=2048,
  seed=0, max_logprobs=-1, logprobs_mode="raw_logits", enable_prefix_caching=False,
  async_scheduling=False)`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in
  this process, and ``LLMEngine.step()`` is one scheduler iteration -- one model call of the
  one running request (the first is the prefill plus the first token, each later one decodes
  the pending token and samples the next).  Prefix caching is off so that every request
  computes its own prompt rows.
* **Admission** (``reset``): ``add_request(id, {"prompt_token_ids": L ids}, params)`` -- vLLM
  validates the prompt and the parameters there (an id outside the vocabulary is
  ``runtime.invalid_request``, another refusal ``adapter.unsupported``, with vLLM's message);
  the request waits in vLLM's scheduler until the first step.
* **Model call** (``complete`` of a prefill or decode): one ``step()``.  The
  decision row is the request's ``logprobs=-1`` entry of that step in ``raw_logits`` mode:
  every id's raw logit (``float32[49152]``), which is the row vLLM's sampler read.
* **P** is what vLLM's scheduler scheduled for the request (``SchedulerOutput.
  num_scheduled_tokens``, summed), which equals the live request's ``num_computed_tokens``
  while it runs; vLLM frees a finished request, so the count is kept from the scheduler.
* **Decision**: the id vLLM's own sampler selected in that step (``SamplingParams``: greedy is
  ``temperature=0``; ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
  ``frequency_penalty``, ``presence_penalty``, ``logit_bias``, ``min_tokens``, ``seed`` per
  request).  vLLM's processed rows are a per-engine mode (``logprobs_mode=processed_logprobs``
  needs a second engine), so ``policy_rows`` is not declared.
* **Finish**: vLLM's own criteria (``vllm/v1/core/sched/utils.py`` ``check_stop``: the stop
  token ids -- the case's EOS ids, with ``ignore_eos=True`` so that the tokenizer's EOS alone
  does not stop -- ``max_tokens``, ``max_model_len``; stop strings in the output processor's
  detokenizer); every criterion that holds after the step is a trigger (vLLM publishes one
  ``finish_reason``).  The returned text is vLLM's (``CompletionOutput.text``): cut at a stop
  string's start with the completing token kept, which is the spec's text alignment
  (``output.alignment:text`` is declared; under the default token alignment it is the documented
  deviation ``vllm.stop_string_text_aligned``).
* **Cancel / abort**: an interrupt in flight awaits the step, then ``abort_request([id])``;
  a cancel between calls leaves the request in the engine until the next reset aborts it
  (vLLM has no call in flight then).

Refused with ``adapter.unsupported``: the tiny model (the gate's vLLM runs SmolLM2), no-cache
and static cache families (vLLM's paged KV cache is the only one), chunked prefill (vLLM's
scheduler chunks by its own token budget), a context cap other than the window, a
``final_cache`` repair call, bfloat16 / float16 (the engine is float32), snapshots, reuse,
beams (``LLM.beam_search`` is a front-end loop, not steppable), transforms vLLM has no
``SamplingParams`` field for, a repetition penalty over the output only; and whatever vLLM's
own validation refuses (``max_tokens=0``), with vLLM's message.

Source: vLLM 0.32.0 ``vllm/v1/engine/llm_engine.py`` (``add_request``, ``step``,
``abort_request``), ``vllm/v1/core/sched/utils.py`` (``check_stop``),
``vllm/v1/engine/output_processor.py`` / ``detokenizer.py`` (stop strings),
``vllm/sampling_params.py``; research/vllm-cpu.md; docs/design.md section 11.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

#: The engine's context window (positions).
MAX_MODEL_LEN = 2048
#: Scheduler iterations one model call may take (a prompt longer than vLLM's token budget is chunked by vLLM).
MAX_STEPS_PER_CALL = 64


def configure_environment(cache_dir: Path) -> None:
    """vLLM's in-process, single-thread, offline, private-cache settings; set before vLLM or torch is imported."""
    dirs = {"VLLM_CACHE_ROOT": cache_dir / "vllm", "TORCHINDUCTOR_CACHE_DIR": cache_dir / "inductor", "TMPDIR": cache_dir / "tmp"}
    for key, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        os.environ[key] = str(path)
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def capabilities() -> frozenset[str]:
    """What the vLLM server declares (ops, envelope features and transforms it runs; the rest is never sent)."""
    from .features import transform_capability

    return frozenset({
        "cache:dynamic", "decide_commit", "inflight", "sampling", "logits", "stop_strings", "output.include_stop_str",
        "termination.min_new_tokens", "termination.zero_new_tokens:prefill_only", "termination.zero_new_tokens:reject",
        "output.final_cache:none", "output.alignment:text", "policy.order:vllm",
    }) | {transform_capability(n) for n in (*_SAMPLING_FIELDS, "logit_bias", "min_new_tokens")}


#: Policy transform -> the ``SamplingParams`` field vLLM builds its sampler step from (its one parameter).
_SAMPLING_FIELDS = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
}


def sampling_fields(config: Any) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments a user sets for ``config`` (before vLLM validates them).

    Raises:
        Rejection: ``adapter.unsupported`` for a policy vLLM has no field for; ``policy.*`` for a
            policy the M3.8 schema refuses.
    """
    from decodespec.spec.policy.config import EmptySupport, Family, policy_config_from_json

    from .peer import main_value, unsupported

    policy = policy_config_from_json(config.policy)
    if policy.family is Family.BEAM:
        raise unsupported("vLLM's beam search is LLM.beam_search, a front-end loop of one-token requests (not steppable)",
                          "$.policy.family")
    if policy.empty_support is not EmptySupport.RAISE:
        raise unsupported("vLLM has no EOS fallback for an empty support", "$.policy.empty_support")
    fields: dict[str, Any] = {"temperature": 1.0 if policy.family is Family.MULTINOMIAL else 0.0}
    for index, transform in enumerate(policy.transforms):
        path = f"$.policy.transforms[{index}]"
        name = transform.name
        if name == "repetition_penalty" and transform.get("history") != "prompt_and_output":
            raise unsupported("vLLM's repetition_penalty reads the prompt and the output ids", path)
        if name in _SAMPLING_FIELDS:
            fields[_SAMPLING_FIELDS[name]] = main_value(transform)
        elif name == "logit_bias":
            fields["logit_bias"] = {int(token): float(bias) for token, bias in transform.get("bias")}
        elif name == "min_new_tokens":
            fields["min_tokens"] = int(config.min_new_tokens)
        else:
            raise unsupported(f"vLLM's SamplingParams has no {name!r} field", path)
    if config.min_new_tokens:
        fields["min_tokens"] = int(config.min_new_tokens)
    if policy.family is Family.MULTINOMIAL and config.seed is not None:
        fields["seed"] = int(config.seed)
    return fields


class VllmEngine:
    """vLLM's engine, one contract call at a time (see the module docstring).

    Args:
        model_dir: The HF directory of SmolLM2 (:func:`decodespec.checks.adapters.vllm.convert_smollm2`).
    """

    name = "vllm"

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.capabilities = capabilities()
        self.llm = None
        self.request_id: str | None = None
        self.num_requests = 0
        self.scheduled: dict[str, int] = {}

    # -- engine --------------------------------------------------------------------------
    def _engine(self) -> Any:
        if self.llm is None:
            from vllm import LLM

            self.llm = LLM(model=str(self.model_dir), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN, seed=0,
                           max_logprobs=-1, logprobs_mode="raw_logits", enable_prefix_caching=False, async_scheduling=False)
            scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
            schedule = scheduler.schedule

            def recorded_schedule(*args: Any, **kwargs: Any) -> Any:
                out = schedule(*args, **kwargs)
                for rid, count in out.num_scheduled_tokens.items():
                    self.scheduled[rid] = self.scheduled.get(rid, 0) + int(count)
                return out

            scheduler.schedule = recorded_schedule  # observe only: the scheduler's own output, unchanged
        return self.llm

    def _live_request(self) -> Any:
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        return scheduler.requests.get(self.internal_id) if self.request_id is not None else None

    def _abort(self) -> None:
        if self.request_id is not None and self.llm is not None:
            self.llm.llm_engine.abort_request([self.request_id])
            while self.llm.llm_engine.has_unfinished_requests():  # drain: nothing else may run in the next call
                self.llm.llm_engine.step()
        self.request_id = None

    # -- request -------------------------------------------------------------------------
    def window_for(self, config: Any) -> int:
        """``max_model_len`` of the engine.

        Raises:
            Rejection: ``adapter.unsupported`` for the tiny model.
        """
        from .peer import unsupported

        if config.model != "smollm2":
            raise unsupported("the gate's vLLM runs SmolLM2 (converted from the GGUF file); the tiny model is not served", "$.model")
        return MAX_MODEL_LEN

    def start(self, config: Any, *, context_cap: int, reuse: bool = False) -> None:
        """A new request: the previous one aborted, ``SamplingParams`` built and validated by vLLM.

        Raises:
            Rejection: ``adapter.unsupported`` (see the module docstring), with vLLM's message
                when vLLM's own validation refuses the parameters.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from .peer import unsupported

        if config.cache != "dynamic":
            raise unsupported("vLLM has one cache family: its paged KV cache (dynamic)", "$.cache")
        if config.prefill_chunk is not None:
            raise unsupported("vLLM's scheduler chunks a prefill by its own token budget; the request cannot set the chunk",
                              "$.prefill_chunk")
        if config.context_cap is not None and context_cap != MAX_MODEL_LEN:
            raise unsupported("vLLM caps a request by max_model_len, an engine option; it has no per-request total-token cap",
                              "$.context_cap")
        if config.final_cache == "all_outputs":
            raise unsupported("vLLM runs no model call without sampling a token: no repair call for a final cache", "$.final_cache")
        if config.dtype != "float32" or config.device != "cpu":
            raise unsupported("the vLLM engine runs float32 on the CPU (dtype is an engine option)", "$.dtype")
        if reuse:
            raise unsupported("vLLM requests own their KV blocks; there is no cache object to reuse", "$.op")
        fields = sampling_fields(config)
        try:
            params = SamplingParams(max_tokens=config.max_new_tokens, logprobs=-1, ignore_eos=True,
                                    stop_token_ids=list(config.eos_ids), stop=list(config.stop_strings) or None,
                                    include_stop_str_in_output=bool(config.include_stop_str),
                                    output_kind=RequestOutputKind.DELTA, **fields)
        except Exception as exc:  # noqa: BLE001 - vLLM's validation (VLLMValidationError, ValueError) is the answer
            raise unsupported(f"vLLM refuses the request: {type(exc).__name__}: {exc}", "$") from None
        engine = self._engine().llm_engine
        self._abort()
        self.num_requests += 1
        request_id = f"decodespec-{self.num_requests}"
        try:  # vLLM validates the prompt here (an id outside the vocabulary is its VLLMValidationError)
            internal_id = engine.add_request(request_id, {"prompt_token_ids": list(config.prompt_ids)}, params)
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the answer; nothing was admitted
            from decodespec.impl.runtime import INVALID_REQUEST
            from decodespec.spec.errors import Rejection

            if "out of vocabulary" in str(exc):
                raise Rejection(INVALID_REQUEST, f"vLLM refuses the prompt: {type(exc).__name__}: {exc}", "$.prompt_ids") from None
            raise unsupported(f"vLLM refuses the request: {type(exc).__name__}: {exc}", "$") from None
        self.request_id, self.internal_id = request_id, internal_id
        self.scheduled[internal_id] = 0
        state = engine.output_processor.request_states[internal_id]
        if state.logprobs_processor is not None:
            # The row's values only: no decoded string per vocabulary entry (49152 detokenizations per step).
            state.logprobs_processor.tokenizer = None
        self.config, self.params, self.context_cap = config, params, context_cap
        self.rows = 0
        self.started = False
        self.token_ids: list[int] = []
        self.text_so_far = ""
        self.token: int | None = None
        self.finish: tuple[str | None, Any] | None = None  # (finish_reason, stop_reason) of the step that finished

    def processed(self) -> int:
        """Rows vLLM's scheduler computed for the request (its ``num_computed_tokens`` while it runs)."""
        live = self._live_request() if self.llm is not None else None
        if live is not None and int(live.num_computed_tokens) != self.rows:
            raise AssertionError(f"vLLM's num_computed_tokens {live.num_computed_tokens} != scheduled rows {self.rows}")
        return self.rows

    def physical(self) -> int:
        """Rows written (vLLM's blocks are allocated per request; the count is :meth:`processed`)."""
        return self.rows

    def forward(self, sequence: list[int], start: int, length: int) -> np.ndarray:
        """One model call: ``add_request`` + ``step()`` for the prefill, ``step()`` for a decode.

        Returns:
            ``float32[V]`` raw logits of the call's decision row (vLLM's ``raw_logits`` logprobs).

        Raises:
            AssertionError: vLLM's request does not hold ``sequence`` (the controller and vLLM disagree).
        """
        engine = self._engine().llm_engine
        if self.request_id is None:
            raise AssertionError("vLLM's request is finished or aborted: no further model call")
        if not self.started:
            if start != 0 or length != self.config.prompt_len:
                raise AssertionError(f"vLLM prefills the whole prompt in its first step, not [{start}, {start + length})")
            self.started = True
        elif list(sequence[self.config.prompt_len:]) != self.token_ids:
            raise AssertionError(f"vLLM's output ids {self.token_ids} differ from the committed ids {sequence[self.config.prompt_len:]}")
        for _ in range(MAX_STEPS_PER_CALL):
            outputs = [o for o in engine.step() if o.request_id == self.request_id]
            if outputs:
                break
        else:
            raise AssertionError(f"vLLM returned no token for {self.request_id} in {MAX_STEPS_PER_CALL} steps")
        (output,) = outputs
        self.rows = self.scheduled.pop(self.internal_id, 0) if output.finished else self.scheduled[self.internal_id]
        completion = output.outputs[0]
        if len(completion.token_ids) != 1 or not completion.logprobs:
            raise AssertionError(f"one step gave {len(completion.token_ids)} tokens and {len(completion.logprobs or [])} logprob rows")
        entries = completion.logprobs[0]
        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        ids = np.fromiter(entries.keys(), dtype=np.int64, count=len(entries))
        values = np.fromiter((lp.logprob for lp in entries.values()), dtype=np.float64, count=len(entries))
        if len(entries) != vocab or np.unique(ids).size != vocab:
            raise AssertionError(f"vLLM returned {len(entries)} logprob entries, not the {vocab}-id row")
        row = np.empty(vocab, dtype=np.float32)
        row[ids] = values
        self.token = int(completion.token_ids[0])
        self.token_ids.append(self.token)
        self.text_so_far += completion.text
        self.finish = (completion.finish_reason, completion.stop_reason) if output.finished else None
        if output.finished:
            self.request_id = None  # vLLM freed it (a stop string aborted it in the engine core)
        return row

    def rollback(self, processed: int) -> None:
        """``abort_request``: vLLM drops the request and every row it holds (an aborted call ends the request)."""
        self._abort()
        self.rows = processed

    def decide(self, row: np.ndarray, sequence: list[int], output_count: int) -> Any:
        """The id vLLM's sampler selected in the step that produced ``row`` (no processed support is exposed)."""
        from .peer import PeerDecision

        return PeerDecision(int(self.token))

    def accept(self, token_id: int) -> None:
        """Nothing: vLLM appended its own selection to the request in the step."""
        if token_id != self.token:
            raise AssertionError(f"committed {token_id}, vLLM selected {self.token}")

    def triggers(self, sequence: list[int], output_count: int) -> set[Any]:
        """vLLM's own criteria that hold after the step (``check_stop`` order: stop token ids, ``max_tokens``, ``max_model_len``; stop strings)."""
        from decodespec.spec.enums import FinishReason

        fired: set[FinishReason] = set()
        if self.finish is None:
            return fired
        finish_reason, stop_reason = self.finish
        if output_count >= self.config.min_new_tokens and sequence[-1] in self.params.stop_token_ids:
            fired.add(FinishReason.EOS)
        if output_count >= self.config.max_new_tokens:
            fired.add(FinishReason.LENGTH)
        if len(sequence) >= MAX_MODEL_LEN:
            fired.add(FinishReason.CONTEXT_LENGTH)
        if isinstance(stop_reason, str):
            fired.add(FinishReason.STOP_STRING)
        if not fired:
            raise AssertionError(f"vLLM finished with {finish_reason!r} / {stop_reason!r} and no criterion holds")
        return fired

    def text(self, output_ids: list[int]) -> str | None:
        """vLLM's returned text (``CompletionOutput.text``, joined over the steps) when ``output_ids`` are vLLM's ids."""
        return self.text_so_far if list(output_ids) == self.token_ids else None

    def cache_probe(self, processed: int) -> np.ndarray | None:
        """Not exposed (vLLM's KV blocks live in its block pool)."""
        return None

    def save(self) -> Any:  # pragma: no cover - the capability is never declared
        from .peer import unsupported

        raise unsupported("vLLM has no request snapshot", "$.op")

    def load(self, blob: Any) -> None:  # pragma: no cover - the capability is never declared
        from .peer import unsupported

        raise unsupported("vLLM has no request snapshot", "$.op")


def create(model_dir: Path) -> Any:
    """The step-wise controller over :class:`VllmEngine`."""
    from .peer import PeerAdapter

    return PeerAdapter(VllmEngine(model_dir), "vllm")


def main(argv: list[str] | None = None) -> int:
    """``python -m decodespec.checks.adapters.vllm_engine --model-dir DIR [--cache-dir DIR]``: serve vLLM over stdin / stdout.

    vLLM logs to stdout, so file descriptor 1 is moved to stderr before vLLM is imported and the
    protocol is written to a private duplicate of the original stdout.
    """
    parser = argparse.ArgumentParser(prog="python -m decodespec.checks.adapters.vllm_engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="HF directory of SmolLM2 (python -m decodespec.checks.adapters.vllm --convert)")
    parser.add_argument("--cache-dir", default=None, help="private folder for vLLM's and inductor's caches and temporary files")
    args = parser.parse_args(argv)
    configure_environment(Path(args.cache_dir or Path(args.model_dir).parent / "vllm-runtime"))
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)  # every library write to fd 1 (vLLM's log handlers, C++ prints) goes to stderr
    sys.stdout = sys.stderr
    from decodespec.checks.stdio_server import serve

    try:
        return serve("vllm", sys.stdin, protocol, factory=lambda: create(Path(args.model_dir)))
    finally:
        protocol.flush()


if __name__ == "__main__":
    sys.exit(main())
