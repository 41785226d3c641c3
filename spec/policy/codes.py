"""M3.8 0x0B policy error codes: every typed refusal the decoding policy can raise.

Each code is registered once in :data:`decodespec.spec.errors.ERROR_CODES`.  Configuration
errors carry the JSON path of the offending field (``$.policy.transforms[2].p``); decision
errors carry ``$`` or the path of the offending input (``$.row``, ``$.view.output_ids``).

Source: M3.8 0x0B "The decoding-policy pipeline" (typed score kinds, empty-support policy,
request-owned randomness), M3.8 0x04 "Dtype and degenerate-row policy" (NaN and all -inf
rows), M3.10 0x02 branch table (typed rejection changes nothing).
"""

from __future__ import annotations

from decodespec.spec.enums import FinishReason
from decodespec.spec.errors import register_code

__all__ = [
    "DUPLICATE_TRANSFORM",
    "EMPTY_SUPPORT",
    "FAMILY_MISMATCH",
    "INFINITE_SCORES",
    "INVALID_AUTOMATON",
    "INVALID_PARAMETER",
    "INVALID_ROW",
    "INVALID_STATE",
    "INVALID_TYPE",
    "INVALID_VIEW",
    "MISSING_FIELD",
    "NAN_SCORES",
    "SCORE_KIND_MISMATCH",
    "TERMINAL_DECISION_CODES",
    "TOKEN_OUT_OF_RANGE",
    "TOO_LARGE",
    "TRANSFORM_NOT_IN_PRESET",
    "UNKNOWN_FIELD",
    "UNKNOWN_TRANSFORM",
    "WARPER_REQUIRES_SAMPLING",
]

_S = "M3.8 0x0B The decoding-policy pipeline"

INVALID_TYPE = register_code("policy.invalid_type", "rejection", _S, "A policy field has the wrong JSON type (e.g. a string where an integer is required, or a boolean where a number is required).")
MISSING_FIELD = register_code("policy.missing_field", "rejection", _S, "A required policy field or transform parameter is absent.")
UNKNOWN_FIELD = register_code("policy.unknown_field", "rejection", _S, "A policy object or transform has a field outside its closed field set.")
INVALID_PARAMETER = register_code("policy.invalid_parameter", "rejection", _S, "A policy value is outside its declared range or enumeration (e.g. top_p p outside (0, 1], temperature < 0, num_beams > 1 outside the beam family).")
UNKNOWN_TRANSFORM = register_code("policy.unknown_transform", "rejection", _S, "A transform name is not in the policy catalog.")
DUPLICATE_TRANSFORM = register_code("policy.duplicate_transform", "rejection", _S, "A transform appears twice where the order preset or its state forbids it (presets place each transform once; stateful transforms own one state slot).")
TRANSFORM_NOT_IN_PRESET = register_code("policy.transform_not_in_preset", "rejection", _S, "The chosen order preset (hf, vllm, llama.cpp) has no place for this transform, so the peer's documented order cannot be reproduced.")
WARPER_REQUIRES_SAMPLING = register_code("policy.warper_requires_sampling", "rejection", _S, "A sampling warper (temperature or truncation) was configured for the greedy or beam family, where it would be ignored.")
INVALID_AUTOMATON = register_code("policy.invalid_automaton", "rejection", "M3.8 0x0E Hard constraints and finite-state policy", "A constraint automaton names an undeclared initial or target state.")
SCORE_KIND_MISMATCH = register_code("policy.score_kind_mismatch", "rejection", "M3.8 0x04 Logits, probabilities, and log-probabilities", "A transform, normalization or selector received a score kind it does not accept (e.g. multinomial on raw logits, softmax over probabilities, a logit warper over probabilities); no silent conversion is made.")
NAN_SCORES = register_code("policy.nan_scores", "rejection", "M3.8 0x04 Dtype and degenerate-row policy", "The score row contains NaN, or a transform produced NaN; the row is never sampled.")
INFINITE_SCORES = register_code("policy.infinite_scores", "rejection", "M3.8 0x04 Dtype and degenerate-row policy", "The score row contains +inf, or a transform overflowed to +inf (only -inf, meaning 'forbidden', is a legal non-finite score).")
INVALID_ROW = register_code("policy.invalid_row", "rejection", "M3.8 0x04 Logits, probabilities, and log-probabilities", "The score row is malformed: not one-dimensional, empty, or its values contradict its declared kind (probabilities outside [0, 1] or not summing to one, log-probabilities not normalized).")
EMPTY_SUPPORT = register_code("policy.empty_support", "rejection", "M3.8 0x0B Hard constraints define a conditional support", "No token has a finite score after the configured transforms, and no declared fallback applies (fallback_eos needs a legal EOS id); the raw row is never silently restored. At a request's decision this is the typed terminal finish constraint_error (M3.10 0x02 branch table), not a refused action.")
TOKEN_OUT_OF_RANGE = register_code("policy.token_out_of_range", "rejection", "M3.8 0x08 The vocabulary-axis identity contract", "A token id in the policy configuration or request view is outside [0, V) for the score row being decided.")
INVALID_VIEW = register_code("policy.invalid_view", "rejection", "M3.8 0x0B Policy state is typed and partly mutable", "The read-only request view is malformed (negative step, negative min_new_tokens, non-integer ids).")
INVALID_STATE = register_code("policy.invalid_state", "rejection", "M3.8 0x0B Policy state is typed and partly mutable", "The policy state does not belong to this configuration (unknown constraint state, missing Mirostat mu, negative RNG counter).")
TOO_LARGE = register_code("policy.too_large", "resource_limit", "M3.10 0x06 Bound parsers, matchers, traces, and sensitive data", "A policy table exceeds its declared size bound (decodespec.spec.limits: logit_bias entries, bad_words sequences or sequence length, automaton states or edges); refused before anything is built.")
FAMILY_MISMATCH = register_code("policy.family_mismatch", "rejection", _S, "A single-row decision was requested for the beam family, or beam candidates for a non-beam family.")

#: Decision refusals that finish the request rather than refuse the action: code -> finish reason.
#: M3.10 0x02 branch table: "constraint/parser error -- typed terminal error with no unsupported next
#: call"; M3.8 "Hard constraints define a conditional support" (raise; never restore the raw row).
#: The spec steps ``SupportEmpty`` (``transition.decide_empty_support``); a runtime finishes with the
#: reason, keeping every committed token.
TERMINAL_DECISION_CODES: dict[str, FinishReason] = {EMPTY_SUPPORT: FinishReason.CONSTRAINT_ERROR}
