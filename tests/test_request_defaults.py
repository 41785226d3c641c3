"""One home per request default and schedule rule (issue 17 item 2).

The declared defaults and the controller's schedule live in ``spec/`` once:

* the default static capacity ``min(L + G + 1, window)``:
  :func:`decodespec.spec.request.default_static_capacity`;
* the context cap C, the least of the declared bounds: :func:`decodespec.spec.request.context_cap`;
* the call due next: :func:`decodespec.spec.state.next_call`;
* the interrupt-point map (phase -> where a cancel lands): :func:`decodespec.spec.state.call_interrupt_point`;
* the policy a request decides with (``min_new_tokens`` as its first legality transform):
  :func:`decodespec.spec.request.policy_with_min_new_tokens`.

An AST scan of ``spec/``, ``impl/`` and ``checks/`` fails when one of them is computed anywhere else
(the shapes: an ``L + G + 1`` sum, a ``min`` over two kinds of length bound, a dict mapping phases to
``InterruptPoint`` members, a ``return`` of a prefill call tuple, a ``min_new_tokens`` transform prepended to a list).  The scan is shown to catch a planted
copy of each shape, and the homes' values are checked against the defaults they replace.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from decodespec.spec.enums import CallKind, FinishReason, PendingTag
from decodespec.spec.request import context_cap, default_static_capacity, prompt_room, static_capacity, unbounded_context_cap
from decodespec.spec.state import InterruptPoint, Phase, call_interrupt_point, next_call, repair_owed

ROOT = Path(__file__).resolve().parents[1]
#: The homes: the only files where a shape may appear.
HOMES = {"spec/request.py", "spec/state.py"}

_G_NAMES = {"g", "G", "max_new_tokens", "new_tokens"}
_BOUND_KINDS = {
    "window": {"window", "max_position_embeddings", "max_context"},
    "cap": {"context_cap", "max_total_tokens"},
    "capacity": {"capacity", "static_capacity"},
}


def _names(node: ast.AST) -> set[str]:
    """Every identifier and attribute name under ``node``."""
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
    return out


def _is_prompt_len(node: ast.AST) -> bool:
    names = _names(node)
    return "L" in names or any("prompt" in n for n in names)


def _bound_kinds(node: ast.AST) -> set[str]:
    names = _names(node)
    return {kind for kind, words in _BOUND_KINDS.items() if names & words}


def findings(source: str, where: str = "<planted>") -> list[str]:
    """Each copy of a home's rule in ``source`` as ``where:line: shape``."""
    tree = ast.parse(source)
    assigned_lists: dict[str, ast.AST] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned_lists[node.targets[0].id] = node.value
    out = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        # L + G + 1 (the default static capacity, or a cap computed from it).
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.right, ast.Constant) and node.right.value == 1
                and isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.Add)
                and _names(node.left.right) & _G_NAMES and _is_prompt_len(node.left.left)):
            out.append(f"{where}:{line}: L + G + 1 (default_static_capacity)")
        # min over two kinds of length bound (the context cap).
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "min" and node.args:
            kinds: set[str] = set()
            for arg in node.args:
                kinds |= _bound_kinds(assigned_lists.get(arg.id, arg) if isinstance(arg, ast.Name) else arg)
            if len(kinds) >= 2:
                out.append(f"{where}:{line}: min over {sorted(kinds)} (context_cap)")
        # phase -> InterruptPoint map.
        if isinstance(node, ast.Dict) and any(isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "InterruptPoint"
                                              for v in node.values):
            out.append(f"{where}:{line}: phase -> InterruptPoint map (call_interrupt_point)")
        # return (prefill, start, length): a schedule of calls.
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and node.value.elts:
            head = node.value.elts[0]
            if (isinstance(head, ast.Attribute) and head.attr == "PREFILL") or (isinstance(head, ast.Constant) and head.value == "prefill"):
                out.append(f"{where}:{line}: due prefill call (next_call)")
        # [{"name": "min_new_tokens"}] + transforms: the policy a request decides with.
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.List)
                and any(isinstance(e, ast.Dict) and any(isinstance(v, ast.Constant) and v.value == "min_new_tokens" for v in e.values)
                        for e in node.left.elts)):
            out.append(f"{where}:{line}: min_new_tokens transform prepended (policy_with_min_new_tokens)")
    return out


