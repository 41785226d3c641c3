"""M3.8 0x0B-0x0F The decoding policy: one typed score row -> one token decision and receipt.

The pure reference (Python + numpy, float64 where it matters).  The torch twin is
:mod:`decodespec.impl.policy`.

* :mod:`.config`: :class:`PolicyConfig`, :func:`policy_config_from_json`,
  :data:`POLICY_JSON_SCHEMA`, the transform catalog and the order presets.
* :mod:`.scores`: :class:`ScoreKind`, :class:`ScoreRow`.
* :mod:`.state`: :class:`RequestView`, :class:`PolicyState`, :func:`initial_policy_state`.
* :mod:`.transforms`, :mod:`.selectors`: the registered rules ``transform.*``, ``selector.*``.
* :mod:`.rng`: the request-owned counter-based Philox stream.
* :mod:`.receipt`: :class:`DecisionReceipt`.
* :mod:`.decide`: :func:`decide`, :func:`processed_row`, :func:`beam_candidates`.
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
from decodespec.spec.policy.decide import BeamCandidates, ProcessedRow, beam_candidates, child_state, decide, processed_row
from decodespec.spec.policy.receipt import DecisionReceipt, RngRecord
from decodespec.spec.policy.rng import RngKey, rng_key, uniform
from decodespec.spec.policy.scores import ScoreKind, ScoreRow
from decodespec.spec.policy.state import PolicyState, RequestView, initial_policy_state

__all__ = [
    "CATALOG",
    "POLICY_JSON_SCHEMA",
    "PRESET_ORDERS",
    "Automaton",
    "BeamCandidates",
    "DecisionReceipt",
    "EarlyStopping",
    "EmptySupport",
    "Family",
    "Order",
    "PolicyConfig",
    "PolicyState",
    "ProcessedRow",
    "RequestView",
    "RngKey",
    "RngRecord",
    "ScoreKind",
    "ScoreRow",
    "Stage",
    "TransformSpec",
    "beam_candidates",
    "child_state",
    "decide",
    "initial_policy_state",
    "policy_config_from_json",
    "processed_row",
    "rng_key",
    "uniform",
]
