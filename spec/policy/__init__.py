"""M3.8 0x0B-0x0F The decoding policy: one typed score row -> one token decision and receipt.

The pure reference (Python + numpy, float64 where it matters).  The torch twin is
:mod:`decodespec.impl.policy`.

* :mod:`.config`: :class:`PolicyConfig`, :func:`policy_config_from_json`,
  :data:`POLICY_JSON_SCHEMA`, the transform catalog and the order presets.
* :mod:`.scores`: :class:`ScoreKind`, :class:`ScoreRow`.
* :mod:`.codes`: the ``policy.*`` error codes.
"""

from decodespec.spec.policy.config import (
    CATALOG,
    POLICY_JSON_SCHEMA,
    PRESET_ORDERS,
    Automaton,
    EarlyStopping,
    EmptySupport,
    Family,
    Order,
    PolicyConfig,
    Stage,
    TransformSpec,
    policy_config_from_json,
)
from decodespec.spec.policy.scores import ScoreKind, ScoreRow

__all__ = [
    "Automaton",
    "CATALOG",
    "EarlyStopping",
    "EmptySupport",
    "Family",
    "Order",
    "POLICY_JSON_SCHEMA",
    "PRESET_ORDERS",
    "PolicyConfig",
    "ScoreKind",
    "ScoreRow",
    "Stage",
    "TransformSpec",
    "policy_config_from_json",
]
