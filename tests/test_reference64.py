"""The gate's float64 reference: independent of impl/, exact dequantization, equal to HF in float64.

Source: M3.10 "A logit tolerance is not a token-equality proof"; DESIGN.md "The reference must
not share code with what it judges"; issue 15 item 1.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from decodespec.checks.gate.reference import Reference64, dequantize64, load_gguf64
from decodespec.checks.gate.reference.files import gguf_path
from decodespec.checks.testing import SMOLLM2_SKIP_REASON
from decodespec.impl.gguf import smollm2_available

requires_smollm2 = pytest.mark.skipif(not smollm2_available(), reason=SMOLLM2_SKIP_REASON)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = {"tiny": [(1, 87, 104, 97, 116, 32, 105, 115), (5,)], "smollm2": [(504, 3458, 282, 4649, 314), (1, 1030, 1345, 13, 50)]}


def test_the_reference_module_imports_neither_torch_nor_impl() -> None:
    tree = ast.parse((ROOT / "checks/gate/reference/llama64.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith(("torch", "decodespec", "impl")) or n == "."], names
    code = ("import sys; import decodespec.checks.gate.reference.llama64 as m; "
            "bad = [k for k in sys.modules if k.startswith(('torch', 'decodespec.impl'))]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _q4_1_block(d: float, m: float, q: list[int]) -> bytes:
    nib = bytes((q[j] & 15) | ((q[j + 16] & 15) << 4) for j in range(16))
    return np.float16(d).tobytes() + np.float16(m).tobytes() + nib


def test_q4_1_and_q8_0_dequantize_exactly() -> None:
    q = [(7 * j) % 16 for j in range(32)]
    raw = np.frombuffer(_q4_1_block(0.5, -1.25, q) + _q4_1_block(2.0 ** -10, 3.0, q[::-1]), dtype=np.uint8)
    out = dequantize64(raw, "Q4_1", 1, 64)
    assert out.dtype == np.float64 and out.shape == (1, 64)
    assert out[0, :32].tolist() == [0.5 * v - 1.25 for v in q]
    assert out[0, 32:].tolist() == [2.0 ** -10 * v + 3.0 for v in q[::-1]]
    q8 = np.arange(-16, 16, dtype=np.int8)
    out8 = dequantize64(np.frombuffer(np.float16(0.25).tobytes() + q8.tobytes(), dtype=np.uint8), "Q8_0", 1, 32)
    assert out8[0].tolist() == [0.25 * v for v in q8.tolist()]
    with pytest.raises(ValueError):
        dequantize64(raw, "Q5_K", 1, 64)


@requires_smollm2
def test_smollm2_dequantization_agrees_with_gguf_quants_to_float32_rounding() -> None:
    import gguf

    reader = gguf.GGUFReader(str(gguf_path("smollm2")))
    kinds = set()
    for t in reader.tensors:
        if t.tensor_type.name in kinds or t.tensor_type.name == "F32":
            continue
        kinds.add(t.tensor_type.name)
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        ours = dequantize64(t.data, t.tensor_type.name, theirs.shape[0], theirs.shape[1])
        assert np.max(np.abs(ours - theirs)) <= 1e-6 * max(1.0, np.max(np.abs(ours))), t.name
    assert kinds == {"Q4_1", "Q8_0"}


def _lift_hf_float32_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF computes RMSNorm and the RoPE angles in float32 even in a float64 model (``modeling_llama.py``
    ``LlamaRMSNorm.forward``: ``.to(torch.float32)``; ``LlamaRotaryEmbedding.forward``: ``.float()``);
    these two overrides keep HF's operations and drop only the casts, so its float64 run is float64."""
    import torch
    from transformers.models.llama import modeling_llama as hf_llama

    def rms_norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def rotary(self, x, position_ids):
        base, dim = self.config.rope_parameters["rope_theta"], self.config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # [D/2]
        freqs = position_ids[..., None].to(torch.float64) * inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    monkeypatch.setattr(hf_llama.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(hf_llama.LlamaRotaryEmbedding, "forward", rotary)


def _hf_float64(model):
    """HF ``LlamaForCausalLM`` in float64 holding the reference's own float64 weights (Q/K rows un-permuted by HF's code)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    s = model.shape
    config = LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                         num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
                         head_dim=s.head_dim, max_position_embeddings=s.context_length, rms_norm_eps=s.rms_norm_eps,
                         rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
                         tie_word_embeddings=model.head is model.embed, attn_implementation="sdpa")  # eager: softmax in float32
    hf = LlamaForCausalLM(config).to(torch.float64).eval()
    unpermute = LlamaTensorProcessor()._reverse_permute_weights
    sd = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm, "lm_head.weight": model.head}
    for i, L in enumerate(model.layers):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": L.attn_norm, p + "post_attention_layernorm.weight": L.ffn_norm,
                   p + "self_attn.q_proj.weight": unpermute(L.wq, s.num_heads, s.num_heads),
                   p + "self_attn.k_proj.weight": unpermute(L.wk, s.num_heads, s.num_kv_heads),
                   p + "self_attn.v_proj.weight": L.wv, p + "self_attn.o_proj.weight": L.wo,
                   p + "mlp.gate_proj.weight": L.w_gate, p + "mlp.up_proj.weight": L.w_up, p + "mlp.down_proj.weight": L.w_down})
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, strict=True)
    return hf


@pytest.mark.hf
@pytest.mark.parametrize("name", ["tiny", pytest.param("smollm2", marks=requires_smollm2)])
def test_reference_equals_hf_transformers_in_float64(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prompt position's row and the K (after RoPE) / V rows agree with HF's float64 forward to 1e-9."""
    import torch

    _lift_hf_float32_casts(monkeypatch)
    model = load_gguf64(gguf_path(name))
    hf = _hf_float64(model)
    ref = Reference64(model)
    for prompt in PROMPTS[name]:
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), use_cache=True)
        logits = out.logits[0].numpy()  # [T, V]
        for t in range(len(prompt)):
            row = ref.row(prompt[: t + 1])
            assert np.max(np.abs(row - logits[t])) <= 1e-9 * max(1.0, np.max(np.abs(row))), (prompt, t)
        kv = ref.kv(prompt)  # [N, 2, H_kv, P, D]
        cache = out.past_key_values
        hf_kv = np.stack([np.stack((cache.layers[i].keys[0].numpy(), cache.layers[i].values[0].numpy()))
                          for i in range(model.shape.num_layers)])
        assert kv.shape == hf_kv.shape
        assert np.max(np.abs(kv - hf_kv)) <= 1e-9 * max(1.0, np.max(np.abs(kv)))


