"""The HF transformers adapter: ``LlamaForCausalLM`` driven the way ``GenerationMixin`` drives it.

Two paths over the same HF model:

* **Step-wise** (:class:`HFEngine` behind :class:`~decodespec.checks.adapters.peer.PeerAdapter`,
  what ``pytest checks/ --runtime hf`` drives): each contract call is one HF forward prepared by
  HF's own ``prepare_inputs_for_generation`` (the growing ``input_ids`` and all-ones
  ``attention_mask`` as ``_sample`` keeps them; ``next_sequence_length`` = the call's rows with a
  cache, the whole prefix without one, ``logits_to_keep=1``); the cache is HF's own
  ``DynamicCache`` / ``StaticCache(max_cache_len=S)`` (``cache = None`` and ``use_cache=False``
  for the no-cache family), so positions come from HF's ``cache.get_seq_length()`` and P is that
  same count; the decision row is ``logits[:, -1]`` in float32; the decision applies the
  ``LogitsProcessorList`` that ``GenerationMixin._get_logits_processor`` builds for the case's
  policy (HF's fixed processor order, ``generation/utils.py:1416-1663``), then ``argmax``
  (greedy) or ``torch.multinomial(softmax(scores), 1)`` (sampling: HF's **global** torch RNG,
  seeded once per request with ``torch.manual_seed(seed)`` as HF's examples do -- no
  per-request, replayable stream, so the decision's draw count is not exposed); the finish
  triggers come from HF's own ``_get_stopping_criteria`` list (``MaxLengthCriteria``,
  ``StopStringCriteria``, ``EosTokenCriteria``), each criterion mapped to the reason it stands
  for; a cancelled call's rows are dropped with HF's ``Cache.crop(-n)`` (the v5 negative form);
  text is the HF tokenizer's ``decode`` (SmolLM2; the tiny model has no HF tokenizer).
* **Sequence-level** (:func:`generate_sequence`): one ``model.generate(...)`` call (greedy,
  sampling, ``num_beams``) with ``output_logits=True``, for SEQUENCE comparisons and for the
  evidence that the step-wise path is HF's own loop.

Models: SmolLM2 from the same GGUF file (``from_pretrained(dir, gguf_file=...)``, dequantized to
float32); the tiny model is HF ``LlamaForCausalLM`` with our tiny architecture and our seed-0
weights copied in (:func:`hf_tiny`).

Capabilities: no-cache / dynamic / static caches, chunked prefill (HF's ``_prefill`` chunk loop
body), separate decide / commit, launch / complete (the forward runs at ``complete``), sampling,
raw logits, processed rows, committed K/V rows (HF's cache tensors, keys after RoPE), static-cache
reuse (HF's ``Cache.reset()``), snapshots (a deep copy of HF's cache: HF resumes from
``past_key_values``; there is no RNG or processor state to save) and stop strings (SmolLM2).
A finite-state constraint becomes HF's ``prefix_allowed_tokens_fn`` (:func:`constraint_fn`); HF's
"unsatisfiable constraint" error is the spec's ``policy.empty_support``.
HF cannot honour: transforms it has no processor for (frequency / presence penalty, top-n-sigma,
Mirostat), vLLM's output-only history, a single-token bad word that is an EOS id
(``NoBadWordsLogitsProcessor.__init__`` drops it, logits_process.py:1500), ``empty_support =
fallback_eos``, temperature 0 in the sampling family (``TemperatureLogitsWarper`` raises),
``max_new_tokens = 0`` (``GenerationConfig.validate`` raises), beams in the step-wise path,
structured completion, stop strings on the tiny model (no HF tokenizer); those are refused with
``adapter.unsupported`` at reset.  A streamed request runs with its chunks not exposed (HF's
``TextStreamer`` has no offsets to report).

Source: transformers 5.24.0 ``generation/utils.py`` (``_sample`` 3123-3300, ``_prefill``
4283-4420, ``prepare_inputs_for_generation`` 667-800, ``_get_logits_processor`` 1416-1663,
``_get_stopping_criteria`` 1665-1700), ``cache_utils.py`` (``DynamicLayer.crop`` 164,
``StaticLayer`` 403-520), ``generation/stopping_criteria.py``; M3.10 "Pinned official runtime
reconciliation" (Transformers generation row).

Size: one peer: HF transformers driven the way GenerationMixin drives it -- caches, attention,
policy mapping, prompt logprobs and its capabilities -- kept beside each other because each mirrors
a GenerationMixin path.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np

from decodespec.impl.runtime import INVALID_REQUEST  # the registered code (runtime.invalid_request)
from decodespec.spec.enums import FinishReason
from decodespec.spec.errors import Rejection
from decodespec.spec.policy.codes import EMPTY_SUPPORT
from decodespec.spec.policy.config import EmptySupport, Family, policy_config_from_json
from decodespec.spec.request import static_capacity

from . import CaseConfig
from .features import envelope_features, names_at, transform_capability
from .peer import PeerAdapter, PeerDecision, bound_triggers, main_value, unsupported

__all__ = [
    "HF_CAPABILITIES",
    "HFEngine",
    "HFTokenizerView",
    "adopt_model",
    "available",
    "batch_generate",
    "constraint_fn",
    "create",
    "generate_sequence",
    "generation_config",
    "hf_model",
    "hf_table_of",
    "hf_tiny",
    "hf_tokenizer",
    "hf_vocab_table",
]

#: What the step-wise HF adapter declares.
#: Policy transform -> the ``GenerationConfig`` field HF builds its processor from (its one parameter).
_HF_FIELDS = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical": "typical_p",
    "epsilon": "epsilon_cutoff", "eta": "eta_cutoff", "repetition_penalty": "repetition_penalty", "no_repeat_ngram": "no_repeat_ngram_size",
}
#: Transforms :func:`generation_config` maps otherwise (bad words, a sequence bias, min_new_tokens, the constraint function).
_HF_OTHER_TRANSFORMS = ("bad_words", "logit_bias", "min_new_tokens", "constraint")
HF_CAPABILITIES = frozenset({
    "cache:none", "cache:dynamic", "cache:static", "prefill_chunk", "decide_commit", "inflight", "sampling", "logits",
    "policy_rows", "cache_probe", "reuse", "snapshot", "stop_strings", "output.prompt_logprobs",
}) | envelope_features() | names_at("policy.order") | {transform_capability(n) for n in (*_HF_FIELDS, *_HF_OTHER_TRANSFORMS)}
"""The ops and probes the step-wise adapter has, every envelope feature the gate sends (HF refuses what it cannot keep at
reset: a skip), the policy orders, and the transforms :func:`generation_config` maps to HF processors."""
_DTYPES = ("float32", "bfloat16", "float16")


def available() -> str | None:
    """``None`` when HF transformers (with accelerate, for GGUF loading) is importable, else the skip reason."""
    from decodespec.checks.testing import HF_SKIP_REASON, hf_available

    return None if hf_available() else HF_SKIP_REASON


def create(**options: Any) -> PeerAdapter:
    """The step-wise HF adapter (``options`` are ignored: the case config names model, dtype, device).

    HF's procedures for the table's custom cases (padded batches, beam width one) are in
    :data:`decodespec.checks.gate.procedures.CUSTOM`.
    """
    return PeerAdapter(HFEngine(), "hf")


#: HF models loaded (or adopted) in this process: ``(name, dtype, device, attention) -> model``.
_LOADED: dict[tuple[str, str, str, str], Any] = {}


def adopt_model(model: Any, name: str, dtype: str = "float32", device: str = "cpu", attention: str = "sdpa") -> None:
    """Use an HF model this process already loaded (e.g. a test session's) instead of loading another copy."""
    _LOADED[(name, dtype, device, attention)] = model


def hf_model(name: str, dtype: str = "float32", device: str = "cpu", attention: str = "sdpa"):
    """The shared HF ``LlamaForCausalLM`` of model ``name`` (loaded once per process, eval mode).

    Raises:
        Rejection: ``model.file_missing`` when SmolLM2 is not installed.
    """
    key = (name, dtype, device, attention)
    if key not in _LOADED:
        _LOADED[key] = _load_model(*key)
    return _LOADED[key]


def _load_model(name: str, dtype: str, device: str, attention: str):
    import torch

    if name == "tiny":
        model = hf_tiny(attention)
    else:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from decodespec.impl.gguf import smollm2_path

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        path = smollm2_path()
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     attn_implementation=attention)
    return model.to(device=device, dtype=getattr(torch, dtype)).eval()


