"""M3.8 0x02, 0x05, 0x09: check a model's output head and a user's loss implementation against spec/head.py.

Three checks, each against the pure float64 reference in :mod:`decodespec.spec.head`:

* :func:`measure_head` -- what our model's ``lm_head`` does for a row scope (``logits_to_keep``):
  rows projected, parameters, multiply-accumulates counted by ``torch.utils.flop_counter``
  (2 FLOPs per MAC; ``aten.mv`` given its formula) and logits produced, compared with :func:`~decodespec.spec.head.head_ledger`
  (rule ``invariant.head_ledger``);
* :func:`check_loss` -- a user's loss/head implementation, a Python callable (``module:function``
  on the command line, ``decodespec head-check``), against the float64 reference on a fixed set
  of cases (:func:`loss_cases`: uneven ignored rows, no bias, label smoothing, logits near
  +-1e4, ``-inf`` column masks, one supervised row), in the gate's style: layers in order
  (:data:`LOSS_LAYERS`), the first failure stops the run and names its layer, the spec rule, the
  case, the check, the worst index and both values, under a declared tolerance
  (:data:`LOSS_TOLERANCES`, absolute plus relative to the largest reference magnitude);
* :func:`observe_tying` and :func:`tied_gradient_check` -- weight tying (0x09) read from torch:
  Parameter identity and storage, equal values, optimizer entries and moment slots, judged by
  :func:`~decodespec.spec.head_tying.tying_violations`; and the shared table's ``.grad`` against the
  sparse input scatter plus the dense classifier term (:func:`~decodespec.spec.head_tying.tied_gradient`).
  :func:`untie_by_copy` is the loader bug it must catch (``mutant.head_copy_not_tie``);
* :data:`LOSS_MUTANTS` -- broken loss implementations from the failure lab (chunk-mean
  averaging, a valid count over all rows, the non-target smoothing convention, trained ignored
  rows, a dropped bias gradient), each a ``mutant.head_*`` rule, which :func:`check_loss` must kill; and correct
  schedules (:func:`torch_reference`, :func:`torch_chunked`, :func:`torch_tiled`) it must pass.

The user callable's interface (:data:`LOSS_INTERFACE`)::

    fn(hidden [R, d], weight [V, d], bias [V] | None, labels int64 [R], *,
       ignore_index: int, label_smoothing: float)
      -> {"row_losses": [R], "loss_sum": [], "valid_count": int | [], "loss": []}

(or the tuple ``(row_losses, loss_sum, valid_count, loss)``); ``row_losses`` is 0 on ignored rows
(PyTorch ``reduction="none"``), ``loss`` is the token mean, differentiable in ``hidden``,
``weight`` and ``bias``.  ``label_smoothing`` means the ``ALL_CLASSES`` convention (PyTorch/HF).

Source: M3.8 0x02 "Parameter and logical-work ledger", 0x05 "Exact conformance checks", 0x0A
(row scope), 0x11 "Evaluation ladder" (head unit, normalization, training schedule), 0x12 items
20, 51, 52.

Size: one check of a model's output head and a user's loss against spec/head*.py: reading the head
from each runtime, the loss schedules, tying and the report.
"""

from __future__ import annotations

import collections
import importlib
import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from decodespec.spec.errors import Rejection, register_code
from decodespec.spec.head import IGNORE_INDEX, HeadLedger, HeadShape, head_ledger
from decodespec.spec.head_loss import (
    HALF_DTYPES,
    UNIT_ROUNDOFF,
    LossSpec,
    PrecisionPolicy,
    accumulation_violations,
    gamma,
    head_gradients,
    loss_error_bound,
    materialized_loss,
    rng_violations,
)
from decodespec.spec.head_tying import TyingLayout, TyingObservation, tied_gradient
from decodespec.spec.rules import Rule, register

__all__ = [
    "FAILED",
    "INVALID_CALLABLE",
    "LOSS_INTERFACE",
    "LOSS_LAYERS",
    "LOSS_MUTANTS",
    "LOSS_TOLERANCES",
    "PASSED",
    "TYING_MUTANTS",
    "HeadMeasurement",
    "HeadVerdict",
    "LossCase",
    "LossTolerance",
    "TiedGradientReport",
    "check_loss",
    "head_shape_of",
    "load_callable",
    "loss_cases",
    "measure_head",
    "observe_tying",
    "tied_gradient_check",
    "torch_chunked",
    "torch_reference",
    "torch_tiled",
    "untie_by_copy",
]

PASSED, FAILED = "passed", "failed"

INVALID_CALLABLE = register_code(
    "head.invalid_callable", "rejection", "M3.8 0x05 The training interface: all supervised rows",
    "The loss implementation named for head-check is not 'module:function', its module cannot be imported, or the name is not "
    "a callable; nothing was run.",
)

LOSS_INTERFACE = ("fn(hidden [R, d], weight [V, d], bias [V] | None, labels int64 [R], *, ignore_index, label_smoothing) "
                  "-> {row_losses [R], loss_sum [], valid_count, loss []}")


def head_shape_of(model: Any) -> HeadShape:
    """The :class:`~decodespec.spec.head.HeadShape` of a ``LlamaForCausalLM`` (ours or HF's), read from its Parameters.

    ``tied`` is Parameter identity (``lm_head.weight is embed_tokens.weight``), never equal values
    (M3.8 0x09).
    """
    head = model.lm_head
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.model.embed_tokens
    v, d = head.weight.shape
    return HeadShape(vocab_size=int(v), hidden_size=int(d), bias=head.bias is not None, tied=head.weight is embed.weight)


