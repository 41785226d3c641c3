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
* **Prompt logprobs** (M3.10 0x02; ``prompt_logprobs``, served by a server started with
  ``--logprobs-mode raw_logprobs``, vLLM's default): a fresh request with
  ``SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=top_k)``, stepped to its end;
  vLLM's ``RequestOutput.prompt_logprobs`` is converted entry by entry
  (:func:`prompt_entries`).  What vLLM computes (R: ``_get_prompt_logprobs_dict``, 5306-5413):
  the prefill's rows ``0 .. L-2`` through ``compute_logits``, no sampling processor ("prompt
  tokens skip sampling processors"), then ``log_softmax(dtype=float32)`` -- but under
  ``logprobs_mode`` ``raw_logits`` / ``processed_logits`` the **raw logits** themselves
  (R:5385-5388), which is why the gate's ``raw_logits`` engine refuses the request; the first
  entry is ``None`` (``vllm/logprobs.py`` ``create_prompt_logprobs``: first-token policy
  ``none``); ``gather_logprobs`` (``v1/sample/sampler.py``) keeps the prompt token's logprob with
  its rank ``count(row >= own)`` (ties put the token last; the spec puts the lower id first) and
  ``torch.topk`` of the row with ranks ``1 .. k`` (a top-k id equal to the prompt token overwrites
  its entry, so its rank is its top-k place).
* **Bench** (the ``bench`` command, :meth:`VllmEngine.bench`): one greedy request
  (``temperature=0``, ``max_tokens=G``, ``ignore_eos=True``, no logprobs), each
  ``EngineCore`` step timed as one model call and each ``LLMEngine.step`` that returns tokens as
  one emission (:class:`~decodespec.spec.latency.Timeline`).
* **Vocabulary identity** (M3.8 0x08): :meth:`VllmEngine.vocab_table` reads the ordered table
  of vLLM's own tokenizer (``LLM.get_tokenizer()``, an HF tokenizer) as the ``hf`` adapter reads
  HF's; every observation carries its hash, compared at STATE (``vocab.hash``).
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

Size: one server process: vLLM's engine behind the step-wise controller, both its modes (raw logits,
prompt logprobs) and their wire handling, which run inside vLLM's own venv.
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


def configure_environment(cache_dir: Path, threads: int = 1) -> None:
    """vLLM's in-process, offline, private-cache settings and ``threads`` OpenMP threads (default 1); set before vLLM or torch is imported."""
    dirs = {"VLLM_CACHE_ROOT": cache_dir / "vllm", "TORCHINDUCTOR_CACHE_DIR": cache_dir / "inductor", "TMPDIR": cache_dir / "tmp"}
    for key, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        os.environ[key] = str(path)
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(int(threads)), "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


#: ``logprobs_mode`` values a server runs: the gate's lock-step engine (raw logit rows) and vLLM's default.
LOGPROBS_MODES = ("raw_logits", "raw_logprobs")