def hf_tiny(attention: str = "sdpa"):
    """HF ``LlamaForCausalLM`` with our tiny architecture and the seed-0 weights of :func:`decodespec.impl.tiny.load_tiny`.

    Source: impl/tiny.py (architecture and initialisation); the state-dict names are HF's.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from decodespec.impl.tiny import load_tiny

    ours = load_tiny(seed=0, device="cpu")
    c = ours.config
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                         rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                         tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
                         pad_token_id=c.pad_token_id, attn_implementation=attention)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(ours.state_dict(), strict=False)
    # A tied head is not a separate tensor in our state dict.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    with torch.no_grad():
        assert torch.equal(model.lm_head.weight, ours.model.embed_tokens.weight)
    return model.eval()


@functools.lru_cache(maxsize=2)
def hf_tokenizer(name: str):
    """HF's tokenizer of model ``name`` (SmolLM2 from the same GGUF file), or ``None`` for the tiny model."""
    if name == "tiny":
        return None
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from decodespec.impl.gguf import smollm2_path

    hf_logging.set_verbosity_error()
    path = smollm2_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def generation_config(config: CaseConfig, *, max_length: int | None = None):
    """The ``GenerationConfig`` a user sets for ``config``'s request (HF field per policy transform).

    Args:
        config: The case.
        max_length: HF's ``max_length`` (L + G, or the context cap when it is smaller).

    Raises:
        Rejection: ``adapter.unsupported`` for a policy HF has no processor or option for;
            ``policy.*`` for a policy the M3.8 schema refuses.
    """
    from transformers import GenerationConfig

    policy = policy_config_from_json(config.policy)
    if policy.family is Family.BEAM:
        raise unsupported("beams run through generate_sequence(num_beams=...), not the step-wise adapter", "$.policy.family")
    if policy.empty_support is not EmptySupport.RAISE:
        raise unsupported("HF has no EOS fallback for an empty support", "$.policy.empty_support")
    fields: dict[str, Any] = {"do_sample": policy.family is Family.MULTINOMIAL, "num_beams": 1, "num_return_sequences": 1,
                              "top_k": None, "top_p": None,
                              "temperature": None}
    for index, transform in enumerate(policy.transforms):
        path = f"$.policy.transforms[{index}]"
        name = transform.name
        if any(key == "history" and value != "prompt_and_output" for key, value in transform.params):
            raise unsupported(f"HF's {name} reads the prompt and the output; it has no output-only history", path)
        if name in _HF_FIELDS:
            fields[_HF_FIELDS[name]] = main_value(transform)
        elif name == "bad_words":
            fields["bad_words_ids"] = [list(seq) for seq in transform.get("sequences")]
            dropped = sorted({seq[0] for seq in fields["bad_words_ids"] if len(seq) == 1 and seq[0] in config.eos_ids})
            if dropped:  # NoBadWordsLogitsProcessor.__init__ filters out every single-token bad word that is an EOS id
                raise unsupported(f"HF drops a single-token bad word that is an EOS id ({len(dropped)} of them): "
                                  "it cannot ban EOS through bad_words_ids", path)
        elif name == "logit_bias":
            fields["sequence_bias"] = {(token,): bias for token, bias in transform.get("bias")}
        elif name == "min_new_tokens":
            fields["min_new_tokens"] = config.min_new_tokens or None
        elif name == "constraint":
            pass  # not a GenerationConfig field: HF takes it as generate(prefix_allowed_tokens_fn=...), see constraint_fn
        else:
            raise unsupported(f"HF has no logits processor for the {name!r} transform", path)
    if config.min_new_tokens:
        fields["min_new_tokens"] = config.min_new_tokens
    if fields["do_sample"] and fields["temperature"] == 0.0:
        raise unsupported("HF refuses temperature 0 when sampling (TemperatureLogitsWarper needs T > 0); "
                          "the spec takes the greedy branch", "$.policy.transforms")
    eos = list(config.eos_ids)
    try:
        return GenerationConfig(max_new_tokens=config.max_new_tokens, max_length=max_length, eos_token_id=eos or None,
                                pad_token_id=eos[0] if eos else 0, stop_strings=list(config.stop_strings) or None, **fields)
    except ValueError as exc:  # GenerationConfig.validate(): e.g. max_new_tokens = 0
        raise unsupported(f"HF refuses the generation config: {exc}", "$") from None


