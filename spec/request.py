"""The request's declared defaults over plain integers: static capacity S and context cap C.

One home for the two length defaults every side of the project needs -- the spec's parameters
(:func:`decodespec.spec.state.params_from_request`), the reference runtime (``impl/``), the gate's
spec side (``checks/gate/lockstep.py``), the peer adapters, the explorer and the CLI.  They are pure
functions over integers (no torch, no spec state), so ``impl/`` may call them without consulting
the spec's transitions (tests/test_layout.py); tests/test_request_defaults.py fails when one of
these defaults is computed anywhere else.

* :func:`default_static_capacity`: ``S = min(L + G + 1, window)``.  A static cache reserves its
  maximum length up front (M3.10 0x09 "Cache families preserve different contracts"); room for
  the prompt, every output and the declared append/repair call of the last output (M3.10 "The
  first-output off-by-one": ``P = L + G`` only after an explicit append), plus one slot, so that
  the capacity (which bounds C) never fires ``context_length`` before ``length``.  Slots past
  the model window can never be written, so the window caps it.
* :func:`static_capacity`: the declared S, else the default; ``None`` for a cache family other
  than ``static``.
* :func:`context_cap`: C, the least of the declared length bounds (model window or the
  envelope's ``max_context``, ``max_total_tokens`` / a case's ``context_cap``, the static
  capacity); ``L + O`` reaching C fires ``context_length`` (M3.10 0x05 stop table: "hard
  length/context cap ... truncation is a finish reason, not EOS").
* :func:`unbounded_context_cap`: ``L + G + 1``, a cap no request of length bounds L, G reaches
  (the explorer's C when its bounds declare none).
* :func:`prompt_room`: the slots admission requires of S and C: ``L + 1`` when G >= 1, else ``L``.
* :func:`policy_with_min_new_tokens`: the M3.8 policy a request decides with (``min_new_tokens``
  enforced by the policy's legality transform).

Source: M3.10 0x09 "Cache families preserve different contracts", "The first-output
off-by-one", "Immutable request envelope and canonical identity".
"""

from __future__ import annotations

from .errors import register_code
from .policy import PolicyConfig, policy_config_from_json

__all__ = [
    "CONTEXT_WINDOW_EXCEEDED",
    "INVALID_REQUEST",
    "context_cap",
    "default_static_capacity",
    "policy_with_min_new_tokens",
    "prompt_room",
    "static_capacity",
    "unbounded_context_cap",
]

#: A request a runtime cannot run as given: empty prompt, a token id outside ``[0, V)``, a negative G.
INVALID_REQUEST = register_code(
    "runtime.invalid_request",
    "rejection",
    "M3.10 Immutable request envelope",
    "The generation request is malformed: empty prompt, a token id outside [0, V), or a negative max_new_tokens.",
)

#: A position id would reach or pass the model's window.
CONTEXT_WINDOW_EXCEEDED = register_code(
    "model.context_window_exceeded",
    "resource_limit",
    "M3.10 0x0A Position and cache consistency",
    "A position id would reach or pass the model's context window (max_position_embeddings).",
)


def default_static_capacity(prompt_len: int, max_new_tokens: int, window: int) -> int:
    """The default static capacity S: ``min(L + G + 1, window)`` (see the module docstring).

    Args:
        prompt_len: L, tokens in the prompt.
        max_new_tokens: G (a negative value counts as 0).
        window: The model's context window (``max_position_embeddings``).

    Returns:
        S in slots.

    Source: M3.10 0x09 "Cache families preserve different contracts"; "The first-output off-by-one".
    """
    return min(prompt_len + max(max_new_tokens, 0) + 1, window)


def static_capacity(cache_family: str, declared: int | None, prompt_len: int, max_new_tokens: int, window: int) -> int | None:
    """S of a request: ``declared`` when given, else :func:`default_static_capacity`; ``None`` unless ``static``.

    Args:
        cache_family: ``none`` / ``dynamic`` / ``static``.
        declared: The envelope's ``runtime.static_capacity`` (or a case's), or ``None``.
        prompt_len: L.
        max_new_tokens: G.
        window: The model's context window.
    """
    if cache_family != "static":
        return None
    return declared if declared is not None else default_static_capacity(prompt_len, max_new_tokens, window)


def context_cap(*bounds: int | None) -> int:
    """C: the least of the declared length bounds that are not ``None``.

    Args:
        bounds: The model window or the envelope's ``max_context``, then any of
            ``max_total_tokens`` / ``context_cap`` and the static capacity (``None``: not declared).

    Raises:
        ValueError: when every bound is ``None`` (a request always has a window or a cap).

    Source: M3.10 0x05 stop table ("hard length/context cap"), "Immutable request envelope and
    canonical identity".
    """
    declared = [b for b in bounds if b is not None]
    if not declared:
        raise ValueError("a context cap needs at least one declared bound")
    return min(declared)


def unbounded_context_cap(prompt_len: int, max_new_tokens: int) -> int:
    """``L + G + 1``: a context cap that no request with prompt length L and at most G outputs reaches."""
    return prompt_len + max_new_tokens + 1


def prompt_room(prompt_len: int, max_new_tokens: int) -> int:
    """The slots S and C must leave for admission: ``L + 1`` when G >= 1 (one output), else ``L``.

    Source: M3.10 0x09 "Cache families preserve different contracts" (overflow fails before overwrite).
    """
    return prompt_len + (1 if max_new_tokens >= 1 else 0)


def policy_with_min_new_tokens(policy: PolicyConfig, min_new_tokens: int) -> PolicyConfig:
    """``policy`` with the ``min_new_tokens`` legality transform first when the request needs it and the policy lacks it.

    The declared choice of the contract (docs/design.md section 2): the termination plane's
    ``min_new_tokens`` masks every EOS id through the M3.8 policy's legality stage, so EOS is
    never selected (not merely never honoured) while ``O < min_new_tokens``.

    Args:
        policy: The request's M3.8 policy.
        min_new_tokens: The termination plane's ``min_new_tokens`` (tokens).

    Returns:
        ``policy`` itself when ``min_new_tokens <= 0`` or the policy already has the transform,
        else a copy with ``{"name": "min_new_tokens"}`` as its first transform.

    Raises:
        Rejection: ``policy.*`` when the augmented policy is refused by the schema.

    Source: M3.8 0x0B "Hard constraints define a conditional support"; M3.10 0x05 stop table
    ("EOS ... after min_new_tokens").
    """
    if min_new_tokens <= 0 or policy.find("min_new_tokens") is not None:
        return policy
    obj = policy.to_json()
    return policy_config_from_json({**obj, "transforms": [{"name": "min_new_tokens"}] + obj["transforms"]})
