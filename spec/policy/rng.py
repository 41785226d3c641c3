"""M3.8 0x0B Request-owned randomness and replay: a counter-based Philox stream per request.

The key is derived from the request identity and seed; a draw is *addressed* by
``(step, draw_idx)`` rather than taken from a mutable generator, so a draw never depends on
what other requests, rejected paths or earlier failed attempts did:

* key: ``sha256(DOMAIN || rfc8785({"identity": identity, "seed": seed}))``, first 16 bytes as
  two little-endian uint64 words; ``key_id`` is those 16 bytes in hex.
* block: numpy ``Philox(key=words, counter=[draw_idx, step, 0, 0])``, first ``random_raw()``
  word (numpy increments the 256-bit counter before generating, so the cipher input is
  ``[draw_idx + 1, step, 0, 0]``).  Philox4x64-10 (Salmon et al. 2011).
* uniform: ``(word >> 11) * 2**-53``, a double in ``[0, 1)``.

The RNG *counter* in :class:`~decodespec.spec.policy.state.PolicyState` counts draws consumed so
far; greedy, forced tokens and rejected paths consume none.

Source: M3.8 0x0B "Request-owned randomness and replay"; M3.10 "RNG state belongs to the
request policy" (counter-based RNG keyed by request and step); M3.10 0x06 "Finish reason and
RNG precedence" (only executed stochastic operations advance the RNG).
"""

from __future__ import annotations

import hashlib

import attrs
import numpy as np
import rfc8785

__all__ = ["DOMAIN", "RngKey", "rng_key", "uniform"]

#: Domain tag of the key derivation (versioned: changing it changes every stream).
DOMAIN = b"decodespec.rng.philox4x64-10.v1\x00"


@attrs.frozen
class RngKey:
    """A request's Philox key.

    Attributes:
        key_id: The 16 key bytes in hex (recorded in receipts).
        words: The key as two uint64 words ``(k0, k1)``.
    """

    key_id: str
    words: tuple[int, int]


def rng_key(identity: str, seed: int | None) -> RngKey:
    """Derive the Philox key of a request.

    Args:
        identity: The canonical request identity (the envelope digest).
        seed: The request seed (non-negative integer) or ``None``.

    Returns:
        The :class:`RngKey`.
    """
    digest = hashlib.sha256(DOMAIN + rfc8785.dumps({"identity": identity, "seed": seed})).digest()[:16]
    return RngKey(key_id=digest.hex(), words=(int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")))


def uniform(key: RngKey, step: int, draw_idx: int) -> float:
    """The uniform variate at address ``(step, draw_idx)`` of ``key``'s stream.

    Args:
        key: The request key.
        step: Decision step (the output count O when the decision is made), >= 0.
        draw_idx: Index of the draw within the step, >= 0.

    Returns:
        A float in ``[0, 1)`` with 53 random bits.
    """
    assert step >= 0 and draw_idx >= 0, (step, draw_idx)
    bits = np.random.Philox(key=np.array(key.words, dtype=np.uint64), counter=np.array([draw_idx, step, 0, 0], dtype=np.uint64))
    word = int(bits.random_raw())
    return (word >> 11) * 2.0**-53