def constraint_fn(config: CaseConfig):
    """HF's ``prefix_allowed_tokens_fn`` for the policy's constraint automaton, or ``None`` without one.

    The automaton reads the output ids (the ids after the L prompt ids of HF's ``input_ids``) from
    its initial state; the allowed ids are the transitions of the state reached (none past an
    id without a transition).  HF builds ``PrefixConstrainedLogitsProcessor`` from it.

    Source: transformers 5.24.0 ``generation/logits_process.py`` ``PrefixConstrainedLogitsProcessor``.
    """
    constraint = policy_config_from_json(config.policy).find("constraint")
    if constraint is None:
        return None
    automaton = constraint.get("automaton")
    edges = {state: dict(pairs) for state, pairs in automaton.transitions}
    prompt_len = config.prompt_len

    def allowed(batch_id: int, input_ids: Any) -> list[int]:
        state: str | None = automaton.initial
        for token in input_ids[prompt_len:].tolist():
            state = edges.get(state, {}).get(int(token))
            if state is None:
                return []
        return sorted(edges.get(state, {}))

    return allowed


def hf_table_of(tok: Any) -> tuple[tuple[bytes, ...], dict[str, int | None], tuple[int, ...]]:
    """The ordered vocabulary table of an HF tokenizer object (HF's own, or the one vLLM serves with).

    ``tokens[i]``: the bytes id ``i`` stands for -- ``convert_ids_to_tokens`` spellings decoded with
    HF's byte-level map (``transformers.convert_slow_tokenizer.bytes_to_unicode``), a special
    added token's own text (``added_tokens_decoder[i].special``); specials are the tokenizer's
    ``bos/eos/pad/unk_token_id``.  Hashed by :func:`~decodespec.checks.adapters.peer.peer_vocab_hash`.

    Source: transformers 5.24.0 ``tokenization_utils_base.py`` (``convert_ids_to_tokens``,
    ``added_tokens_decoder``), ``convert_slow_tokenizer.py`` (``bytes_to_unicode``); M3.8 0x08.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = {c: b for b, c in bytes_to_unicode().items()}
    control = tuple(sorted(int(i) for i, t in tok.added_tokens_decoder.items() if t.special))
    ctrl = set(control)
    spellings = tok.convert_ids_to_tokens(list(range(len(tok))))
    tokens = tuple(s.encode("utf-8") if i in ctrl or not set(s) <= decoder.keys() else bytes(decoder[c] for c in s)
                   for i, s in enumerate(spellings))
    specials = {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id, "unk": tok.unk_token_id}
    return tokens, specials, control


@functools.lru_cache(maxsize=2)
def hf_vocab_table(name: str) -> tuple[tuple[bytes, ...], dict[str, int | None], tuple[int, ...]] | None:
    """HF's ordered vocabulary table of model ``name`` from its own tokenizer (:func:`hf_table_of`), or ``None`` (the tiny model has no HF tokenizer)."""
    tok = hf_tokenizer(name)
    return None if tok is None else hf_table_of(tok)