def test_incremental_rows_equal_one_shot_rows_and_survive_eviction() -> None:
    model = load_gguf64(gguf_path("tiny"))
    seq = list(PROMPTS["tiny"][0])
    grown = Reference64(model)
    rows = []
    for _ in range(6):  # one row of work per step (trie extension)
        rows.append(grown.row(seq))
        seq.append(int(np.argmax(rows[-1])))
    assert grown.num_positions == len(seq) - 1
    tight = Reference64(model, max_bytes=1, max_rows=1)  # evicts everything but the prefix in use
    for k in range(6):
        prefix = seq[: len(PROMPTS["tiny"][0]) + k]
        fresh = Reference64(model).row(prefix)  # the whole prefix in one call
        assert np.max(np.abs(fresh - rows[k])) <= 1e-12
        assert np.max(np.abs(tight.row(prefix) - rows[k])) <= 1e-12
        assert np.max(np.abs(tight.kv(prefix) - Reference64(model).kv(prefix))) <= 1e-12
    assert tight.row([3, 4]).shape == (512,)
    with pytest.raises(ValueError):
        tight.row([])
    with pytest.raises(ValueError):
        tight.row([512])


def test_a_model_math_bug_on_every_path_fails_the_gate_at_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 15: RMSNorm dropping its learned scale (x 1.7) on every path passed three cases against the old twin reference.

    The bug is patched plainly (no failure-lab dispatcher, no oracle side): the float64 reference
    never runs impl/ code, so it cannot carry it.
    """
    from decodespec.checks.gate import cases
    from decodespec.impl import model as impl_model

    def broken(self, hidden_states):
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        return 1.7 * (hidden_states.float() * (variance + self.variance_epsilon).rsqrt()).to(hidden_states.dtype)

    monkeypatch.setattr(impl_model.LlamaRMSNorm, "forward", broken)
    table = {c.id: c for c in cases.cases_for("tiny")}
    # The pair cases observe every score row: TENSOR.  boundary.one_token_prompt runs the request in
    # one action and observes the last row only, so its first failed check is the first decision the
    # wrong rows change (DECISION, with a reference margin that rules the runtime's id out).
    for case_id, layer in (("matrix.no_cache_vs_dynamic", "TENSOR"), ("matrix.dynamic_vs_static", "TENSOR"),
                           ("boundary.one_token_prompt", "DECISION")):
        result = cases.run_case(table[case_id], "impl")
        assert result.result == "fail", (case_id, result)
        assert result.verdict.layer == layer, (case_id, result.verdict)


def test_export_tiny_writes_the_file_the_reference_reads(tmp_path: Path) -> None:
    out = tmp_path / "tiny.gguf"
    proc = subprocess.run([sys.executable, "-m", "decodespec.checks.commands.cli", "export-tiny", "--out", str(out)], check=False, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    exported = Reference64(load_gguf64(out))
    shipped = Reference64(load_gguf64(gguf_path("tiny")))
    prompt = PROMPTS["tiny"][0]
    assert np.array_equal(exported.row(prompt), shipped.row(prompt))
    assert not list(tmp_path.glob(".*.part"))
    bad = subprocess.run([sys.executable, "-m", "decodespec.checks.commands.cli", "export-tiny", "--out", str(tmp_path / "no" / "x.gguf")],
                         check=False, capture_output=True, text=True)
    assert bad.returncode == 2 and '"cli.io_error"' in bad.stdout
    assert not (tmp_path / "no").exists()
