"""The adapter of our runtime decoding one request tensor-parallel over R gloo rank processes (``--runtime impl-tp``).

The controller is the unchanged :class:`~decodespec.impl.runtime.RequestRunner` of the ``impl``
adapter (this class is :class:`~decodespec.checks.adapters.impl.ImplAdapter` with another
model); the model it calls is :class:`~decodespec.impl.tp.TPModel`: attention heads (whole K/V
heads with their query heads), MLP and the vocabulary head sharded over ``R`` forked rank
processes, each keeping its own K/V shard (module docstring of :mod:`decodespec.impl.tp`).
``R`` is ``$DECODESPEC_TP_WORLD_SIZE`` (default 2); the rank processes are forked when the
adapter first needs them (after any failure-lab mutant is installed, so the ranks carry it)
and ended by :meth:`close`.

Capabilities, declared honestly (``DECODESPEC_TP_PROFILE=full``; the default ``core`` profile also
leaves out the policy transforms and orders, :data:`TP_CORE_CAPABILITIES`): everything the ``impl``
adapter declares except what the ranks cannot do -- ``output.prompt_logprobs`` (the head's hidden rows stay on the ranks),
``decode_kernel:native`` (the C kernel is single-process), and compute dtypes other than
float32 (only float32 is calibrated against the float64 reference) -- plus ``rank_faults``: the
``fault`` kinds ``rank_kill`` (rank ``rank`` exits before layer ``layer`` of the in-flight call)
and ``rank_stall`` (it sleeps there until the controller's bounded wait gives up and kills it).
Either fails the call with :class:`~decodespec.impl.faults.ParticipantFailure` (typed
``device_error`` / ``timeout``), which the runner selects as ALL_OLD; the ``complete`` result
carries ``participant_failure`` (rank and typed reason).

Source: M3.10 0x0A "One request can still be model-parallel"; issue 21 item 3.
"""

from __future__ import annotations

import os
from typing import Any

from decodespec.impl.tp import RankFault, TPModel
from decodespec.spec.errors import Rejection
from decodespec.spec.transitions import NOT_ENABLED

from . import ADAPTER_INVALID_ACTION, RANK_FAULTS, CaseConfig
from .features import names_at
from .impl import IMPL_CAPABILITIES, ImplAdapter, load_model

__all__ = ["TP_CAPABILITIES", "TP_CORE_CAPABILITIES", "ImplTPAdapter", "available", "create", "world_size"]

#: Everything the tensor-parallel runtime can run (see the module docstring): ``DECODESPEC_TP_PROFILE=full``.
TP_CAPABILITIES = (IMPL_CAPABILITIES - {"output.prompt_logprobs", "decode_kernel:native"} - names_at("runtime.compute_dtype")) \
    | {"rank_faults"}
#: The default (``core``) profile: :data:`TP_CAPABILITIES` less the M3.8 transforms and policy orders.  Those run in the
#: controller, on exactly the code the ``impl`` gate judges, and change nothing the ranks compute or keep; on the
#: project's 2 shared cores the SmolLM2 gate of R rank processes fits only without their ~120 sweep cases.  Their cases
#: are skipped as capability refusals (``impl-tp does not declare [transform:...]``); ``full`` declares them.
TP_CORE_CAPABILITIES = TP_CAPABILITIES - names_at("policy.transforms", "policy.order")


def world_size() -> int:
    """R: ``$DECODESPEC_TP_WORLD_SIZE`` (default 2)."""
    return int(os.environ.get("DECODESPEC_TP_WORLD_SIZE", "2"))


def available() -> str | None:
    """Usable wherever ``torch.distributed`` has gloo."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with the gloo backend is not available in this torch build"
    return None


def create(**options: Any) -> ImplTPAdapter:
    """The adapter (a ``model`` option is ignored: the case config names it)."""
    options.pop("model", None)
    return ImplTPAdapter(**options)


class ImplTPAdapter(ImplAdapter):
    """:class:`ImplAdapter` whose runner calls a :class:`~decodespec.impl.tp.TPModel` (one rank group per model setting).

    Args:
        world_size: R (default :func:`world_size`).
        timeout_s: The collectives' timeout (default ``$DECODESPEC_TP_TIMEOUT_S`` or 5 s).
        **options: :class:`ImplAdapter`'s.
    """

    def __init__(self, *, world_size: int | None = None, timeout_s: float | None = None, name: str = "impl-tp", **options: Any):
        super().__init__(name=name, **options)
        self.world_size = globals()["world_size"]() if world_size is None else world_size
        self.timeout_s = timeout_s
        self._models: dict[tuple, TPModel] = {}

    def capabilities(self) -> frozenset[str]:
        """:data:`TP_CORE_CAPABILITIES`, or :data:`TP_CAPABILITIES` under ``DECODESPEC_TP_PROFILE=full``."""
        return TP_CAPABILITIES if os.environ.get("DECODESPEC_TP_PROFILE", "core") == "full" else TP_CORE_CAPABILITIES

    def model_for(self, config: CaseConfig) -> TPModel:
        """The :class:`TPModel` over the shared full model of ``config`` (its ranks forked on first use)."""
        key = (config.model, config.dtype, config.device, config.attention)
        model = self._models.get(key)
        if model is None:
            for other in self._models.values():  # one rank group at a time: 2 cores
                other.close()
            self._models.clear()
            model = self._models[key] = TPModel(load_model(config.model, config.dtype, config.device, config.attention),
                                                self.world_size, self.timeout_s)
        return model

    def close(self) -> None:
        """Drop the runner and snapshots, and end every rank process (bounded joins)."""
        super().close()
        for model in self._models.values():
            model.close()
        self._models.clear()

    def _start(self, config: CaseConfig, cache: Any) -> None:
        super()._start(config, cache)
        self._clear_rank_faults()  # admitted: a rank fault of the earlier request's call never reaches this one

    def _op_restore(self, act: dict[str, Any]) -> dict[str, Any]:
        out = super()._op_restore(act)
        self._clear_rank_faults()  # restored (a refused restore keeps the in-flight call and its fault, as impl's runner does)
        return out

    def _clear_rank_faults(self) -> None:
        for model in self._models.values():
            model.rank_faults = []

    def _complete(self) -> dict[str, Any]:
        out = super()._complete()
        failure = self.runner.participant_failure
        if failure is not None:
            out["participant_failure"] = {"rank": failure.rank, "reason": failure.reason}
        return out

    def _op_fault(self, act: dict[str, Any]) -> dict[str, Any]:
        if act["kind"] not in RANK_FAULTS:
            return super()._op_fault(act)
        r = self.runner
        call = r.in_flight
        if call is None or call.call_id in self._faulted:
            guard = "a call is in flight" if call is None else "no fault recorded yet"
            raise Rejection(NOT_ENABLED, f"transition.fault: guard '{guard}' is false in phase {r.phase.value}", "$.action",
                            details={"rule": "transition.fault", "guard": guard})
        layer, rank = act["layer"] or 0, act["rank"] or 0
        if not 0 <= layer < r.model.config.num_hidden_layers:
            raise Rejection(ADAPTER_INVALID_ACTION, f"layer {layer} is outside the model", "$.layer")
        if not 0 <= rank < r.model.world_size:
            raise Rejection(ADAPTER_INVALID_ACTION, f"rank {rank} is outside the {r.model.world_size} ranks", "$.rank")
        r.model.rank_faults = [RankFault(rank, "kill" if act["kind"] == "rank_kill" else "stall", layer)]
        self._faulted.add(call.call_id)
        return {"call_id": call.call_id}