class HFTokenizerView:
    """HF's tokenizer seen through the calls :func:`decodespec.checks.gate.vocab_check.audit_added_tokens` makes of one of ours.

    ``vocab_size`` is ``len(tok)`` (base table plus added tokens); ``special_ids`` the ids HF's
    ``added_tokens_decoder`` marks ``special``; ``id_to_token`` the added token's ``content``
    (``convert_ids_to_tokens`` for a base id); ``encode`` without HF's own BOS/EOS
    (``add_special_tokens=False``); ``decode`` keeps special tokens.

    Source: transformers 5.24.0 ``tokenization_utils_base.py`` (``added_tokens_decoder``,
    ``encode``, ``decode``); M3.8 0x08 ("added token rows exist").
    """

    def __init__(self, tok: Any):
        self.tok = tok
        self.added = {int(i): t for i, t in tok.added_tokens_decoder.items()}
        self.vocab_size = len(tok)
        self.special_ids = frozenset(i for i, t in self.added.items() if t.special)

    def id_to_token(self, token_id: int) -> str:
        """The added token's content, or the base spelling."""
        hit = self.added.get(int(token_id))
        return str(hit.content) if hit is not None else str(self.tok.convert_ids_to_tokens(int(token_id)))

    def encode(self, text: str) -> list[int]:
        """``tok.encode(text, add_special_tokens=False)``."""
        return [int(i) for i in self.tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """``tok.decode(ids, skip_special_tokens=...)``."""
        return str(self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


class HFEngine:
    """HF's generation loop, one contract call at a time (see the module docstring)."""

    name = "hf"
    capabilities = HF_CAPABILITIES

    def __init__(self):
        self.model = None
        self.cache = None
        self.config: CaseConfig | None = None

    # -- request -------------------------------------------------------------------------
    def start(self, config: CaseConfig, *, context_cap: int, reuse: bool = False) -> None:
        """Build the request: model, cache, processors (``_get_logits_processor``), criteria (``_get_stopping_criteria``).

        Raises:
            Rejection: ``adapter.unsupported`` (see the module docstring).
        """
        import torch
        from transformers import StoppingCriteriaList

        if config.dtype not in _DTYPES:
            raise unsupported(f"dtype {config.dtype!r}", "$.dtype")
        if config.stop_strings and config.model == "tiny":
            raise unsupported("the tiny model has no HF tokenizer, so HF cannot match stop strings", "$.stop_strings")
        model = hf_model(config.model, config.dtype, config.device, config.attention)
        vocab = int(model.config.vocab_size)
        outside = next((i for i, t in enumerate(config.prompt_ids) if not 0 <= t < vocab), None)
        if outside is not None:  # HF's embedding would raise IndexError: the typed refusal every runtime gives
            raise Rejection(INVALID_REQUEST, f"prompt_ids[{outside}] = {config.prompt_ids[outside]} is not an id in [0, {vocab})",
                            f"$.prompt_ids[{outside}]")
        L, G = config.prompt_len, config.max_new_tokens
        gen = generation_config(config, max_length=min(L + G, context_cap))
        tokenizer = hf_tokenizer(config.model) if config.stop_strings else None  # StopStringCriteria needs it now
        device = model.device
        model._prepare_special_tokens(gen, True, device=device)
        ones = torch.ones((1, L), dtype=torch.long, device=device)
        processors = model._get_logits_processor(gen, input_ids_seq_length=L, device=device, model_kwargs={"attention_mask": ones},
                                                  prefix_allowed_tokens_fn=constraint_fn(config))
        criteria = model._get_stopping_criteria(gen, StoppingCriteriaList(), tokenizer)
        if config.cache == "static":
            capacity = static_capacity("static", config.static_capacity, L, G, int(model.config.max_position_embeddings))
        reused = self.cache if reuse else None
        if config.cache == "none":
            cache = None
        elif reused is not None and type(reused).__name__ == {"dynamic": "DynamicCache", "static": "StaticCache"}[config.cache]:
            reused.reset()  # HF's API for giving a cache object to a new request
            cache = reused
        elif config.cache == "dynamic":
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
        else:
            from transformers import StaticCache

            cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.model, self.config, self.generation, self.processors, self.criteria = model, config, gen, processors, criteria
        self.cache, self.context_cap = cache, context_cap
        if config.seed is not None and gen.do_sample:
            torch.manual_seed(config.seed)  # HF's convention: the global RNG (transformers.set_seed)

    def vocab_table(self, config: CaseConfig) -> Any:
        """HF's ordered vocabulary table for ``config.model`` (:func:`hf_vocab_table`), or ``None``."""
        return hf_vocab_table(config.model)

    def window_for(self, config: CaseConfig) -> int:
        """``max_position_embeddings`` of the case's model (loads it)."""
        return int(hf_model(config.model, config.dtype, config.device, config.attention).config.max_position_embeddings)

    def processed(self) -> int:
        """HF's ``cache.get_seq_length()`` (a tensor for static layers)."""
        return int(self.cache.get_seq_length()) if self.cache is not None else 0

    def physical(self) -> int:
        """Allocated slots (static: ``max_cache_len``) or written rows (dynamic)."""
        if self.cache is None:
            return 0
        layer = self.cache.layers[0]
        if hasattr(layer, "max_cache_len"):
            return int(layer.max_cache_len)
        return int(layer.keys.shape[-2]) if getattr(layer, "is_initialized", False) and layer.keys is not None else 0

    # -- calls ---------------------------------------------------------------------------
    def forward(self, sequence: list[int], start: int, length: int, *, every_row: bool = False) -> np.ndarray:
        """One HF forward prepared by ``prepare_inputs_for_generation`` (see the module docstring).

        ``every_row``: ``logits_to_keep=0`` (HF keeps every row of the call) instead of 1.

        Shapes: returns ``float32[V]`` (``float32[T, V]`` with ``every_row``; T = ``length``, or P + T without a cache).
        """
        import torch

        model = self.model
        end = start + length
        ids = torch.tensor([sequence[:end]], dtype=torch.long, device=model.device)  # [1, P + T]: HF's growing input_ids
        mask = torch.ones_like(ids)  # [1, P + T]
        use_cache = self.cache is not None
        kwargs: dict[str, Any] = {"attention_mask": mask, "use_cache": use_cache, "logits_to_keep": 0 if every_row else 1}
        if use_cache:
            kwargs["cache"] = self.cache
        inputs = model.prepare_inputs_for_generation(ids, next_sequence_length=length if use_cache else None,
                                                     is_first_iteration=start == 0, **kwargs)
        with torch.no_grad():  # generate() is @torch.no_grad(); an inference-mode cache could not be reset later
            out = model(**inputs, return_dict=True)
        if use_cache:
            self.cache = out.cache
        if every_row:
            return out.logits[0].to(dtype=torch.float32).cpu().numpy()  # [T, V]
        return out.logits[0, -1].to(dtype=torch.float32).cpu().numpy()  # `_sample`: logits[:, -1] in float32

    def prompt_logprobs(self, config: CaseConfig, spec: Any) -> list[Any]:
        """Prompt logprobs through HF's logits (M3.10 0x02): the started request's prefill (one shot, or HF's ``_prefill``
        chunks of ``prefill_chunk`` rows) with every row kept, row ``i`` log-softmaxed (float32) at ``x_{i+1}``.

        HF has no prompt-logprob API; the usual recipe (``logits[:, :-1]`` scored at ``input_ids[:, 1:]``) has no entry
        for ``x_0`` (first-token policy ``omitted``, ``checks/gate/expectations/hf.toml`` ``[prompt_logprobs]``); under
        ``none`` the unscored first entry is added here.  Ranks and top-k follow the spec's order
        (:func:`decodespec.impl.prompt_logprobs.entries_from_logits`, a formatter of HF's rows).
        """
        import torch

        from decodespec.impl.prompt_logprobs import entries_from_prompt_rows

        prompt = list(config.prompt_ids)
        L = len(prompt)
        chunk = config.prefill_chunk if config.prefill_chunk is not None and self.cache is not None else L
        rows = [self.forward(prompt, s, min(chunk, L - s), every_row=True) for s in range(0, L, chunk)]
        logits = np.concatenate(rows)[: L - 1]  # [L - 1, V]: row L - 1 scores the first output
        return entries_from_prompt_rows(torch.from_numpy(logits), prompt, spec)

    def rollback(self, processed: int) -> None:
        """HF's ``Cache.crop(-n)`` back to ``processed`` rows."""
        extra = self.processed() - processed
        if extra > 0:
            self.cache.crop(-extra)

    def decide(self, row: np.ndarray, sequence: list[int], output_count: int) -> PeerDecision:
        """HF's processors on ``row``, then ``argmax`` or ``torch.multinomial`` (global RNG)."""
        import torch

        device = self.model.device
        ids = torch.tensor([sequence], dtype=torch.long, device=device)  # [1, L + O]
        logits = torch.tensor(row, dtype=torch.float32, device=device)[None]  # [1, V]
        with torch.no_grad():
            try:
                scores = self.processors(ids, logits)  # [1, V]
            except ValueError as exc:
                if "empty list" not in str(exc):
                    raise
                # PrefixConstrainedLogitsProcessor: "the constraint is unsatisfiable" (nothing selected).
                raise Rejection(EMPTY_SUPPORT, f"HF: {exc}", "$.policy") from None
            probs = torch.nn.functional.softmax(scores, dim=-1)  # [1, V]
            if self.generation.do_sample:
                token = int(torch.multinomial(probs, num_samples=1)[0, 0])
            else:
                token = int(torch.argmax(scores, dim=-1)[0])
        support = torch.isfinite(scores[0]).nonzero().squeeze(-1)
        return PeerDecision(token, support.cpu().numpy(), probs[0, support].float().cpu().numpy(), None)

    def accept(self, token_id: int) -> None:
        """HF keeps no per-request processor state (its processors recompute from ``input_ids``)."""

    def triggers(self, sequence: list[int], output_count: int) -> set[FinishReason]:
        """The criteria of ``_get_stopping_criteria`` that fire on HF's ``input_ids``, each mapped to its reason."""
        import torch
        from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StopStringCriteria

        ids = torch.tensor([sequence], dtype=torch.long, device=self.model.device)
        fired: set[FinishReason] = set()
        for criterion in self.criteria:
            if not bool(criterion(ids, None)[0]):
                continue
            if isinstance(criterion, EosTokenCriteria):
                fired.add(FinishReason.EOS)
            elif isinstance(criterion, StopStringCriteria):
                fired.add(FinishReason.STOP_STRING)
            elif isinstance(criterion, MaxLengthCriteria):
                # One HF bound, max_length = min(L + G, C): say which declared bound it stands for.
                fired |= bound_triggers(sequence, output_count, self.config.max_new_tokens, self.context_cap)
        return fired

    def text(self, output_ids: list[int]) -> str | None:
        """``tokenizer.decode(output_ids)`` (HF returns what it generated; a stop string stays in)."""
        tokenizer = hf_tokenizer(self.config.model)  # loaded on first use (the GGUF vocabulary conversion is slow)
        return None if tokenizer is None else tokenizer.decode(output_ids)

    def cache_probe(self, processed: int) -> np.ndarray | None:
        """HF's cached K (after RoPE) and V rows ``[layers, 2, H_kv, P, D]`` (float32)."""
        import torch

        if self.cache is None:
            return None
        rows = []
        for layer in self.cache.layers:
            if layer.keys is None:
                return None
            rows.append(torch.stack((layer.keys[0, :, :processed], layer.values[0, :, :processed])))
        return torch.stack(rows).to(torch.float32).cpu().numpy()

    # -- snapshots -----------------------------------------------------------------------
    def save(self) -> Any:
        """A deep copy of HF's cache (what ``generate`` continues from as ``past_key_values``)."""
        return copy.deepcopy(self.cache)

    def load(self, blob: Any) -> None:
        """Continue from a copy of the saved cache."""
        self.cache = copy.deepcopy(blob)

    def corrupt(self, blob: Any, state: dict[str, Any], corruption: str) -> tuple[Any, dict[str, Any]]:
        """HF's snapshot is a cache object and the caller's ``input_ids``: corrupt the counterpart when one exists.

        ``pending_dropped``: the pending token is removed from the caller's ids (the cache is
        kept); ``processed_plus_one`` / ``repaired_with_pending``: the cache is given one more
        row (a copy of its last row, as a relabelled slot); ``identity`` and ``rng_counter``:
        HF's snapshot has no such field, so the copy is restored unchanged.  HF validates none
        of these on continue.
        """
        import torch

        blob = copy.deepcopy(blob)
        if corruption == "pending_dropped" and state.get("pending_ids"):
            state = {**state, "output_ids": list(state["output_ids"])[:-1], "pending_ids": ()}
        elif corruption in ("processed_plus_one", "repaired_with_pending") and blob is not None:
            for layer in blob.layers:
                if not getattr(layer, "is_initialized", False):
                    continue  # nothing written yet: no row to relabel
                if hasattr(layer, "max_cache_len"):
                    layer.cumulative_length.add_(1)
                else:
                    layer.keys = torch.cat([layer.keys, layer.keys[:, :, -1:]], dim=-2)
                    layer.values = torch.cat([layer.values, layer.values[:, :, -1:]], dim=-2)
        return blob, state


def generate_sequence(config: CaseConfig, *, num_beams: int = 1, length_penalty: float = 1.0,
                      early_stopping: bool | str = False, text: bool = True) -> dict[str, Any]:
    """One ``model.generate(...)`` call for ``config`` (the SEQUENCE-level path).

    Args:
        config: The case (greedy or multinomial policy; cache ``none`` / ``dynamic`` / ``static``).
        num_beams: ``generate(num_beams=...)`` (with ``num_return_sequences=num_beams``).
        length_penalty / early_stopping: HF's beam parameters.
        text: Decode the first sequence with HF's tokenizer (``text`` is ``None`` otherwise).

    Returns:
        ``{"output_ids": [[...], ...], "logits": float32[steps, V] (first sequence), "scores":
        sequences_scores or None, "beam_indices": [[...]] or None, "text": str | None}``; each
        output row is cut after the generated tokens (HF's fill value removed for beams).

    Raises:
        Rejection: ``adapter.unsupported`` as :func:`generation_config`.
    """
    import torch

    model = hf_model(config.model, config.dtype, config.device, config.attention)
    gen = generation_config(config)
    gen.num_beams = num_beams
    if num_beams > 1:
        gen.num_return_sequences = num_beams
        gen.length_penalty = length_penalty
        gen.early_stopping = early_stopping
    gen.cache_implementation = {"static": "static", "dynamic": "dynamic", "none": None}[config.cache]
    gen.use_cache = config.cache != "none"
    gen.return_dict_in_generate, gen.output_logits, gen.output_scores = True, True, num_beams > 1
    ids = torch.tensor([list(config.prompt_ids)], dtype=torch.long, device=model.device)
    if config.seed is not None and gen.do_sample:
        torch.manual_seed(config.seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                             tokenizer=hf_tokenizer(config.model) if config.stop_strings else None,
                             prefix_allowed_tokens_fn=constraint_fn(config))
    L = config.prompt_len
    rows = []
    fill = gen.pad_token_id
    for row in out.sequences.tolist():
        new = row[L:]
        if num_beams > 1:
            while new and new[-1] == fill and (len(new) < 2 or new[-2] == fill or new[-1] not in config.eos_ids):
                new.pop()
        rows.append(new)
    logits = torch.stack([step[0] for step in out.logits]).float().cpu().numpy() if out.logits else np.zeros((0, 0), np.float32)
    tok = hf_tokenizer(config.model) if text else None
    first = rows[0]
    text_ids = first[:-1] if first and first[-1] in config.eos_ids else first
    return {
        "output_ids": rows,
        "logits": logits,
        "scores": None if getattr(out, "sequences_scores", None) is None else out.sequences_scores.tolist(),
        "beam_indices": None if getattr(out, "beam_indices", None) is None else out.beam_indices.tolist(),
        "text": None if tok is None else tok.decode(text_ids),
    }



# --------------------------------------------------------------------------------------------
# HF's batched and width-one generate paths (the custom cases' procedures: checks/gate/procedures.py).
# --------------------------------------------------------------------------------------------


def batch_generate(config: CaseConfig, prompts: list[tuple[int, ...]], padding_side: str) -> list[tuple[list[int], np.ndarray]]:
    """One batched greedy ``model.generate`` over padded ``prompts``: per row its generated ids (through the first EOS) and rows.

    Pads are the model's ``pad_token_id`` (masked out by ``attention_mask``); HF computes the
    positions of a left-padded row from its mask.

    Shapes: each row's logits ``float32[steps, V]``.
    """
    import torch

    model = hf_model(config.model, config.dtype, config.device, config.attention)
    width = max(len(p) for p in prompts)
    pad = int(model.config.pad_token_id or 0)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, L_max]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, L_max]
    for b, prompt in enumerate(prompts):
        cols = slice(width - len(prompt), width) if padding_side == "left" else slice(0, len(prompt))
        ids[b, cols] = torch.tensor(prompt)
        mask[b, cols] = 1
    gen = generation_config(config)
    gen.return_dict_in_generate, gen.output_logits = True, True
    with torch.no_grad():
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), generation_config=gen,
                             prefix_allowed_tokens_fn=constraint_fn(config))
    logits = torch.stack(out.logits, dim=1).float().cpu().numpy()  # [B, steps, V]
    rows = []
    for b in range(len(prompts)):
        new = out.sequences[b, width:].tolist()
        end = next((i + 1 for i, t in enumerate(new) if t in config.eos_ids), len(new))
        rows.append((new[:end], logits[b, :end]))
    return rows
