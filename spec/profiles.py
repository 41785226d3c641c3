"""M3.10 0x01 "Architecture family changes the carried state": state-lane rosters per profile.

A *profile* names the architecture family of one request and the closed roster of model-state
lanes that a model call must complete before its result may be selected ALL_NEW (M3.10 0x08
"One model call prepares a complete logical state candidate", advancing-state-lane roster).
The request state machine (:mod:`decodespec.spec.transitions`) is parameterised by that roster:

* ``decoder_only``: one advancing self-attention K/V lane; the cached-baseline frontier
  ``K_frontier`` exists and equals ``P``.
* ``encoder_decoder``: encoder memory and cross-attention K/V are *fixed* lanes (source-indexed,
  computed by the first call, never changed by target decode), target self K/V advances.
* ``prefix_lm``: one advancing K/V lane; visibility is bidirectional inside the prefix and
  causal after it (M3.10 0x01 "Prefix execution has a phase change"), so the prefix must be
  processed by one call.
* ``hybrid``: an attention K/V lane and a recurrent/state-space lane both advance from the same
  processed frontier; the spec speaks of ``P_dyn`` and one ``F_lane`` per lane instead of one K
  (M3.10 0x01 "Recurrent and hybrid state generalize the cache frontier").

Each profile is registered as rule ``profile.<name>``.

Source: M3.10 0x01 (family table, encoder-decoder cached state, prefix execution, recurrent and
hybrid state), M3.10 0x08 (closed rosters).
"""

from __future__ import annotations

import enum

import attrs

from .rules import Rule, register

__all__ = [
    "PROFILES",
    "Lane",
    "LaneKind",
    "Profile",
    "Visibility",
    "profile_named",
]


class LaneKind(str, enum.Enum):
    """What a state lane holds (M3.10 0x01 family table)."""

    SELF_KV = "self_kv"
    """Self-attention K/V rows indexed by processed input positions; grows by one row per token."""
    CROSS_KV = "cross_kv"
    """Cross-attention K/V projected from fixed encoder memory; source-indexed and fixed."""
    ENCODER_MEMORY = "encoder_memory"
    """Encoder output ``[B,S,d_model]``; computed once per request and fixed."""
    RECURRENT = "recurrent"
    """Recurrent / state-space / convolution state at the processed frontier; fixed size."""


class Visibility(str, enum.Enum):
    """Attention visibility contract of a profile (M3.10 0x01 "Decoder-only, prefix-decoder ...")."""

    CAUSAL = "causal"
    PREFIX_LM = "prefix_lm"
    ENCODER_DECODER = "encoder_decoder"


@attrs.frozen
class Lane:
    """One model-state lane of a profile.

    Attributes:
        name: Lane name, unique within its profile (``"self_kv"``, ``"recurrent"`` ...).
        kind: What the lane holds.
        advancing: ``True`` when the lane's frontier advances with every processed input token
            (``F_lane = P``); ``False`` for fixed source-indexed lanes whose frontier is the
            source length ``S`` once the first call has computed them.
    """

    name: str
    kind: LaneKind
    advancing: bool


@attrs.frozen
class Profile:
    """An architecture profile: its visibility contract and closed state-lane roster.

    Attributes:
        name: Profile id without the ``profile.`` prefix (``"decoder_only"`` ...).
        visibility: The attention visibility contract.
        lanes: The closed roster of state lanes a cached call must complete (in roster order).
        has_k_frontier: Whether the cached-baseline frontier ``K_frontier`` is defined (only
            the contiguous full-K/V decoder-only profile, M3.10 spine).
        source_indexed: Whether the request has a separate source sequence (encoder-decoder).
    """

    name: str
    visibility: Visibility
    lanes: tuple[Lane, ...]
    has_k_frontier: bool
    source_indexed: bool = False

    def lane_names(self) -> tuple[str, ...]:
        """Names of every lane, in roster order."""
        return tuple(lane.name for lane in self.lanes)

    def advancing_lanes(self) -> tuple[str, ...]:
        """Names of the lanes whose frontier must equal ``P`` (``P_dyn``)."""
        return tuple(lane.name for lane in self.lanes if lane.advancing)

    def fixed_lanes(self) -> tuple[str, ...]:
        """Names of the fixed, source-indexed lanes."""
        return tuple(lane.name for lane in self.lanes if not lane.advancing)


_SELF = Lane("self_kv", LaneKind.SELF_KV, advancing=True)

#: Every profile the state machine knows, by name.
PROFILES: dict[str, Profile] = {
    "decoder_only": Profile("decoder_only", Visibility.CAUSAL, (_SELF,), has_k_frontier=True),
    "encoder_decoder": Profile(
        "encoder_decoder",
        Visibility.ENCODER_DECODER,
        (
            Lane("encoder_memory", LaneKind.ENCODER_MEMORY, advancing=False),
            Lane("cross_kv", LaneKind.CROSS_KV, advancing=False),
            _SELF,
        ),
        has_k_frontier=False,
        source_indexed=True,
    ),
    "prefix_lm": Profile("prefix_lm", Visibility.PREFIX_LM, (_SELF,), has_k_frontier=False),
    "hybrid": Profile(
        "hybrid",
        Visibility.CAUSAL,
        (_SELF, Lane("recurrent", LaneKind.RECURRENT, advancing=True)),
        has_k_frontier=False,
    ),
}

_STATEMENTS = {
    "decoder_only": (
        "Roster {self_kv (advancing)}; causal visibility; K_frontier = P in the cached profile.",
        "M3.10 0x08 Output, input, and cache frontiers",
    ),
    "encoder_decoder": (
        ("Roster {encoder_memory (fixed), cross_kv (fixed), self_kv (advancing)}; fixed lanes are computed by "
        "the first call at the source length S and never change; target self state advances with P."),
        "M3.10 0x01 Encoder-decoder cached state has two lifetimes",
    ),
    "prefix_lm": (
        ("Roster {self_kv (advancing)}; bidirectional inside the prefix, causal after it; the prefix is "
        "processed by one call (a chunk may not split it)."),
        "M3.10 0x01 Prefix execution has a phase change inside one sequence",
    ),
    "hybrid": (
        ("Roster {self_kv, recurrent} both advancing; every lane frontier F_lane equals the dynamic "
        "processed frontier P_dyn before the next decision."),
        "M3.10 0x01 Recurrent and hybrid state generalize the cache frontier",
    ),
}

for _name, _profile in PROFILES.items():
    _statement, _section = _STATEMENTS[_name]
    register(
        Rule(
            id=f"profile.{_name}",
            kind="profile",
            title=f"{_name.replace('_', '-')} profile",
            section=_section,
            statement=_statement,
            obj=_profile,
        )
    )


def profile_named(name: str) -> Profile:
    """The profile called ``name``.

    Raises:
        KeyError: if no profile has that name (callers validate names first).
    """
    return PROFILES[name]
