"""The llama.cpp adapter, through llama-cpp-python's ``Llama`` and its low-level bindings.

llama.cpp runs the SmolLM2 Q4_1 weights natively (quantized matmuls against Q8-quantized
activations), so its logits legitimately differ from the dequantized float32 reference; the
runtime's tolerance is declared in ``checks/gate/expectations/llamacpp.toml`` from a measured
distribution, and the ladder's margin rule decides token equality (undecided when the reference
margin is at most 2 epsilon).

What each contract call does (:class:`LlamaCppEngine` behind
:class:`~decodespec.checks.adapters.peer.PeerAdapter`):

* **Model call**: ``Llama.eval(rows)`` -- one ``llama_decode`` of the call's rows at positions
  ``n_tokens..`` (after llama-cpp-python's own ``kv_cache_seq_rm(-1, n_tokens, -1)``); the
  decision row is ``llama_get_logits_ith(ctx, -1)``.  The context is created once per process
  with ``logits_all=False`` (a ``logits_all=True`` context keeps an ``n_ctx x V`` float32 score
  buffer, 400 MB at ``n_ctx = 2048``; only the last row is needed), ``n_threads = 1``,
  ``n_batch = 512``, ``seed`` per request.  The no-cache family clears the memory and evaluates
  the whole prefix every call (llama.cpp has no no-cache mode; this is what "cache vs no-cache"
  compares).
* **P** is llama.cpp's own memory frontier, ``llama_memory_seq_pos_max(mem, 0) + 1``, not the
  Python-side ``n_tokens`` counter.
* **Decision**: the sampler chain llama-cpp-python's ``Llama._init_sampler`` builds for the
  policy (penalties over the last ``last_n_tokens_size = 64`` accepted tokens -> top-k ->
  typical -> top-p -> min-p -> **temperature last** -> dist(seed); temperature 0 or the greedy
  family -> penalties -> greedy; Mirostat v2 -> penalties -> mirostat_v2), applied with
  ``llama_sampler_apply`` to the row (the processed support and its softmax are the POLICY
  probe), then ``llama_sampler_accept`` at commit (the chain's penalty / Mirostat history).  The
  chain's ``std::mt19937`` is the request RNG: llama.cpp does not count draws.
* **Finish**: ``llama_vocab_is_eog`` (llama-cpp-python's stop test; SmolLM2's EOG set is
  {0, 2, 4}, wider than a case's EOS ids), ``max_tokens`` (``length``), the context (``n_ctx``).
* **Rollback** of an aborted call: ``llama_memory_seq_rm(mem, -1, P, -1)``.
* **Snapshots**: ``Llama.save_state()`` / ``load_state()`` (``LlamaState``: ids, scores,
  ``n_tokens``, the ``llama_state_get_data`` bytes, seed).  ``state_write_data`` writes the model
  arch and memory only -- **not the sampler chain** (RNG, penalty history), so a restored
  request starts a fresh chain (llama.cpp ``src/llama-context.cpp`` ``state_write_data``).
* **Reuse**: ``Llama.reset()`` (llama-cpp-python's API for a new prompt on the same context).

Capabilities: no-cache / dynamic cache, chunked prefill, decide / commit, launch / complete,
sampling, raw logits, processed rows, reuse, snapshots (pending-suffix form).  Refused with
``adapter.unsupported``: the tiny model (no GGUF), a static cache (llama.cpp's KV cells are
allocated once per context, not per request), transforms without a llama-cpp-python sampler
(bad words, no-repeat n-gram, epsilon, eta, top-n-sigma through ``_init_sampler``, a
finite-state constraint; a logit bias is llama-cpp-python's own ``logit_bias`` processor at the
head of the chain), a repetition penalty over the prompt (llama-cpp-python's window holds only
the accepted output tokens), ``min_new_tokens`` (no such llama.cpp parameter), stop strings, structured completion, an
empty EOS set or one without the vocabulary's EOS id (llama-cpp-python always stops on EOG).  A streamed request runs with its chunks
not exposed.

Source: llama-cpp-python 0.3.36 ``llama_cpp/llama.py`` (``Llama.eval``, ``_init_sampler``,
``sample``, ``_create_completion`` stop tests, ``save_state`` / ``load_state``, ``reset``),
``llama_cpp/_internals.py`` (``LlamaTokenDataArray``); llama.cpp ``include/llama.h``
(``llama_memory_seq_rm`` / ``seq_pos_max``, ``llama_sampler_apply`` / ``accept``),
``src/llama-sampler.cpp``, ``common/sampling.cpp`` (default chain order);
research/peers-survey.md B' and G #47; M3.10 "Framework names are observations" (llama.cpp
column).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from typing import Any

import numpy as np

from decodespec.spec.enums import FinishReason
from decodespec.spec.policy.config import EmptySupport, Family, policy_config_from_json

from . import CaseConfig
from .features import envelope_features, names_at, transform_capability
from .peer import PeerAdapter, PeerDecision, bound_triggers, main_value, register_tolerances, unsupported

__all__ = [
    "LLAMACPP_CAPABILITIES",
    "LLAMACPP_SKIP_REASON",
    "N_CTX",
    "LlamaCppEngine",
    "available",
    "create",
    "last_row",
    "llama",
    "llama_all_rows",
    "llamacpp_vocab_table",
    "logit_bias_processor",
    "logit_drift",
    "sampler_params",
]

LLAMACPP_SKIP_REASON = ("llama-cpp-python not installed: pip install 'decodespec[llamacpp]' "
                        "(CMAKE_ARGS=-DGGML_NATIVE=OFF; DECODESPEC_LLAMACPP=1 .ci/setup builds it)")
#: What the llama.cpp adapter declares.

#: The context the adapter creates (positions; the adapter's model window).
N_CTX = 2048
#: The prompt-logprob context (``logits_all=True``): its ``n_ctx x V`` float32 score buffer is 100 MB at 512.
N_CTX_ALL = 512
#: Policy transform -> the ``Llama._init_sampler`` keyword of its sampler (its one parameter).
_SAMPLER_FIELDS = {
    "temperature": "temp", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical": "typical_p",
    "repetition_penalty": "repeat_penalty", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
}
LLAMACPP_CAPABILITIES = frozenset({
    "cache:none", "cache:dynamic", "prefill_chunk", "decide_commit", "inflight", "sampling", "logits", "policy_rows", "reuse",
    "snapshot", "output.prompt_logprobs",
}) | envelope_features() | names_at("policy.order") | {transform_capability(n) for n in (*_SAMPLER_FIELDS, "mirostat_v2", "logit_bias")}
"""The ops and probes the step-wise adapter has, every envelope feature the gate sends (llama.cpp refuses what it cannot
keep at reset: a skip), the policy orders, and the transforms :func:`sampler_params` maps to llama.cpp samplers."""
#: Neutral values: each sampler in ``_init_sampler``'s chain is then a no-op.
_NEUTRAL = {"temp": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0}


def available() -> str | None:
    """``None`` when llama-cpp-python and the SmolLM2 GGUF file are installed, else the skip reason."""
    from decodespec.checks.testing import SMOLLM2_SKIP_REASON
    from decodespec.impl.gguf import smollm2_available

    if importlib.util.find_spec("llama_cpp") is None:
        return LLAMACPP_SKIP_REASON
    return None if smollm2_available() else SMOLLM2_SKIP_REASON


def create(**options: Any) -> PeerAdapter:
    """The llama.cpp adapter (``options`` are ignored: the case config names the model).

    Its declared tolerance is the calibrated entry ``(llamacpp, smollm2, float32)`` of
    ``checks/gate/calibration.json`` (``decodespec calibrate --runtime llamacpp --stop-at-eos``); a
    ``[tolerance]`` table of ``checks/gate/expectations/llamacpp.toml`` would only fill a key the
    calibration leaves open.
    """
    register_tolerances("llamacpp")
    return PeerAdapter(LlamaCppEngine(), "llamacpp")


def _smollm2_context(n_ctx: int, *, logits_all: bool):
    """A ``Llama`` context on the SmolLM2 GGUF file: one thread, ``n_batch = n_ubatch = 512``, seed 0, freed at exit."""
    import atexit

    import llama_cpp

    from decodespec.impl.gguf import smollm2_path

    llm = llama_cpp.Llama(model_path=str(smollm2_path()), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=1,
                          n_threads_batch=1, logits_all=logits_all, seed=0, verbose=False)
    atexit.register(llm.close)  # free the context before interpreter teardown unloads the bindings
    return llm


@functools.lru_cache(maxsize=1)
def llama():
    """The shared ``Llama`` context on the SmolLM2 GGUF file (created once per process, last row only)."""
    return _smollm2_context(N_CTX, logits_all=False)


@functools.lru_cache(maxsize=1)
def llama_all_rows():
    """A second context with ``logits_all=True`` (every row's logits kept in ``scores``), for prompt logprobs only
    (created once per process, :data:`N_CTX_ALL` positions)."""
    return _smollm2_context(N_CTX_ALL, logits_all=True)


def last_row(llm: Any) -> np.ndarray:
    """``llama_get_logits_ith(ctx, -1)``: the raw logits of the last decoded row, copied (``float32[V]``)."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32, copy=True)


def logit_drift(prompts: list[list[int]], steps: int, *, cache: str = "dynamic") -> dict[str, Any]:
    """Measure llama.cpp's raw rows against the float32 reference along the reference's greedy path.

    Both runtimes are teacher-forced with the reference's greedy id (lowest id on ties), so every
    row conditions on the same prefix.  Reference rows are the lock-step driver's no-cache
    float64 forward (:class:`decodespec.checks.gate.reference.Reference64`).

    Args:
        prompts: Token-id prompts.
        steps: Decision rows per prompt.
        cache: ``"dynamic"`` (llama.cpp's KV, one row per decode) or ``"none"`` (the whole
            prefix re-evaluated every row).

    Returns:
        ``{"linf": [...], "margin": [...], "flips": [{"prompt", "step", "ref", "cand",
        "margin", "linf"}], "rows": n}``: per row the L-infinity distance and the reference
        top-1 minus top-2 margin; a flip is a row whose greedy ids differ.

    Units: logits.
    """
    from decodespec.checks.gate.lockstep import reference_for

    reference = reference_for("smollm2")
    llm = llama()
    out: dict[str, Any] = {"linf": [], "margin": [], "flips": [], "rows": 0}
    for index, prompt in enumerate(prompts):
        llm.reset()
        llm._ctx.kv_cache_clear()
        sequence = list(prompt)
        llm.eval(sequence)
        for step in range(steps):
            if cache == "none":
                llm.reset()
                llm._ctx.kv_cache_clear()
                llm.eval(sequence)
            cand = last_row(llm).astype(np.float64)
            ref = reference.row(sequence).astype(np.float64)
            top2 = np.sort(ref)[-2:]
            ref_id, cand_id = int(np.argmax(ref)), int(np.argmax(cand))
            linf = float(np.max(np.abs(ref - cand)))
            out["linf"].append(linf)
            out["margin"].append(float(top2[1] - top2[0]))
            if ref_id != cand_id:
                out["flips"].append({"prompt": index, "step": step, "ref": ref_id, "cand": cand_id,
                                     "margin": float(top2[1] - top2[0]), "linf": linf})
            sequence.append(ref_id)
            if cache != "none":
                llm.eval([ref_id])
        out["rows"] += steps
    llm.reset()
    llm._ctx.kv_cache_clear()
    return out


def logit_bias_processor(bias: dict[int, float]) -> Any:
    """The ``LogitsProcessorList`` llama-cpp-python's ``_create_completion`` builds for ``logit_bias``.

    ``_init_sampler`` wraps it as a custom sampler at the head of the chain (llama.cpp's common
    chain also applies ``logit_bias`` first).  Source: llama-cpp-python ``llama.py``
    ``_create_completion`` (``logit_bias_processor``).
    """
    from llama_cpp import LogitsProcessorList

    def processor(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        new_scores = np.copy(scores)
        for token_id, value in bias.items():
            new_scores[token_id] = value + scores[token_id]
        return new_scores

    return LogitsProcessorList([processor])


def sampler_params(config: CaseConfig) -> dict[str, Any]:
    """``Llama._init_sampler`` keyword arguments for ``config``'s policy (neutral values for absent samplers).

    Raises:
        Rejection: ``adapter.unsupported`` for a transform llama-cpp-python's chain has no
            sampler for; ``policy.*`` for a policy the M3.8 schema refuses.
    """
    policy = policy_config_from_json(config.policy)
    if policy.family is Family.BEAM:
        raise unsupported("llama.cpp removed beam search (PR #7736)", "$.policy.family")
    if policy.empty_support is not EmptySupport.RAISE:
        raise unsupported("llama.cpp has no EOS fallback for an empty support", "$.policy.empty_support")
    params = dict(_NEUTRAL)
    for index, transform in enumerate(policy.transforms):
        path = f"$.policy.transforms[{index}]"
        if transform.name == "repetition_penalty" and transform.get("history") != "output":
            raise unsupported("llama-cpp-python's penalty window holds the accepted output tokens only (the prompt is never "
                              "accepted): use history 'output'", path)
        if transform.name in _SAMPLER_FIELDS:
            params[_SAMPLER_FIELDS[transform.name]] = main_value(transform)
        elif transform.name == "mirostat_v2":
            params.update(mirostat_mode=2, mirostat_tau=transform.get("tau"), mirostat_eta=transform.get("eta"))
        elif transform.name == "logit_bias":
            params["logits_processor"] = logit_bias_processor(dict(transform.get("bias")))
        elif transform.name == "min_new_tokens":
            raise unsupported("llama.cpp has no min_new_tokens", path)
        else:
            raise unsupported(f"llama-cpp-python's sampler chain has no {transform.name!r} sampler", path)
    if policy.family is Family.GREEDY:
        params["temp"] = 0.0  # _init_sampler: temp == 0 -> greedy
    return params


#: ``llama_token_attr`` bit of a control token (llama.h ``LLAMA_TOKEN_ATTR_CONTROL = 1 << 3``).
_ATTR_CONTROL = 1 << 3
#: llama.h ``LLAMA_TOKEN_NULL``: the vocabulary has no such special token.
_TOKEN_NULL = -1


def _piece(api: Any, vocab: Any, token: int, special: bool) -> bytes:
    """``llama_token_to_piece`` of one id: the bytes it stands for (``special``: a control token's own text)."""
    size = 64
    while True:
        buf = ctypes.create_string_buffer(size)
        n = int(api.llama_token_to_piece(vocab, token, buf, size, 0, special))
        if n >= 0:
            return buf.raw[:n]
        size = -n  # the piece needs -n bytes


def llamacpp_vocab_table(api: Any, vocab: Any, metadata: dict[str, str]) -> tuple[tuple[bytes, ...], dict[str, int | None], tuple[int, ...]]:
    """llama.cpp's ordered vocabulary table, read through its vocabulary API (M3.8 0x08).

    Args:
        api: The ``llama_cpp`` bindings module (a stand-in in the tests): ``llama_vocab_n_tokens``,
            ``llama_vocab_get_attr``, ``llama_token_to_piece``, ``llama_vocab_bos / eos / pad``.
        vocab: The model's ``llama_vocab`` pointer (``Llama._model.vocab``).
        metadata: The model's GGUF metadata as llama.cpp reports it (``Llama.metadata``): the
            unknown-token id (``tokenizer.ggml.unknown_token_id``) has no getter in llama.h.

    Returns:
        ``(tokens [V], specials, control ids)``: ``tokens[i]`` is the piece of id ``i``
        (``special=True`` for a control token, whose piece is then its own text); specials
        ``LLAMA_TOKEN_NULL`` become ``None``.

    Source: llama.cpp ``include/llama.h`` (``llama_vocab_n_tokens``, ``llama_vocab_get_attr``,
    ``llama_token_to_piece``, ``llama_vocab_bos``); llama-cpp-python ``llama_cpp.py``.
    """
    n = int(api.llama_vocab_n_tokens(vocab))
    control = tuple(i for i in range(n) if int(api.llama_vocab_get_attr(vocab, i)) & _ATTR_CONTROL)
    ctrl = set(control)
    tokens = tuple(_piece(api, vocab, i, i in ctrl) for i in range(n))

    def special(value: Any) -> int | None:
        return None if value is None or int(value) == _TOKEN_NULL else int(value)

    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    specials = {"bos": special(api.llama_vocab_bos(vocab)), "eos": special(api.llama_vocab_eos(vocab)),
                "pad": special(api.llama_vocab_pad(vocab)), "unk": None if unk is None else int(unk)}
    return tokens, specials, control


@functools.lru_cache(maxsize=1)
def _llamacpp_table() -> tuple[tuple[bytes, ...], dict[str, int | None], tuple[int, ...]]:
    import llama_cpp

    llm = llama()
    return llamacpp_vocab_table(llama_cpp, llm._model.vocab, dict(getattr(llm, "metadata", {}) or {}))


class LlamaCppEngine:
    """llama.cpp's loop, one contract call at a time (see the module docstring)."""

    name = "llamacpp"
    capabilities = LLAMACPP_CAPABILITIES

    def __init__(self):
        self.llm = None
        self.sampler = None
        self.config: CaseConfig | None = None

    # -- request -------------------------------------------------------------------------
    def vocab_table(self, config: CaseConfig) -> Any:
        """llama.cpp's ordered vocabulary table of the SmolLM2 file (:func:`llamacpp_vocab_table`); ``None`` for another model."""
        return _llamacpp_table() if config.model == "smollm2" else None

    def window_for(self, config: CaseConfig) -> int:
        """``n_ctx`` of the adapter's context.

        Raises:
            Rejection: ``adapter.unsupported`` for the tiny model (no GGUF file).
        """
        if config.model != "smollm2":
            raise unsupported("llama.cpp runs GGUF files; the tiny model has none", "$.model")
        return int(llama().n_ctx())

    def start(self, config: CaseConfig, *, context_cap: int, reuse: bool = False) -> None:
        """A new request on the shared context: ``Llama.reset()``, ``set_seed``, the sampler chain.

        Raises:
            Rejection: ``adapter.unsupported`` (see the module docstring).
        """
        if config.cache == "static":
            raise unsupported("llama.cpp allocates its KV cells once per context; it has no per-request static cache", "$.cache")
        if config.min_new_tokens:
            raise unsupported("llama.cpp has no min_new_tokens", "$.min_new_tokens")
        if not config.eos_ids:
            raise unsupported("llama-cpp-python always stops on the vocabulary's EOG tokens", "$.eos_ids")
        eos = int(llama().token_eos())
        if eos not in config.eos_ids:
            # The machines draw EOS sets of any ids (issue 15 item 4): llama-cpp-python still stops on the vocabulary's
            # EOG tokens (SmolLM2: 0, 2, 4), so a request whose EOS set leaves out the vocabulary's EOS id would end
            # `eos` where the spec runs on.  An EOS set that holds it but not 0 or 4 is run (the gate's cases).
            raise unsupported(f"llama-cpp-python always stops on the vocabulary's EOG tokens; the EOS set must hold its EOS "
                              f"id {eos}", "$.eos_ids")
        if config.dtype != "float32" or config.device != "cpu":
            raise unsupported("the llama.cpp adapter runs the Q4_1 file on the CPU (dtype float32 names the reference)", "$.dtype")
        params = sampler_params(config)
        llm = llama()
        llm.reset()
        if config.cache == "none" or not reuse:
            llm._ctx.kv_cache_clear()  # a fresh request: no retained rows
        llm.set_seed(config.seed if config.seed is not None else 0)
        if self.sampler is not None:
            self.sampler.close()
        self.sampler = llm._init_sampler(**params)
        self.llm, self.config, self.context_cap = llm, config, context_cap

    def processed(self) -> int:
        """llama.cpp's memory frontier ``llama_memory_seq_pos_max(mem, 0) + 1``."""
        import llama_cpp

        mem = llama_cpp.llama_get_memory(self.llm._ctx.ctx)
        return int(llama_cpp.llama_memory_seq_pos_max(mem, 0)) + 1

    def physical(self) -> int:
        """The context's KV cells (``n_ctx``)."""
        return int(self.llm.n_ctx())

    # -- calls ---------------------------------------------------------------------------
    def forward(self, sequence: list[int], start: int, length: int) -> np.ndarray:
        """``Llama.eval`` of the call's rows (the whole prefix after a memory clear without a cache).

        Shapes: returns ``float32[V]``.
        """
        llm = self.llm
        if self.config.cache == "none":
            llm.reset()
            llm._ctx.kv_cache_clear()
            llm.eval(sequence[:start + length])
            row = last_row(llm)
            llm.reset()
            llm._ctx.kv_cache_clear()
            return row
        llm.eval(sequence[start:start + length])  # at n_past = llama-cpp-python's n_tokens
        return last_row(llm)


    def prompt_logprobs(self, config: CaseConfig, spec: Any) -> list[Any]:
        """Prompt logprobs through llama.cpp's ``logits_all`` rows (M3.10 0x02): the prompt evaluated on a
        ``logits_all=True`` context (one ``Llama.eval`` per ``prefill_chunk`` rows, or one for the whole prompt), row
        ``i`` of ``Llama.scores`` log-softmaxed (float32) at ``x_{i+1}``; no row scores ``x_0``.

        llama-cpp-python's own echo API (``create_completion(echo=True, logprobs=k)``) is not used: it pairs token
        ``i`` with row ``i`` after dropping a leading BOS, so it reports ``x_1`` as ``None`` for a BOS-led prompt and
        every later token one row late otherwise (``checks/gate/expectations/llamacpp.toml`` ``[prompt_logprobs]``,
        abetlen/llama-cpp-python#1983; ``tests/test_adapters_llamacpp.py`` shows it).  First-token policy: the rows
        have no entry for ``x_0`` (``omitted``); under ``none`` the unscored first entry is added here.  Ranks and
        top-k follow the spec's order (:func:`decodespec.impl.prompt_logprobs.entries_from_logits`, a formatter).

        Raises:
            Rejection: ``adapter.unsupported`` for a prompt longer than :data:`N_CTX_ALL` or another model.
        """
        import torch

        from decodespec.impl.prompt_logprobs import entries_from_prompt_rows

        prompt = [int(t) for t in config.prompt_ids]
        L = len(prompt)
        if config.model != "smollm2":
            raise unsupported("llama.cpp runs GGUF files; the tiny model has none", "$.model")
        if L > N_CTX_ALL:
            raise unsupported(f"the prompt-logprob context holds {N_CTX_ALL} positions, the prompt has {L}", "$.prompt")
        llm = llama_all_rows()
        llm.reset()
        llm._ctx.kv_cache_clear()
        chunk = config.prefill_chunk if config.prefill_chunk and config.cache != "none" else L
        for start in range(0, L, chunk):
            llm.eval(prompt[start:start + chunk])
        logits = np.array(llm.scores[: L - 1], dtype=np.float32, copy=True)  # [L - 1, V]: row L - 1 scores the output
        return entries_from_prompt_rows(torch.from_numpy(logits), prompt, spec)

    def rollback(self, processed: int) -> None:
        """``llama_memory_seq_rm(mem, -1, processed, -1)``."""
        self.llm._ctx.kv_cache_seq_rm(-1, processed, -1)
        self.llm.n_tokens = processed

    def decide(self, row: np.ndarray, sequence: list[int], output_count: int) -> PeerDecision:
        """``llama_sampler_apply`` of the request's chain to ``row``: the kept candidates and the selected id."""
        import llama_cpp
        from llama_cpp import _internals

        data = _internals.LlamaTokenDataArray(n_vocab=len(row))
        data.copy_logits(np.asarray(row, dtype=np.float32))
        llama_cpp.llama_sampler_apply(self.sampler.sampler, ctypes.byref(data.candidates))
        size, selected = int(data.candidates.size), int(data.candidates.selected)
        kept = data.candidates_data[:size]
        ids = np.asarray(kept.id, dtype=np.int64)
        logits = np.asarray(kept.logit, dtype=np.float64)
        token = int(ids[selected])
        order = np.argsort(ids, kind="stable")
        ids, logits = ids[order], logits[order]
        finite = np.isfinite(logits)
        ids, logits = ids[finite], logits[finite]
        probs = np.exp(logits - logits.max())
        return PeerDecision(token, ids, (probs / probs.sum()).astype(np.float32), None)

    def accept(self, token_id: int) -> None:
        """``llama_sampler_accept``: the chain's penalty window and Mirostat state see the token."""
        self.sampler.accept(token_id)

    def triggers(self, sequence: list[int], output_count: int) -> set[FinishReason]:
        """llama-cpp-python's stop tests: EOG token, ``max_tokens``, the context."""
        import llama_cpp

        fired = bound_triggers(sequence, output_count, self.config.max_new_tokens, self.context_cap)
        if llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, sequence[-1]):
            fired.add(FinishReason.EOS)
        return fired

    def text(self, output_ids: list[int]) -> str | None:
        """``Llama.detokenize(ids).decode("utf-8", errors="ignore")`` (``_create_completion``'s decoding)."""
        return self.llm.detokenize(output_ids).decode("utf-8", errors="ignore")

    def cache_probe(self, processed: int) -> np.ndarray | None:
        """Not exposed (llama.cpp's K/V rows live in ggml buffers behind the state API)."""
        return None

    # -- snapshots -----------------------------------------------------------------------
    def save(self) -> Any:
        """``Llama.save_state()`` (no sampler chain in it)."""
        return self.llm.save_state()

    def load(self, blob: Any) -> None:
        """``Llama.load_state(state)`` into the request's fresh chain."""
        self.llm.load_state(blob)

    def corrupt(self, blob: Any, state: dict[str, Any], corruption: str) -> tuple[Any, dict[str, Any]]:
        """Corrupt the ``LlamaState`` field that stands for the record's field (llama-cpp-python checks none).

        ``processed_plus_one`` / ``repaired_with_pending``: ``n_tokens + 1`` (with one more zero
        score row, so that the ``LlamaState`` stays self-consistent -- ``load_state`` copies
        ``scores`` into ``n_tokens`` rows -- and only its claimed frontier disagrees with the
        memory bytes it carries); ``pending_dropped``: the pending id is removed from the caller's
        ids; ``rng_counter``: the state's ``seed`` + 1; ``identity``: the state has no identity
        (restored unchanged).
        """
        import copy

        blob = copy.copy(blob)
        if corruption in ("processed_plus_one", "repaired_with_pending"):
            blob.n_tokens += 1
            blob.scores = np.concatenate([blob.scores, np.zeros((1,) + blob.scores.shape[1:], dtype=blob.scores.dtype)])
        elif corruption == "pending_dropped" and state.get("pending_ids"):
            state = {**state, "output_ids": list(state["output_ids"])[:-1], "pending_ids": ()}
        elif corruption == "rng_counter":
            blob.seed += 1
        return blob, state
