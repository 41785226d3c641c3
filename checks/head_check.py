"""M3.8 0x02, 0x05, 0x09: check a model's output head and a user's loss implementation against spec/head.py.

Three checks, each against the pure float64 reference in :mod:`decodespec.spec.head`:

* :func:`measure_head` -- what our model's ``lm_head`` does for a row scope (``logits_to_keep``):
  rows projected, parameters, multiply-accumulates counted by ``torch.utils.flop_counter``
  (2 FLOPs per MAC; ``aten.mv`` given its formula) and logits produced, compared with :func:`~decodespec.spec.head.head_ledger`
  (rule ``invariant.head_ledger``).

Source: M3.8 0x02 "Parameter and logical-work ledger", 0x0A (row scope), 0x11 "Evaluation ladder".
"""

from __future__ import annotations

from typing import Any

import attrs

from decodespec.spec.head import HeadLedger, HeadShape, head_ledger

__all__ = ["HeadMeasurement", "head_shape_of", "measure_head"]


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