def capabilities(logprobs_mode: str = "raw_logits") -> frozenset[str]:
    """What the vLLM server declares (ops, envelope features and transforms it runs; the rest is never sent).

    Under ``raw_logits`` (the gate's engine) the rows are raw logits (``logits``) and prompt
    logprobs are refused (vLLM returns raw logits under that name there); under ``raw_logprobs``
    (vLLM's default) the rows are log-softmaxed (no ``logits``) and ``output.prompt_logprobs`` is
    declared.

    Raises:
        ValueError: a mode outside :data:`LOGPROBS_MODES`.
    """
    from .features import transform_capability

    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    mode = {"logits"} if logprobs_mode == "raw_logits" else {"output.prompt_logprobs"}
    return frozenset(mode) | frozenset({
        "cache:dynamic", "decide_commit", "inflight", "sampling", "stop_strings", "output.include_stop_str",
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
        logprobs_mode: The engine's ``logprobs_mode`` (:data:`LOGPROBS_MODES`).
    """

    name = "vllm"

    def __init__(self, model_dir: Path, logprobs_mode: str = "raw_logits"):
        self.model_dir = Path(model_dir)
        self.logprobs_mode = logprobs_mode
        self.capabilities = capabilities(logprobs_mode)
        self.llm = None
        self.request_id: str | None = None
        self.num_requests = 0
        self.scheduled: dict[str, int] = {}
        self._table: Any = None

    # -- engine --------------------------------------------------------------------------
    def _engine(self) -> Any:
        if self.llm is None:
            from vllm import LLM

            self.llm = LLM(model=str(self.model_dir), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN, seed=0,
                           max_logprobs=-1, logprobs_mode=self.logprobs_mode, enable_prefix_caching=False, async_scheduling=False)
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

    def vocab_table(self, config: Any) -> Any:
        """vLLM's ordered vocabulary table: the HF tokenizer vLLM serves with (``LLM.get_tokenizer()``), read as HF's is.

        :func:`~decodespec.checks.adapters.hf.hf_table_of` of it (id -> bytes, special added tokens
        as control ids, the tokenizer's special ids), read once per engine; the peer controller
        hashes it (:func:`~decodespec.checks.adapters.peer.peer_vocab_hash`) and reports it in every
        observation, so ``ladder.STATE`` compares it with the checkpoint's (check ``vocab.hash``).
        ``None`` for a model the server does not run.

        Source: vLLM 0.32.0 ``vllm/entrypoints/llm.py`` (``LLM.get_tokenizer``); M3.8 0x08.
        """
        if config.model != "smollm2":
            return None
        if self._table is None:
            from .hf import hf_table_of

            self._table = hf_table_of(self._engine().get_tokenizer())
        return self._table

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

    def prompt_logprobs(self, config: Any, spec: Any) -> list[Any]:
        """vLLM's prompt logprobs of ``config``'s prompt (a request the controller has just admitted and not run).

        The admitted request is aborted and a new one added with
        ``SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=spec.top_k)``
        (the prompt logprobs do not depend on the sampling parameters: vLLM skips its processors
        for them), stepped until it finishes; its ``RequestOutput.prompt_logprobs`` converted by
        :func:`prompt_entries`.

        Raises:
            Rejection: ``adapter.unsupported`` on the ``raw_logits`` engine (vLLM's "prompt
                logprobs" are raw logits there, R:5385-5388).
            AssertionError: vLLM gave no prompt logprobs, or entries that do not belong to the prompt.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from .peer import unsupported

        if self.logprobs_mode != "raw_logprobs":
            raise unsupported(f"under logprobs_mode {self.logprobs_mode!r} vLLM's prompt_logprobs hold raw logits, not logprobs "
                              "(gpu_model_runner.py _get_prompt_logprobs_dict); a raw_logprobs engine serves them",
                              "$.output.prompt_logprobs")
        engine = self._engine().llm_engine
        self._abort()
        self.num_requests += 1
        request_id = f"decodespec-plp-{self.num_requests}"
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=spec.top_k,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        internal_id = engine.add_request(request_id, {"prompt_token_ids": list(config.prompt_ids)}, params)
        final = None
        for _ in range(MAX_STEPS_PER_CALL):
            final = next((o for o in engine.step() if o.request_id == request_id and o.finished), None)
            if final is not None:
                break
        self.scheduled.pop(internal_id, None)
        if final is None or final.prompt_logprobs is None:
            raise AssertionError(f"vLLM returned no prompt logprobs for {request_id} in {MAX_STEPS_PER_CALL} steps")
        return prompt_entries(list(config.prompt_ids), final.prompt_logprobs, spec)

    def bench(self, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], Any]:
        """One timed greedy request: ``(output ids, Timeline)`` (M3.10 0x0BA).

        ``SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)`` (no logprobs,
        text detokenized as a user gets it).  Admission is the clock's zero, just before
        ``add_request``; each ``EngineCore`` step that scheduled the request's rows is one model
        call (``prefill`` for the first, ``decode`` after; launch and completion stamped around the
        core's step -- schedule, forward, sample, update; on the CPU the forward is complete when it
        returns); each ``LLMEngine.step`` that hands out new token ids is one emission (after the
        output processor, as the caller receives it); the final flush is the finishing step's return.

        Raises:
            AssertionError: the request did not finish within ``new_tokens + MAX_STEPS_PER_CALL`` steps.
        """
        import time

        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from decodespec.spec.latency import CallTiming, Emission, Timeline

        engine = self._engine().llm_engine
        self._abort()
        self.num_requests += 1
        request_id = f"decodespec-bench-{self.num_requests}"
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        client = engine.engine_core
        calls: list[CallTiming] = []
        emissions: list[Emission] = []
        ids: list[int] = []
        core_get_output = client.get_output
        state = {"internal": None, "rows": 0}

        def timed_get_output() -> Any:  # observe only: the core's own step, stamped
            launch = time.perf_counter_ns() - t0
            out = core_get_output()
            complete = time.perf_counter_ns() - t0
            rows = self.scheduled.get(state["internal"], 0) - state["rows"]
            if rows > 0:
                calls.append(CallTiming("decode" if calls else "prefill", rows, launch, complete))
                state["rows"] += rows
            return out

        client.get_output = timed_get_output
        try:
            t0 = time.perf_counter_ns()
            state["internal"] = engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, params)
            final = None
            for _ in range(new_tokens + MAX_STEPS_PER_CALL):
                for output in engine.step():
                    if output.request_id != request_id:
                        continue
                    new = output.outputs[0].token_ids
                    if new:
                        ids.extend(int(t) for t in new)
                        emissions.append(Emission(time.perf_counter_ns() - t0, len(ids)))
                    if output.finished:
                        final = time.perf_counter_ns() - t0
                if final is not None:
                    break
        finally:
            client.get_output = core_get_output
            self.scheduled.pop(state["internal"], None)
        if final is None:
            raise AssertionError(f"vLLM's bench request {request_id} did not finish in {new_tokens + MAX_STEPS_PER_CALL} steps")
        return ids, Timeline(prompt_len=len(prompt_ids), calls=tuple(calls), emissions=tuple(emissions), final_ns=final).check()

    def save(self) -> Any:  # pragma: no cover - the capability is never declared
        from .peer import unsupported

        raise unsupported("vLLM has no request snapshot", "$.op")

    def load(self, blob: Any) -> None:  # pragma: no cover - the capability is never declared
        from .peer import unsupported

        raise unsupported("vLLM has no request snapshot", "$.op")


def prompt_entries(prompt_ids: list[int], vllm_entries: Any, spec: Any) -> list[Any]:
    """vLLM's ``RequestOutput.prompt_logprobs`` as the spec's entries (M3.10 0x02), values and ranks unchanged.

    ``vllm_entries`` is vLLM's list: ``None`` for ``x_0`` (dropped under first-token policy
    ``omitted``), then per position ``i`` a dict ``{id: Logprob(logprob, rank, ...)}`` whose first
    key is ``x_i`` (its rank ``count(row >= own)``) followed by the ``top_k`` ids of
    ``torch.topk`` with ranks ``1 .. k``; when ``x_i`` is among them its entry carries the top-k
    rank and the dict has ``k`` keys, else ``k + 1``.  The top-k list is ordered by those ranks.

    Args:
        prompt_ids: The ``L`` prompt ids.
        vllm_entries: ``L`` items (``None``, then dicts of objects with ``logprob`` and ``rank``).
        spec: The :class:`~decodespec.spec.prompt_logprobs.PromptLogprobsSpec` asked for (``top_k`` passed to vLLM).

    Returns:
        :class:`~decodespec.spec.prompt_logprobs.PromptLogprob` per entry (``L`` or ``L - 1``).

    Raises:
        AssertionError: the list does not have vLLM's shape (length, leading ``None``, ``x_i``
            missing from its dict, ranks ``1 .. k`` not all present).
    """
    from decodespec.spec.prompt_logprobs import FirstTokenPolicy, PromptLogprob

    if len(vllm_entries) != len(prompt_ids) or (vllm_entries and vllm_entries[0] is not None):
        raise AssertionError(f"vLLM gave {len(vllm_entries)} prompt-logprob entries for {len(prompt_ids)} prompt ids "
                             "(expected the same count, the first None)")
    out = [PromptLogprob(0, int(prompt_ids[0]))] if prompt_ids and spec.first_token is FirstTokenPolicy.NONE else []
    k = spec.top_k
    for position in range(1, len(prompt_ids)):
        entry, token = vllm_entries[position], int(prompt_ids[position])
        if entry is None or token not in entry:
            raise AssertionError(f"vLLM's prompt-logprob entry {position} has no logprob for the prompt id {token}")
        in_top = len(entry) == k
        if len(entry) not in (k, k + 1):
            raise AssertionError(f"vLLM's prompt-logprob entry {position} has {len(entry)} ids, not {k} or {k + 1}")
        top = sorted((int(lp.rank), int(i), float(lp.logprob)) for i, lp in entry.items() if in_top or int(i) != token)
        if [r for r, _, _ in top] != list(range(1, k + 1)):
            raise AssertionError(f"vLLM's prompt-logprob entry {position}: top-k ranks {[r for r, _, _ in top]} are not 1..{k}")
        own = entry[token]
        out.append(PromptLogprob(position, token, float(own.logprob), int(own.rank), tuple((i, v) for _, i, v in top)))
    return out


def bench_command(adapter: Any, message: dict[str, Any]) -> dict[str, Any]:
    """The server's ``bench`` command: ``{"output_ids", "timeline"}`` of :meth:`VllmEngine.bench` (greedy, timed in this process).

    Raises:
        Rejection: ``adapter.protocol`` for ``prompt_ids`` / ``new_tokens`` that are not a non-empty id list / a count >= 1.
    """
    import attrs

    from decodespec.spec.errors import Rejection

    from . import ADAPTER_PROTOCOL

    prompt_ids, new_tokens = message.get("prompt_ids"), message.get("new_tokens")
    if (not isinstance(prompt_ids, list) or not prompt_ids or not all(isinstance(i, int) and i >= 0 for i in prompt_ids)
            or not isinstance(new_tokens, int) or new_tokens < 1):
        raise Rejection(ADAPTER_PROTOCOL, "bench needs prompt_ids (a non-empty list of ids) and new_tokens >= 1", "$")
    ids, timeline = adapter.engine.bench(prompt_ids, new_tokens)
    return {"output_ids": ids, "timeline": attrs.asdict(timeline)}


def create(model_dir: Path, logprobs_mode: str = "raw_logits") -> Any:
    """The step-wise controller over :class:`VllmEngine`."""
    from .peer import PeerAdapter

    return PeerAdapter(VllmEngine(model_dir, logprobs_mode), "vllm")


def main(argv: list[str] | None = None) -> int:
    """``python -m decodespec.checks.adapters.vllm_engine --model-dir DIR [--cache-dir DIR]``: serve vLLM over stdin / stdout.

    vLLM logs to stdout, so file descriptor 1 is moved to stderr before vLLM is imported and the
    protocol is written to a private duplicate of the original stdout.
    """
    parser = argparse.ArgumentParser(prog="python -m decodespec.checks.adapters.vllm_engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="HF directory of SmolLM2 (python -m decodespec.checks.adapters.vllm --convert)")
    parser.add_argument("--cache-dir", default=None, help="private folder for vLLM's and inductor's caches and temporary files")
    parser.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw_logits",
                        help="the engine's logprobs_mode: raw_logits (default: the gate's raw rows) or raw_logprobs (vLLM's default; "
                        "serves prompt logprobs)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the engine (default 1; vLLM fixes it at start)")
    args = parser.parse_args(argv)
    configure_environment(Path(args.cache_dir or Path(args.model_dir).parent / "vllm-runtime"), threads=args.threads)
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)  # every library write to fd 1 (vLLM's log handlers, C++ prints) goes to stderr
    sys.stdout = sys.stderr
    from decodespec.checks.adapters.stdio_server import serve

    try:
        return serve("vllm", sys.stdin, protocol, factory=lambda: create(Path(args.model_dir), args.logprobs_mode),
                     extra={"bench": bench_command})
    finally:
        protocol.flush()


if __name__ == "__main__":
    sys.exit(main())