@attrs.frozen
class HeadMeasurement:
    """What the model's head did in one call, beside the ledger the spec predicts for it.

    Attributes:
        shape: The head read from the model.
        measured: Rows, parameters and MACs observed (``new_parameters``: head Parameters not
            shared with the embedding; ``macs``: FLOPs of the ``lm_head`` module / 2).
        expected: :func:`~decodespec.spec.head.head_ledger` for the rows the call kept.
    """

    shape: HeadShape
    measured: HeadLedger
    expected: HeadLedger

    @property
    def agrees(self) -> bool:
        """Whether the measurement equals the spec's ledger."""
        return self.measured == self.expected


def _mv_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``aten.mv``: ``[out, in] @ [in]`` is ``2 * out * in``."""
    return 2 * int(a_shape[0]) * int(a_shape[1])


def measure_head(model: Any, input_ids: Any, logits_to_keep: Any = 0, *, expected_rows: int | None = None) -> HeadMeasurement:
    """Run one model call under a FLOP counter and compare the head's work with the ledger.

    Args:
        model: Our :class:`~decodespec.impl.model.LlamaForCausalLM` (torch decode kernel).
        input_ids: ``int64[B, T]``.
        logits_to_keep: As the model's ``forward`` (0 all rows, n the last n, a tensor of rows).
        expected_rows: R the caller's row scope promises (default: ``B * T_kept`` from the
            returned logits, which checks only the MAC and parameter accounting).

    Returns:
        :class:`HeadMeasurement`.

    Shapes: logits ``[B, T_kept, V]``; R = ``B * T_kept``.
    Units: parameters and MACs as element counts.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    shape = head_shape_of(model)
    # A single row goes through torch.mv (impl.model.project), which the counter has no formula for.
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping={torch.ops.aten.mv: _mv_flops}) as counter:
        logits = model(input_ids, logits_to_keep=logits_to_keep).logits  # [B, T_kept, V]
    flops = sum(n for name, ops in counter.get_flop_counts().items() if name.endswith("lm_head") for n in ops.values())
    embed = model.model.embed_tokens.weight
    own = sum(p.numel() for p in model.lm_head.parameters() if p is not embed)
    rows = int(logits.shape[0] * logits.shape[1])
    measured = HeadLedger(num_rows=rows, head_parameters=sum(p.numel() for p in model.lm_head.parameters()),
                          new_parameters=int(own), macs=int(flops) // 2, logit_elements=int(logits.numel()))
    return HeadMeasurement(shape, measured, head_ledger(shape, rows if expected_rows is None else expected_rows))


# -- the loss checker ------------------------------------------------------------------------------

#: Layers of :func:`check_loss`, in order, with the spec rule each one enforces.
LOSS_LAYERS: dict[str, str] = {
    "INTERFACE": "invariant.head_equation",
    "ROWS": "invariant.head_loss_row",
    "REDUCTION": "invariant.head_mean_from_sum_and_count",
    "GRADIENT": "invariant.head_gradients",
}


@attrs.frozen
class LossTolerance:
    """Declared tolerance of one dtype: ``|actual - expected| <= atol + rtol * max|expected|`` (finite entries).

    Non-finite reference entries (``+inf`` losses) must be matched exactly; the valid count is
    always exact.
    """

    atol: float
    rtol: float

    def bound(self, expected: np.ndarray) -> float:
        """The bound for one compared array."""
        fin = expected[np.isfinite(expected)]
        return self.atol + self.rtol * (float(np.abs(fin).max()) if fin.size else 0.0)


#: Declared tolerances per dtype the candidate runs in (the reference is float64).  float32 allows
#: the rounding of an R x V x d product near 1e4 (about 1e-7 relative per operation, times the
#: reduction lengths of these small cases) with two orders of headroom.
LOSS_TOLERANCES: dict[str, LossTolerance] = {
    "float64": LossTolerance(atol=1e-10, rtol=1e-10),
    "float32": LossTolerance(atol=1e-5, rtol=2e-5),
}


@attrs.frozen(eq=False)
class LossCase:
    """One checker case: float64 inputs and the declared loss contract.

    Shapes: hidden ``[R, d]``, weight ``[V, d]``, bias ``[V]`` or ``None``, labels ``[R]``.
    """

    name: str
    hidden: np.ndarray
    weight: np.ndarray
    bias: np.ndarray | None
    labels: np.ndarray
    spec: LossSpec = attrs.field(factory=LossSpec)


def loss_cases(seed: int = 20) -> list[LossCase]:
    """The checker's cases, drawn from ``numpy.random.default_rng(seed)``.

    ``plain`` (R=7, V=13, d=5, bias); ``ignored_uneven`` (R=11, five ignored rows clustered at the
    front, so chunk means and a count over all rows give another mean); ``no_bias``;
    ``label_smoothing`` (eps = 0.1, ALL_CLASSES); ``extreme_logits`` (logits near +-1e4);
    ``masked_columns`` (``-inf`` bias on three columns no label uses); ``one_supervised_row``.

    Source: M3.8 0x05 "Exact conformance checks" items 1-5.
    """
    rng = np.random.default_rng(seed)

    def draw(r: int, v: int, d: int, bias: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        return (rng.normal(size=(r, d)), rng.normal(size=(v, d)), rng.normal(size=v) if bias else None,
                rng.integers(0, v, size=r))

    cases = []
    h, e, b, y = draw(7, 13, 5)
    cases.append(LossCase("plain", h, e, b, y))
    h, e, b, y = draw(11, 13, 5)
    y[[0, 1, 2, 3, 8]] = IGNORE_INDEX
    cases.append(LossCase("ignored_uneven", h, e, b, y))
    h, e, _, y = draw(6, 9, 4, bias=False)
    y[4] = IGNORE_INDEX
    cases.append(LossCase("no_bias", h, e, None, y))
    h, e, b, y = draw(9, 13, 5)
    y[[1, 7]] = IGNORE_INDEX
    cases.append(LossCase("label_smoothing", h, e, b, y, LossSpec(label_smoothing=0.1)))
    h, e, b, y = draw(5, 11, 4)
    h = h / np.linalg.norm(h, axis=1, keepdims=True) * 100.0
    e = e / np.linalg.norm(e, axis=1, keepdims=True) * 100.0  # |z| up to 1e4
    y[2] = IGNORE_INDEX
    cases.append(LossCase("extreme_logits", h, e, b * 1e3, y))
    h, e, b, y = draw(8, 12, 4)
    b[[0, 5, 11]] = -np.inf
    y = np.where(np.isin(y, [0, 5, 11]), 3, y)
    y[6] = IGNORE_INDEX
    cases.append(LossCase("masked_columns", h, e, b, y))
    h, e, b, y = draw(6, 10, 3)
    y[[0, 1, 2, 4, 5]] = IGNORE_INDEX
    cases.append(LossCase("one_supervised_row", h, e, b, y))
    return cases


@attrs.frozen
class HeadVerdict:
    """The outcome of :func:`check_loss`.

    Attributes:
        result: ``passed`` or ``failed``.
        layer: The first layer that failed (:data:`LOSS_LAYERS`), else ``None``.
        rule: The spec rule of that layer.
        case: The case it failed on.
        check: The named check (``row_losses``, ``ignored_rows``, ``loss_sum``, ``valid_count``,
            ``loss``, ``grad.hidden``, ``grad.weight``, ``grad.bias``, ``call``, ``outputs``).
        index: The worst coordinate (a list of ints) or ``None``.
        expected, actual: The reference and candidate values there.
        bound: The declared tolerance applied (``None`` for exact checks).
        message: One sentence.
        cases_run: How many cases were checked (all of them when passed).
    """

    result: str
    layer: str | None = None
    rule: str | None = None
    case: str | None = None
    check: str | None = None
    index: list[int] | None = None
    expected: Any = None
    actual: Any = None
    bound: float | None = None
    message: str = ""
    cases_run: int = 0

    @property
    def passed(self) -> bool:
        """Whether every case passed every layer."""
        return self.result == PASSED

    def to_json(self) -> dict[str, Any]:
        """The verdict as JSON (non-finite numbers as strings)."""
        def j(x: Any) -> Any:
            return x if not isinstance(x, float) or math.isfinite(x) else repr(x)
        return {k: j(v) for k, v in attrs.asdict(self).items()}


class _Fail(Exception):
    def __init__(self, layer: str, check: str, message: str, **kw: Any):
        super().__init__(message)
        self.layer, self.check, self.message, self.kw = layer, check, message, kw


def _compare(layer: str, check: str, expected: np.ndarray, actual: np.ndarray, tol: LossTolerance,
             rows: np.ndarray | None = None) -> None:
    """Raise :class:`_Fail` at the worst entry beyond ``tol``; ``rows`` maps a first index back to the case's row ids."""
    expected, actual = np.asarray(expected, np.float64), np.asarray(actual, np.float64)
    if expected.shape != actual.shape:
        raise _Fail(layer, check, f"{check} has shape {actual.shape}, expected {expected.shape}")
    bound = tol.bound(expected)
    fin = np.isfinite(expected)
    with np.errstate(invalid="ignore"):
        err = np.where(fin, np.abs(actual - expected), np.where(actual == expected, 0.0, np.inf))
    err = np.where(np.isnan(err), np.inf, err)
    if err.size and float(err.max()) > bound:
        idx = np.unravel_index(int(np.argmax(err)), err.shape)
        where = [int(i) for i in idx]
        if rows is not None:
            where[0] = int(rows[where[0]])
        at = f" at {where}" if where else ""
        raise _Fail(layer, check, f"{check} differs{at}: {float(actual[idx])!r} vs reference "
                    f"{float(expected[idx])!r} (|diff| {float(err[idx]):.3g} > {bound:.3g})",
                    index=where or None, expected=float(expected[idx]), actual=float(actual[idx]), bound=bound)


def _outputs(out: Any) -> tuple[Any, Any, Any, Any]:
    if isinstance(out, Mapping):
        missing = [k for k in ("row_losses", "loss_sum", "valid_count", "loss") if k not in out]
        if missing:
            raise _Fail("INTERFACE", "outputs", f"the result lacks {missing}; the interface is {LOSS_INTERFACE}")
        return out["row_losses"], out["loss_sum"], out["valid_count"], out["loss"]
    if isinstance(out, (tuple, list)) and len(out) == 4:
        return tuple(out)  # type: ignore[return-value]
    raise _Fail("INTERFACE", "outputs", f"the result is a {type(out).__name__}; the interface is {LOSS_INTERFACE}")


def _rounded(case: LossCase, dtype: str) -> LossCase:
    """``case`` with hidden, weight and bias rounded to ``dtype`` (float64 values): what a 16-bit candidate sees."""
    import torch

    def r(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else torch.tensor(x, dtype=getattr(torch, dtype)).double().numpy()

    return LossCase(case.name, r(case.hidden), r(case.weight), r(case.bias), case.labels, case.spec)  # type: ignore[arg-type]


def derived_tolerances(case: LossCase, policy: PrecisionPolicy) -> dict[str, LossTolerance]:
    """Per-check tolerances of a 16-bit candidate, derived from :func:`~decodespec.spec.head_loss.loss_error_bound`.

    Keys ``row_losses``, ``loss_sum``, ``loss``, ``grad.hidden``, ``grad.weight``, ``grad.bias``;
    each is absolute (``rtol = 0``).  With ``N`` supervised rows and a logit-gradient entry error
    of at most ``grad / N``: ``dH = G E`` moves by ``grad / N * max_k sum_v |E_vk|`` (plus its own
    rounding, ``gamma_V(u_acc) + u_in`` of the same scale), ``dE = G^T H`` by ``grad / N * max_k
    sum_r |H_rk|``, ``db`` by ``grad``.  Source: M3.8 0x04 "Dtype and degenerate-row policy".
    """
    b = loss_error_bound(policy, case.hidden, case.weight, case.bias)
    n = max(1, int(np.sum(np.asarray(case.labels) != case.spec.ignore_index)))
    u_in, u_acc = UNIT_ROUNDOFF[policy.input_dtype], UNIT_ROUNDOFF[policy.accumulation_dtype]
    v, r = case.weight.shape[0], case.hidden.shape[0]
    g_h = (b.grad + gamma(v, u_acc) + u_in) / n * float(np.abs(case.weight).sum(axis=0).max())
    g_w = (b.grad + gamma(r, u_acc) + u_in) / n * float(np.abs(case.hidden).sum(axis=0).max())
    g_b = (b.grad + gamma(r, u_acc) + u_in)
    return {"row_losses": LossTolerance(b.row, 0.0), "loss_sum": LossTolerance(b.row * n, 0.0), "loss": LossTolerance(b.row, 0.0),
            "grad.hidden": LossTolerance(g_h, 0.0), "grad.weight": LossTolerance(g_w, 0.0), "grad.bias": LossTolerance(g_b, 0.0)}


def _check_case(fn: Callable[..., Any], case: LossCase, dtype: str, tol: LossTolerance | Mapping[str, LossTolerance]) -> None:
    import torch

    tols: Mapping[str, LossTolerance] = tol if isinstance(tol, Mapping) else collections.defaultdict(lambda: tol)
    tdt = getattr(torch, dtype)
    hidden = torch.tensor(case.hidden, dtype=tdt, requires_grad=True)
    weight = torch.tensor(case.weight, dtype=tdt, requires_grad=True)
    bias = None if case.bias is None else torch.tensor(case.bias, dtype=tdt, requires_grad=True)
    labels = torch.tensor(case.labels, dtype=torch.int64)
    global_before = torch.get_rng_state().numpy().tobytes()
    try:
        out = fn(hidden, weight, bias, labels, ignore_index=case.spec.ignore_index, label_smoothing=case.spec.label_smoothing)
    except Exception as exc:  # noqa: BLE001 - the candidate's own failure is a verdict, not a crash of the checker
        raise _Fail("INTERFACE", "call", f"the implementation raised {type(exc).__name__}: {exc}") from None
    drew = rng_violations(global_before, torch.get_rng_state().numpy().tobytes())
    if drew:
        raise _Fail("INTERFACE", "rng", f"the loss call consumed random state ({', '.join(drew)}); the head and its loss are "
                    "deterministic and never draw from a sampling stream", rule="invariant.head_loss_rng_free")
    rows, total, count, loss = _outputs(out)
    ref = materialized_loss(case.hidden, case.weight, case.bias, case.labels, case.spec)

    def arr(x: Any, name: str) -> np.ndarray:
        try:
            return np.asarray(x.detach().double().cpu().numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
        except (TypeError, ValueError):
            raise _Fail("INTERFACE", "outputs", f"{name} is not numeric ({type(x).__name__})") from None

    row_arr = arr(rows, "row_losses")
    if row_arr.shape != ref.row_losses.shape:
        raise _Fail("INTERFACE", "outputs", f"row_losses has shape {row_arr.shape}, expected [R] = {ref.row_losses.shape}")
    # ROWS: supervised rows against m + log s - z_y; ignored rows contribute exactly nothing.
    _compare("ROWS", "row_losses", ref.row_losses[ref.valid], row_arr[ref.valid], tols["row_losses"], rows=np.flatnonzero(ref.valid))
    ignored = np.flatnonzero(~ref.valid)
    if ignored.size and np.any(row_arr[ignored] != 0.0):
        r = int(ignored[np.flatnonzero(row_arr[ignored] != 0.0)[0]])
        raise _Fail("ROWS", "ignored_rows", f"ignored row {r} (label {case.spec.ignore_index}) has loss {float(row_arr[r])!r}, not 0",
                    index=[r], expected=0.0, actual=float(row_arr[r]))
    # REDUCTION: the loss sum, the exact valid count and the mean = sum / count.
    _compare("REDUCTION", "loss_sum", np.array(ref.loss_sum), arr(total, "loss_sum"), tols["loss_sum"])
    n = arr(count, "valid_count")
    if n.shape != () or float(n) != ref.valid_count:
        shown = int(n) if n.shape == () and float(n).is_integer() else n.tolist()
        raise _Fail("REDUCTION", "valid_count", f"valid_count is {shown}, the supervised rows are {ref.valid_count}",
                    expected=ref.valid_count, actual=shown)
    _compare("REDUCTION", "loss", np.array(ref.mean), arr(loss, "loss"), tols["loss"])
    # GRADIENT: autograd of the candidate's mean against G = (P - Q) / N, dH = G E, dE = G^T H, db = sum G.
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise _Fail("GRADIENT", "loss", "loss is not a differentiable tensor of hidden, weight and bias")
    grads = torch.autograd.grad(loss, [t for t in (hidden, weight, bias) if t is not None], allow_unused=True)
    want = head_gradients(case.hidden, case.weight, case.bias, case.labels, case.spec)
    for name, g, w in zip(("hidden", "weight", "bias"), grads, (want.hidden, want.weight, want.bias)):
        got = np.zeros_like(w) if g is None else g.detach().double().numpy()
        _compare("GRADIENT", f"grad.{name}", w, got, tols[f"grad.{name}"])


def check_loss(fn: Callable[..., Any], *, dtype: str = "float64", cases: list[LossCase] | None = None,
               accumulation_dtype: str | None = None) -> HeadVerdict:
    """Check a loss/head implementation against the float64 reference, layer by layer, stopping at the first failure.

    Args:
        fn: The candidate, with the interface :data:`LOSS_INTERFACE`.
        dtype: ``"float64"`` or ``"float32"``: the dtype of the tensors the candidate gets; its
            tolerance is :data:`LOSS_TOLERANCES` ``[dtype]``.  ``"bfloat16"`` or ``"float16"``: the
            reference runs on the same rounded inputs and the tolerances are derived from the unit
            roundoffs of ``dtype`` and ``accumulation_dtype`` (:func:`derived_tolerances`).
        accumulation_dtype: The candidate's declared accumulation dtype (default float32 for
            16-bit inputs, else ``dtype``), judged by ``invariant.head_accumulation_dtype`` before
            any call (a failure at INTERFACE).
        cases: Default :func:`loss_cases`.

    Returns:
        :class:`HeadVerdict`: ``passed`` after every case, else the first failure.

    Raises:
        Rejection: ``head.invalid_input`` for an unknown dtype (before any call).

    Source: M3.8 0x05 "Exact conformance checks" (per-row loss before reduction; valid-row
    sum, count and final reduction; gradients for hidden rows, weight and bias; extreme logits,
    ignored rows, label smoothing); 0x11 "Evaluation ladder".
    """
    from decodespec.spec.head import INVALID_INPUT

    if dtype not in LOSS_TOLERANCES and dtype not in HALF_DTYPES:
        raise Rejection(INVALID_INPUT, f"dtype must be one of {sorted(LOSS_TOLERANCES) + list(HALF_DTYPES)}, got {dtype!r}", "$.dtype")
    if accumulation_dtype is None:
        accumulation_dtype = "float32" if dtype in HALF_DTYPES else dtype
    policy = PrecisionPolicy(dtype, accumulation_dtype)
    bad = accumulation_violations(policy)
    if bad:
        return HeadVerdict(FAILED, "INTERFACE", "invariant.head_accumulation_dtype", None, "accumulation_dtype", None, accumulation_dtype,
                           dtype, None, f"declared accumulation {accumulation_dtype} for {dtype} inputs breaks the dtype contract: "
                           f"{list(bad)}", 0)
    run = loss_cases() if cases is None else cases
    for i, case in enumerate(run):
        if dtype in HALF_DTYPES:
            case = _rounded(case, dtype)  # the reference judges the inputs the candidate actually got
            tol: LossTolerance | Mapping[str, LossTolerance] = derived_tolerances(case, policy)
        else:
            tol = LOSS_TOLERANCES[dtype]
        try:
            _check_case(fn, case, dtype, tol)
        except _Fail as f:
            return HeadVerdict(FAILED, f.layer, f.kw.get("rule", LOSS_LAYERS[f.layer]), case.name, f.check, f.kw.get("index"), f.kw.get("expected"),
                               f.kw.get("actual"), f.kw.get("bound"), f.message, i + 1)
    return HeadVerdict(PASSED, cases_run=len(run))


def load_callable(spec: str) -> Callable[..., Any]:
    """The callable named ``module:function`` (``function`` may be dotted); the current folder is importable.

    Raises:
        Rejection: ``head.invalid_callable`` (no colon, import error, missing or non-callable name).
    """
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname:
        raise Rejection(INVALID_CALLABLE, f"expected 'module:function', got {spec!r}", "$.implementation")
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure of the candidate is a typed refusal
        raise Rejection(INVALID_CALLABLE, f"cannot import {module_name!r}: {type(exc).__name__}: {exc}", "$.implementation") from None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise Rejection(INVALID_CALLABLE, f"{module_name!r} has no attribute {qualname!r}", "$.implementation")
        obj = getattr(obj, part)
    if not callable(obj):
        raise Rejection(INVALID_CALLABLE, f"{spec!r} is not callable", "$.implementation")
    return obj


# -- correct schedules (torch) the checker must pass -----------------------------------------------

def _result(rows: Any, labels: Any, ignore_index: int) -> dict[str, Any]:
    valid_count = int((labels != ignore_index).sum())
    total = rows.sum()
    return {"row_losses": rows, "loss_sum": total, "valid_count": valid_count, "loss": total / valid_count}


def torch_reference(hidden: Any, weight: Any, bias: Any, labels: Any, *, ignore_index: int = IGNORE_INDEX,
                    label_smoothing: float = 0.0) -> dict[str, Any]:
    """Materialized schedule with ``F.linear`` and ``F.cross_entropy(reduction="none")`` (PyTorch's ALL_CLASSES smoothing).

    Shapes: as :data:`LOSS_INTERFACE`.
    """
    import torch.nn.functional as F

    logits = F.linear(hidden, weight, bias)  # [R, V]
    rows = F.cross_entropy(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")  # [R]
    return _result(rows, labels, ignore_index)


def torch_chunked(hidden: Any, weight: Any, bias: Any, labels: Any, *, ignore_index: int = IGNORE_INDEX,
                  label_smoothing: float = 0.0, chunk: int = 3) -> dict[str, Any]:
    """Row-chunked schedule: ``[C, V]`` logits per chunk, loss sum and valid count accumulated (M3.8 0x05)."""
    import torch

    parts = [torch_reference(hidden[a:a + chunk], weight, bias, labels[a:a + chunk], ignore_index=ignore_index,
                             label_smoothing=label_smoothing)["row_losses"] for a in range(0, hidden.shape[0], chunk)]
    return _result(torch.cat(parts), labels, ignore_index)


def torch_tiled(hidden: Any, weight: Any, bias: Any, labels: Any, *, ignore_index: int = IGNORE_INDEX,
                label_smoothing: float = 0.0, tile: int = 4) -> dict[str, Any]:
    """Fused-style schedule: vocabulary tiles with an online log-sum-exp; the target logit from its owning tile.

    Loss per row ``m + log s - sum_v q_v z_v`` with ``q`` the ALL_CLASSES target (finite logits
    assumed wherever ``q_v > 0``).  Differentiable through torch autograd.

    Source: M3.8 0x05 (fused linear plus cross-entropy), 0x0A "Exact forward trace over vocabulary shards".
    """
    import torch

    v = weight.shape[0]
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    m = torch.full((hidden.shape[0],), -torch.inf, dtype=hidden.dtype)
    s = torch.zeros(hidden.shape[0], dtype=hidden.dtype)
    target = torch.zeros(hidden.shape[0], dtype=hidden.dtype)
    zsum = torch.zeros(hidden.shape[0], dtype=hidden.dtype)
    for t0 in range(0, v, tile):
        zt = hidden @ weight[t0:t0 + tile].T  # [R, tile]
        if bias is not None:
            zt = zt + bias[t0:t0 + tile]
        m_new = torch.maximum(m, zt.max(dim=1).values.detach())
        s = s * torch.exp(m - m_new).nan_to_num(0.0) + torch.exp(zt - m_new[:, None]).sum(dim=1)
        m = m_new
        owns = (safe >= t0) & (safe < t0 + zt.shape[1])
        local = torch.where(owns, safe - t0, torch.zeros_like(safe))
        target = target + torch.where(owns, zt.gather(1, local[:, None])[:, 0], torch.zeros_like(target))
        if label_smoothing:
            zsum = zsum + torch.where(torch.isfinite(zt), zt, torch.zeros_like(zt)).sum(dim=1)
    lse = m + torch.log(s)
    rows = lse - (1.0 - label_smoothing) * target - (label_smoothing / v) * zsum
    return _result(torch.where(valid, rows, torch.zeros_like(rows)), labels, ignore_index)


# -- failure-lab mutants of a loss implementation --------------------------------------------------

def _chunk_mean(hidden: Any, weight: Any, bias: Any, labels: Any, *, ignore_index: int = IGNORE_INDEX,
                label_smoothing: float = 0.0) -> dict[str, Any]:
    import torch

    out = torch_reference(hidden, weight, bias, labels, ignore_index=ignore_index, label_smoothing=label_smoothing)
    means = []
    for a in range(0, hidden.shape[0], 4):
        n = int((labels[a:a + 4] != ignore_index).sum())
        if n:
            means.append(out["row_losses"][a:a + 4].sum() / n)
    return {**out, "loss": torch.stack(means).mean()}


def _valid_count_all_rows(hidden: Any, weight: Any, bias: Any, labels: Any, *, ignore_index: int = IGNORE_INDEX,
                          label_smoothing: float = 0.0) -> dict[str, Any]:
    out = torch_reference(hidden, weight, bias, labels, ignore_index=ignore_index, label_smoothing=label_smoothing)
    n = int(labels.shape[0])
    return {**out, "valid_count": n, "loss": out["loss_sum"] / n}


def _smoothing_non_target(hidden: Any, weight: Any, bias: Any, labels: Any, *, ignore_index: int = IGNORE_INDEX,
                          label_smoothing: float = 0.0) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    logits = F.linear(hidden, weight, bias)
    v = logits.shape[1]
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    q = torch.full_like(logits, label_smoothing / (v - 1)).scatter(1, safe[:, None], 1.0 - label_smoothing)
    logp = F.log_softmax(logits, dim=-1)
    rows = -(torch.where(q > 0, q * logp, torch.zeros_like(logp))).sum(dim=1)
    return _result(torch.where(valid, rows, torch.zeros_like(rows)), labels, ignore_index)


def _ignored_rows_trained(hidden: Any, weight: Any, bias: Any, labels: Any, *, ignore_index: int = IGNORE_INDEX,
                          label_smoothing: float = 0.0) -> dict[str, Any]:
    import torch

    # The PAD/ignore label clamped into the vocabulary and trained as token 0 (failure lab 0x12 item 20).
    clamped = torch.where(labels == ignore_index, torch.zeros_like(labels), labels)
    out = torch_reference(hidden, weight, bias, clamped, ignore_index=ignore_index, label_smoothing=label_smoothing)
    return {**out, "valid_count": int((labels != ignore_index).sum()), "loss": out["loss_sum"] / int((labels != ignore_index).sum())}


def _bias_gradient_dropped(hidden: Any, weight: Any, bias: Any, labels: Any, *, ignore_index: int = IGNORE_INDEX,
                           label_smoothing: float = 0.0) -> dict[str, Any]:
    # A hand-written backward that forgets db = sum_r G: the forward (and so every loss) is exact.
    return torch_reference(hidden, weight, None if bias is None else bias.detach(), labels, ignore_index=ignore_index,
                           label_smoothing=label_smoothing)


_S12 = "M3.8 0x12 Failure lab"
#: name -> (callable, section, statement).  Each is registered as the rule ``mutant.<name>``.
LOSS_MUTANTS: dict[str, Callable[..., Any]] = {}
for _name, _fn, _title, _section, _statement in (
    ("head_chunk_mean", _chunk_mean, "Averaging chunk means instead of sum over count",
     _S12 + " item 51; M3.8 0x05 Materialized, chunked, and fused execution",
     ("The loss is the mean of per-chunk means (chunks of 4 rows) instead of loss_sum / valid_count: with uneven chunks or "
     "ignored rows clustered in one chunk each row gets the wrong weight; per-row losses and the sum stay right, so only the "
     "REDUCTION layer (loss) can kill it.")),
    ("head_valid_count_all_rows", _valid_count_all_rows, "Dividing by all rows instead of the supervised rows",
     _S12 + " items 20, 51; M3.8 0x05 The training interface: all supervised rows",
     ("The valid count includes rows labelled with the ignore index, so the mean is loss_sum / R instead of loss_sum / |V|; "
     "per-row losses are right, the REDUCTION layer (valid_count) kills it.")),
    ("head_smoothing_non_target", _smoothing_non_target, "Label-smoothing convention mixed (non-target instead of all-class)",
     _S12 + " items 51-52; M3.8 0x04 Label smoothing is a target-distribution contract",
     ("label_smoothing=eps is read as eps / (V - 1) on the non-target classes instead of PyTorch/HF's eps / V on all classes, "
     "target included: without smoothing it is exact, with eps = 0.1 the per-row losses move (ROWS layer).")),
    ("head_ignored_rows_trained", _ignored_rows_trained, "Training ignored rows as token 0",
     _S12 + " item 20; M3.8 0x05 The training interface: all supervised rows",
     ("Rows labelled with the ignore index are clamped to token id 0 and trained: their row losses are non-zero and the sum and "
     "gradients include them, while the count is right (ROWS layer, ignored_rows).")),
    ("head_bias_gradient_dropped", _bias_gradient_dropped, "A backward without the bias gradient",
     _S12 + " item 52; M3.8 0x02 Deriving the complete affine-head backward",
     ("The bias takes no gradient (db = 0 instead of sum_r G) while every loss, the sum, the count and the mean are exact: a "
     "conformance check of the scalar loss alone passes it; the GRADIENT layer (grad.bias) kills it.")),
):
    LOSS_MUTANTS[_name] = _fn
    register(Rule(id=f"mutant.{_name}", kind="mutant", title=_title, section=_section, statement=_statement, obj=_fn))



# -- 0x09: weight tying read from torch ------------------------------------------------------------

def observe_tying_layout(model: Any, *, source_vocab_hash: str | None = None, target_vocab_hash: str | None = None) -> TyingLayout:
    """The storage layout (:class:`~decodespec.spec.head_tying.TyingLayout`) of a ``LlamaForCausalLM`` or an encoder-decoder.

    Identity keys are ``data_ptr`` plus the Python object id of each Parameter: two Parameters
    with equal values get different keys.  A decoder-only model has no source table; the
    Annotated Transformer's :class:`~decodespec.impl.encdec.EncoderDecoder` has
    ``src_embed[0].lut.weight`` (source), ``tgt_embed[0].lut.weight`` (input) and
    ``generator.proj.weight`` (output).  A ``head_projection`` Parameter of the model, if any,
    is the projected-tying transform (its key ``head_projection``).

    Source: M3.8 0x09 "Tying variants are different architectures"; 0x08 (``V_src``, ``V_tgt``).
    """
    def key(p: Any) -> str:
        return f"{id(p)}:{p.data_ptr()}"

    if hasattr(model, "generator") and hasattr(model, "src_embed"):
        src, inp, out = model.src_embed[0].lut.weight, model.tgt_embed[0].lut.weight, model.generator.proj.weight
        width = int(model.generator.proj.in_features)
    else:
        src, inp, out = None, model.model.embed_tokens.weight, model.lm_head.weight
        width = int(model.config.hidden_size)
    proj = getattr(model, "head_projection", None)
    return TyingLayout(key(inp), key(out), int(inp.shape[1]), width, None if src is None else key(src), source_vocab_hash,
                       target_vocab_hash, None if proj is None else tuple(int(x) for x in proj.shape),
                       None if proj is None else "head_projection")



def observe_tying(model: Any, optimizer: Any = None, *, declared_tied: bool | None = None) -> TyingObservation:
    """The tying facts of a ``LlamaForCausalLM`` (and, when given, its optimizer).

    Args:
        model: Ours or HF's (``model.model.embed_tokens``, ``model.lm_head``).
        optimizer: A ``torch.optim.Optimizer`` over the model, or ``None``.
        declared_tied: The declaration to judge against (default the model config's
            ``tie_word_embeddings``).

    Returns:
        :class:`~decodespec.spec.head_tying.TyingObservation`; judge it with
        :func:`~decodespec.spec.head_tying.tying_violations`.

    Source: M3.8 0x09 (``lm_head.weight is embed_tokens.weight``, ``data_ptr`` equality), 0x08
    step 6 (one optimizer state per shared Parameter).
    """
    import torch

    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    declared = bool(model.config.tie_word_embeddings) if declared_tied is None else bool(declared_tied)
    equal = head.shape == embed.shape and bool(torch.equal(head.detach(), embed.detach()))
    entries = states = None
    if optimizer is not None:
        owned = [p for group in optimizer.param_groups for p in group["params"] if p is embed or p is head]
        entries = len(owned)
        states = sum(1 for p in {id(p): p for p in owned}.values() if optimizer.state.get(p))
        states = states if any(optimizer.state.values()) else None
    return TyingObservation(declared_tied=declared, same_parameter=head is embed, same_storage=head.data_ptr() == embed.data_ptr(),
                            equal_values=equal, optimizer_entries=entries, optimizer_states=states)


def untie_by_copy(model: Any) -> Any:
    """The loader bug of M3.8 0x09: materialize ``lm_head.weight`` as a second Parameter holding the embedding's values.

    Returns ``model`` (changed in place): equal values, two Parameters, two optimizer slots.
    """
    import torch

    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    return model


#: Loader mutants (a function that breaks a loaded model in place), each a ``mutant.<name>`` rule.
TYING_MUTANTS: dict[str, Callable[[Any], Any]] = {"head_copy_not_tie": untie_by_copy}
register(Rule(id="mutant.head_copy_not_tie", kind="mutant", title="A loader that copies the embedding into a second head Parameter",
              section=_S12 + " items 28, 56; M3.8 0x09 Weight tying: shared storage, not similar shape",
              statement="The loader materializes lm_head.weight as its own Parameter holding the embedding's values (a copy, not a "
              "tie): the values agree, so logits match, but the optimizer keeps two slots and the classifier gradient lands in "
              "another buffer; observe_tying reports copied_not_tied and optimizer_duplicate, tied_gradient_check finds the output "
              "term missing from the embedding's gradient.", obj=untie_by_copy))


@attrs.frozen
class TiedGradientReport:
    """One backward pass of a tied (or supposedly tied) model, split into the two contributions.

    Attributes:
        shared: Whether the head and embedding were one Parameter.
        max_error: ``max |E.grad - (input_part + output_part)|``.
        bound: The declared bound (float32: ``1e-6 + 1e-5 * max|expected|``).
        input_rows: Vocabulary rows the input scatter touched (the distinct input ids).
        output_rows: Vocabulary rows with a non-zero classifier term (dense: about V).
    """

    shared: bool
    max_error: float
    bound: float
    input_rows: int
    output_rows: int

    @property
    def accumulated(self) -> bool:
        """Whether one buffer holds both contributions within the bound."""
        return self.max_error <= self.bound


def tied_gradient_check(model: Any, input_ids: Any, labels: Any) -> TiedGradientReport:
    """Run one cross-entropy backward and compare ``embed_tokens.weight.grad`` with the two tied contributions.

    The model's parameters' ``.grad`` are restored afterwards; hooks are removed.

    Args:
        model: Our ``LlamaForCausalLM`` (float32).
        input_ids: ``int64[B, T]``.
        labels: ``int64[B, T]`` next-token labels (``-100`` ignored).

    Returns:
        :class:`TiedGradientReport`.

    Source: M3.8 0x09 "Tied parameters receive two semantic gradient contributions".
    """
    import torch
    import torch.nn.functional as F

    embed = model.model.embed_tokens.weight
    saved = {id(p): p.grad for p in model.parameters()}
    captured: dict[str, Any] = {}

    def on_embed(_m: Any, _i: Any, out: Any) -> None:
        out.retain_grad()
        captured["embedded"] = out

    def on_head(_m: Any, inputs: Any, out: Any) -> None:
        out.retain_grad()
        captured["hidden"], captured["logits"] = inputs[0], out

    hooks = [model.model.embed_tokens.register_forward_hook(on_embed), model.lm_head.register_forward_hook(on_head)]
    try:
        for p in model.parameters():
            p.grad = None
        with torch.enable_grad():
            logits = model(input_ids).logits  # [B, T, V]
            v = logits.shape[-1]
            loss = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), ignore_index=IGNORE_INDEX)
            loss.backward()
        grad = embed.grad.detach().double().numpy() if embed.grad is not None else np.zeros(tuple(embed.shape))
        input_part, output_part = tied_gradient(
            input_ids.reshape(-1).numpy(), captured["embedded"].grad.reshape(-1, embed.shape[1]).double().numpy(),
            captured["logits"].grad.reshape(-1, v).double().numpy(), captured["hidden"].detach().reshape(-1, embed.shape[1]).double().numpy(),
            v)
    finally:
        for h in hooks:
            h.remove()
        for p in model.parameters():
            p.grad = saved.get(id(p))
    want = input_part + output_part
    bound = 1e-6 + 1e-5 * float(np.abs(want).max())
    return TiedGradientReport(shared=model.lm_head.weight is embed, max_error=float(np.abs(grad - want).max()), bound=bound,
                              input_rows=int((np.abs(input_part).sum(axis=1) > 0).sum()),
                              output_rows=int((np.abs(output_part).sum(axis=1) > 0).sum()))
