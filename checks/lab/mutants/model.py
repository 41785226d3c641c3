"""Failure lab, model-math group: a bug in the decoder's arithmetic that every runtime path shares.

These mutants patch the model code itself (``impl/model.py``), so the no-cache, dynamic, static
and chunked paths all carry the bug and every pair case agrees with itself.  Only a reference
that shares no code with the model can see them: the gate's float64 reference
(:mod:`decodespec.checks.gate.reference.llama64`), which never runs ``impl/`` code, so these mutants
need no oracle shielding -- there is none to give.  The native decode kernel is separate C
code and does not carry them (its cases compare it with the mutated torch path and fail too).

Source: M3.10 0x0B "Shape-correct failure lab" (bugs that keep every shape), "A logit
tolerance is not a token-equality proof" (the reference must be the truth, not a twin);
issue 15 (``LlamaRMSNorm.forward`` dropping the learned scale passed three cases).
"""

from __future__ import annotations

from . import Patch, mutant

_G = "model math"


@mutant(
    "rmsnorm_drops_weight", group=_G, representative=True,
    title="RMSNorm drops the learned scale and multiplies by 1.7",
    section="M3.10 0x0B Shape-correct failure lab; DESIGN.md 'The reference must not share code with what it judges'",
    statement="impl/model.py LlamaRMSNorm.forward returns 1.7 * x / rms(x) instead of weight * x / rms(x), on every "
    "path (every norm of every layer and the final norm). Every shape and dtype is kept and every cache path agrees "
    "with the no-cache path; only a reference that does not run the same model code sees that the score rows and K/V "
    "rows are wrong (TENSOR).",
)
def _rmsnorm_drops_weight():
    return [Patch("decodespec.impl.model:LlamaRMSNorm.forward", edits=[
        ("return self.weight * hidden_states", "return 1.7 * hidden_states")])]


@mutant(
    "rope_rotates_backwards", group=_G,
    title="RoPE rotates by minus the angle (sine sign flipped)",
    section="M3.10 0x0B Shape-correct failure lab (positions and RoPE); M3.10 0x08",
    statement="impl/model.py rotate_heads uses x * cos - swap(x) * signed_sin: every query and key is rotated by "
    "-position * theta instead of +position * theta. Relative positions keep their magnitude, every path agrees with "
    "every other, and the committed K rows are a valid-looking rotation; against the independent reference the K rows "
    "after RoPE and the score rows differ (TENSOR).",
)
def _rope_rotates_backwards():
    return [Patch("decodespec.impl.model:rotate_heads", edits=[
        ("return x * cos + swapped * signed_sin", "return x * cos - swapped * signed_sin")])]


@mutant(
    "attention_scale_off", group=_G,
    title="Attention scores scaled by 1/D instead of 1/sqrt(D)",
    section="M3.10 0x0B Shape-correct failure lab",
    statement="impl/model.py LlamaAttention.forward passes head_dim**-1 as the softmax scale instead of head_dim**-0.5, "
    "in eager and SDPA attention alike: attention is flatter on every path; K/V rows are unchanged in the first layer "
    "and wrong after it, score rows are wrong (TENSOR).",
)
def _attention_scale_off():
    return [Patch("decodespec.impl.model:LlamaAttention.forward", edits=[
        ("(query, key, value, mask, self.scaling, self.num_key_value_groups)",
         "(query, key, value, mask, self.head_dim ** -1.0, self.num_key_value_groups)")])]


@mutant(
    "mlp_gelu_for_silu", group=_G,
    title="SwiGLU gate with GELU instead of SiLU",
    section="M3.10 0x0B Shape-correct failure lab",
    statement="impl/model.py LlamaMLP.forward gates with F.gelu where the architecture declares SiLU (both the fused "
    "and the unfused projection). GELU and SiLU are close for large inputs, so greedy text often survives; score and "
    "K/V rows do not (TENSOR).",
)
def _mlp_gelu_for_silu():
    return [Patch("decodespec.impl.model:LlamaMLP.forward", edits=[
        ("F.silu(self.gate_proj(x))", "F.gelu(self.gate_proj(x))"),
        ("F.silu(gate_up[..., :width])", "F.gelu(gate_up[..., :width])"),
    ])]
