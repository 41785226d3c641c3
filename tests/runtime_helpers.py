"""Shared helpers of the runtime, cache, snapshot and trace-validation tests.

* :func:`request` builds a :class:`~decodespec.impl.runtime.RuntimeRequest` with test defaults;
* :func:`drive` runs a runner to the end, recording the raw score row of every decision;
* :func:`sampled_policy` is a seeded multinomial policy (temperature 0.8, top-k 40);
* :func:`renumber` rewrites ``seq`` after a test edits a trace.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from decodespec.impl.runtime import RequestRunner, RuntimeRequest
from decodespec.spec.policy import policy_config_from_json

#: The tiny model's declared logit tolerance (tests/test_model_cache.py) and SmolLM2's.
LOGIT_TOL = {"tiny": 5e-5, "smollm2": 2e-4}


def sampled_policy():
    """A multinomial policy (temperature 0.8, top-k 40): one draw per decision."""
    return policy_config_from_json({"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.8},
                                                                          {"name": "top_k", "k": 40}]})


def request(prompt_ids, max_new_tokens: int = 6, **changes: Any) -> RuntimeRequest:
    """A request with test defaults: identity ``"test"``, seed 5, no EOS (runs to ``length``)."""
    values: dict[str, Any] = {"identity": "test", "prompt_ids": tuple(prompt_ids), "max_new_tokens": max_new_tokens, "seed": 5,
                                  "eos_ids": frozenset()}
    values.update(changes)
    return RuntimeRequest(**values)


def drive(runner: RequestRunner) -> tuple[list[torch.Tensor], Any]:
    """Run ``runner`` to the end; return (the float32 CPU copy of every decision's score row, the result)."""
    rows = []
    while True:
        if runner.phase.value == "scored" and runner.score is not None:
            rows.append(runner.score.logits.detach().float().cpu().clone())
        if runner.step() is None:
            return rows, runner.result()


def renumber(records: list[dict]) -> list[str]:
    """Trace lines of ``records`` with ``seq`` rewritten to 0, 1, 2, ... (after a test edits a trace)."""
    return [json.dumps({**rec, "seq": index}) for index, rec in enumerate(records)]
