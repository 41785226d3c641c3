"""M3.8 0x0B Request-owned randomness: the runtime's counter-based Philox4x64-10 stream.

The runtime's own implementation of the draw addressing the spec declares
(``decodespec.spec.policy.rng``), written independently in pure Python so that replay does not
depend on the oracle: a request key is derived from the request identity and seed, and the
draw at address ``(step, draw_idx)`` is a pure function of ``(key, step, draw_idx)``:

* key: ``sha256(b"decodespec.rng.philox4x64-10.v1\\x00" || rfc8785({"identity", "seed"}))``,
  first 16 bytes as two little-endian uint64 words.
* block: Philox4x64 with 10 rounds on the 256-bit counter ``(draw_idx + 1, step, 0, 0)``
  (numpy's ``Philox(counter=[draw_idx, step, 0, 0])`` increments before generating).
* uniform: ``(first output word >> 11) * 2**-53`` in ``[0, 1)``.

Implements rule ``selector.multinomial``'s draw contract (one uniform per multinomial decision,
none for greedy, forced or rejected paths).

Source: Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC'11),
Philox4x64-10 constants as in Random123 and numpy ``_philox.pyx``; M3.8 0x0B "Request-owned
randomness and replay".
"""

from __future__ import annotations

import hashlib

import rfc8785

__all__ = ["RequestRng", "philox4x64_10"]

_MASK = (1 << 64) - 1
_M0, _M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
_W0, _W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B
_DOMAIN = b"decodespec.rng.philox4x64-10.v1\x00"


def philox4x64_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """One Philox4x64-10 block: four 64-bit words from a 256-bit counter and a 128-bit key."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & _MASK, (p0 >> 64) ^ c3 ^ k1, p0 & _MASK
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c0, c1, c2, c3


def _increment(counter: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    words = list(counter)
    for i in range(4):
        words[i] = (words[i] + 1) & _MASK
        if words[i]:
            break
    return tuple(words)  # type: ignore[return-value]


class RequestRng:
    """The draw source of one request: a key and pure address -> uniform lookups.

    Args:
        identity: Canonical request identity.
        seed: Request seed (non-negative) or ``None``.

    Attributes:
        key_id: Hex of the 16 key bytes (recorded in receipts).
    """

    def __init__(self, identity: str, seed: int | None):
        digest = hashlib.sha256(_DOMAIN + rfc8785.dumps({"identity": identity, "seed": seed})).digest()[:16]
        self.key_id = digest.hex()
        self._key = (int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little"))

    def uniform(self, step: int, draw_idx: int) -> float:
        """The uniform in ``[0, 1)`` at address ``(step, draw_idx)``."""
        word = philox4x64_10(_increment((draw_idx, step, 0, 0)), self._key)[0]
        return (word >> 11) * 2.0**-53
