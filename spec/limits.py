"""Declared resource bounds shared by the envelope, the policy and the runtime's admission.

Every bound here is a named constant checked before any work starts; a value past one is
refused with a typed error (a ``ResourceLimit`` with a registered code, a JSON path and the
``limit`` / ``actual`` details), never by running out of time or memory later.  The envelope's
own byte, depth and count bounds live in :mod:`decodespec.spec.envelope`; the stop matcher's in
:mod:`decodespec.spec.stop`; these are the ones more than one module reads.

* :data:`MAX_SAFE_INT`: the I-JSON integer domain (RFC 7493, RFC 8785): every integer literal
  in an envelope, and every integer in a policy, lies in ``[-MAX_SAFE_INT, MAX_SAFE_INT]``, so
  canonical bytes are exact and every number converts to a float without overflow.
* :data:`MAX_TOKEN_KEY_DIGITS`: a token-id key (``logit_bias``, automaton edges) is a decimal
  string of at most 16 digits (``MAX_SAFE_INT`` has 16).
* :data:`MAX_LOGIT_BIAS_ENTRIES`, :data:`MAX_BAD_WORDS_SEQUENCES`, :data:`MAX_BAD_WORD_LENGTH`,
  :data:`MAX_AUTOMATON_STATES`, :data:`MAX_AUTOMATON_EDGES`: the policy tables' sizes (code
  ``policy.too_large``).  Each decision scans these tables, and every receipt records the
  policy, so they bound the per-token work and output bytes.
* :data:`MAX_STATIC_CACHE_BYTES`: the largest static K/V reservation a request may ask for
  (``2 * layers * H_kv * capacity * head_dim * dtype bytes * batch``; code
  ``cache.memory_exceeded``).  The static capacity is also bounded by the model window
  (``model.context_window_exceeded``).

Source: M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data" (declared finite
bounds, typed refusal), M3.10 0x09 "Static storage demonstrates why capacity and commitment
differ" (the reservation is a declared quantity).
"""

from __future__ import annotations

from .errors import register_code

__all__ = [
    "CACHE_MEMORY_EXCEEDED",
    "MAX_AUTOMATON_EDGES",
    "MAX_AUTOMATON_STATES",
    "MAX_BAD_WORDS_SEQUENCES",
    "MAX_BAD_WORD_LENGTH",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_SAFE_INT",
    "MAX_STATIC_CACHE_BYTES",
    "MAX_TOKEN_KEY_DIGITS",
    "static_cache_bytes",
]

#: Largest integer RFC 8785 can serialize exactly (I-JSON): every envelope and policy integer
#: lies in ``[-MAX_SAFE_INT, MAX_SAFE_INT]``.
MAX_SAFE_INT = 2**53 - 1
#: Most decimal digits of a token-id key (``len(str(MAX_SAFE_INT))``).
MAX_TOKEN_KEY_DIGITS = len(str(MAX_SAFE_INT))
#: Most entries of one ``logit_bias`` table.
MAX_LOGIT_BIAS_ENTRIES = 4096
#: Most banned sequences of one ``bad_words`` transform.
MAX_BAD_WORDS_SEQUENCES = 4096
#: Longest banned sequence, in token ids.
MAX_BAD_WORD_LENGTH = 256
#: Most states of one constraint automaton.
MAX_AUTOMATON_STATES = 4096
#: Most edges (``(state, token) -> state`` entries) of one constraint automaton, all states together.
MAX_AUTOMATON_EDGES = 65_536
#: Largest static K/V reservation of one request, in bytes (8 GiB).
MAX_STATIC_CACHE_BYTES = 8 * 1024**3

CACHE_MEMORY_EXCEEDED = register_code(
    "cache.memory_exceeded",
    "resource_limit",
    "M3.10 0x09 Static storage demonstrates why capacity and commitment differ",
    f"A static cache's K/V reservation (2 x layers x K/V heads x capacity x head width x dtype bytes x batch) exceeds "
    f"MAX_STATIC_CACHE_BYTES ({MAX_STATIC_CACHE_BYTES} bytes); refused at admission, before anything is allocated.",
)


def static_cache_bytes(num_layers: int, num_key_value_heads: int, head_dim: int, dtype_bytes: int, capacity: int,
                       batch_size: int = 1) -> int:
    """Bytes a static cache reserves: keys and values ``[batch, H_kv, capacity, head_dim]`` for every layer.

    Args:
        num_layers, num_key_value_heads, head_dim: The cache ABI's shape.
        dtype_bytes: Bytes per stored element (4 for float32, 2 for bfloat16).
        capacity: Reserved slots S.
        batch_size: Rows (1 for a request; K live beams for a beam search).

    Returns:
        ``2 * num_layers * batch_size * num_key_value_heads * capacity * head_dim * dtype_bytes``.
    """
    return 2 * num_layers * batch_size * num_key_value_heads * capacity * head_dim * dtype_bytes