def test_no_default_or_schedule_rule_is_computed_outside_its_home():
    hits = []
    for top in ("spec", "impl", "checks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in HOMES:
                continue
            hits += findings(path.read_text(encoding="utf-8"), rel)
    assert not hits, "a default or schedule rule is computed outside spec/request.py / spec/state.py:\n" + "\n".join(hits)


@pytest.mark.parametrize("planted", [
    "capacity = config.static_capacity or min(config.prompt_len + config.max_new_tokens + 1, window)",
    "changes['static_capacity'] = min(len(prompt) + g + 1, window)",
    ("caps = [model.config.max_position_embeddings] + [c for c in (request.context_cap, self.capacity) if c is not None]\n"
    "cap = min(caps)"),
    "cap = min(c for c in (model.config.max_position_embeddings, request.context_cap, snapshot.capacity) if c is not None)",
    "at = {Phase.READY: InterruptPoint.BEFORE_LAUNCH, Phase.SCORED: InterruptPoint.AFTER_COMPLETION}.get(phase)",
    "def due():\n    return CallKind.PREFILL, 0, prompt_len",
    "def due():\n    return 'prefill', processed, 1",
    "transforms = [{'name': 'min_new_tokens'}] + obj['transforms']",
])
def test_the_scan_catches_a_planted_copy(planted):
    assert findings(planted), planted


@pytest.mark.parametrize("benign", [
    "gen = generation_config(config, max_length=min(L + G, context_cap))",  # HF's max_length: one kind of bound
    "if cfg.prompt_len + t + 1 >= cfg.max_context_len: pass",  # the context_length trigger at output t
    "n = len(prompt) + g + 2",
])
def test_the_scan_leaves_other_arithmetic_alone(benign):
    assert not findings(benign), benign


def test_the_homes_give_the_declared_defaults():
    assert default_static_capacity(5, 3, 1024) == 9
    assert default_static_capacity(5, 3, 8) == 8  # capped by the window
    assert default_static_capacity(5, -1, 1024) == 6  # G < 0 counts as 0
    assert static_capacity("dynamic", 7, 5, 3, 1024) is None
    assert static_capacity("static", 7, 5, 3, 1024) == 7
    assert static_capacity("static", None, 5, 3, 1024) == 9
    assert context_cap(1024, None, 9) == 9 and context_cap(1024, 6, None) == 6 and context_cap(1024, None, None) == 1024
    with pytest.raises(ValueError):
        context_cap(None, None)
    assert unbounded_context_cap(5, 3) == 9
    assert prompt_room(5, 0) == 5 and prompt_room(5, 2) == 6


def test_the_schedule_home():
    common = {"prompt_len": 4, "cached": True, "prefill_chunk": None, "call_in_flight": False, "quarantined": False, "repair_owed": False}
    assert next_call(phase=Phase.READY, processed=0, output_count=0, pending_tag=PendingTag.EMPTY, **common) == (CallKind.PREFILL, 0, 4)
    chunked = {**common, "prefill_chunk": 3}
    assert next_call(phase=Phase.READY, processed=3, output_count=0, pending_tag=PendingTag.EMPTY, **chunked) == (CallKind.PREFILL, 3, 1)
    assert next_call(phase=Phase.READY, processed=4, output_count=1, pending_tag=PendingTag.PENDING_NEXT_CALL, **common) == (CallKind.DECODE, 4, 1)
    uncached = {**common, "cached": False}
    assert next_call(phase=Phase.READY, processed=0, output_count=2, pending_tag=PendingTag.PENDING_NEXT_CALL, **uncached) == (CallKind.DECODE, 0, 6)
    assert next_call(phase=Phase.READY, processed=0, output_count=0, pending_tag=PendingTag.EMPTY, **{**common, "call_in_flight": True}) is None
    assert next_call(phase=Phase.FINISHED, processed=5, output_count=2, pending_tag=PendingTag.CLOSED_UNPROCESSED,
                     **{**common, "repair_owed": True}) == (CallKind.REPAIR, 5, 1)
    owed = {"phase": Phase.FINISHED, "repair_required": True, "pending_tag": PendingTag.CLOSED_UNPROCESSED, "finish_reason": FinishReason.LENGTH}
    assert repair_owed(triggers=frozenset({FinishReason.LENGTH}), **owed)
    assert not repair_owed(triggers=frozenset({FinishReason.LENGTH, FinishReason.DEVICE_ERROR}), **owed)
    assert call_interrupt_point(Phase.FINISHED, True) is InterruptPoint.IN_FLIGHT
    assert call_interrupt_point(Phase.FINISHED, False) is None
    assert call_interrupt_point(Phase.SCORED, False) is InterruptPoint.AFTER_COMPLETION


def test_the_controller_order_home():
    """One order of the controller's actions (spec/state.py controller_action), asked by the spec, impl and the peers."""
    from decodespec.spec.state import ControllerAction, controller_action

    base = {"phase": Phase.READY, "call_in_flight": False, "quarantined": False, "repair_owed": False, "call_due": True}
    assert controller_action(**base) is ControllerAction.LAUNCH
    assert controller_action(**{**base, "call_in_flight": True, "quarantined": True}) is ControllerAction.COMPLETE
    assert controller_action(**{**base, "quarantined": True}) is ControllerAction.RECOVER
    assert controller_action(**{**base, "phase": Phase.FINISHED, "quarantined": True, "call_due": False}) is None
    assert controller_action(**{**base, "phase": Phase.FINISHED, "quarantined": True, "repair_owed": True}) is ControllerAction.RECOVER
    assert controller_action(**{**base, "phase": Phase.SCORED}) is ControllerAction.DECIDE
    assert controller_action(**{**base, "phase": Phase.DECIDED}) is ControllerAction.COMMIT
    assert controller_action(**{**base, "call_due": False}) is None
