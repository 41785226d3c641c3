"""The native CPU decode kernel (:mod:`decodespec.impl.native`) against the torch path.

* It is really used: every decode call of a float32 CPU run on a static cache goes through one
  kernel call; prefill, the dynamic cache, padded batches and hooked layers stay on torch
  (bitwise equal to the torch path there).
* Same numbers: score rows within the logit tolerance of the torch path, the K/V rows it writes
  likewise, the same tokens and cache integers; the result does not depend on the thread count.
* The cache ledger still judges it: a write past capacity is refused before any slot changes;
  an injected device fault part-way through a call leaves the same lanes as on torch.
* Refusals: ``runtime.kernel_unavailable`` for bfloat16 or where the kernel cannot build,
  ``model.invalid_config`` for an unknown kernel name; nothing changes.
* The gate kills a wrong kernel (the ``matrix.torch_vs_native_kernel`` case fails when the kernel
  scales attention wrongly).

Source: M3.10 0x08-0x09 (a decode call's shape ledger and the cache ABI); the kernel mirrors
:mod:`decodespec.impl.model`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from runtime_helpers import LOGIT_TOL, drive, request  # tests/ is on sys.path

from decodespec.impl import native
from decodespec.impl.cache import StaticCache
from decodespec.impl.faults import DeviceFault, FaultPlan
from decodespec.impl.runtime import RequestRunner
from decodespec.spec.errors import Rejection, ResourceLimit

REASON = native.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native kernel unavailable here: {REASON}")

PROMPT = (5, 17, 99, 3, 250, 7, 64, 12)


@pytest.fixture(scope="module")
def pair():
    """Two tiny models with identical weights: ``torch`` and ``native``."""
    from decodespec.impl.tiny import load_tiny

    return load_tiny(seed=0), load_tiny(seed=0).set_decode_kernel("native")


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts :meth:`NativeKernel.layers` calls (and the layers each ran)."""
    calls: list[int] = []
    original = native.NativeKernel.layers

    def counting(self, weights, *args, **kwargs):
        calls.append(len(weights))
        return original(self, weights, *args, **kwargs)

    monkeypatch.setattr(native.NativeKernel, "layers", counting)
    return calls


def _run(model, cache="static", **changes):
    runner = RequestRunner(model, request(PROMPT, max_new_tokens=10, cache=cache, **changes))
    rows, result = drive(runner)
    return rows, result, runner


def test_decode_calls_go_through_the_kernel_and_agree_with_torch(pair, kernel_calls):
    torch_model, native_model = pair
    rows_t, result_t, runner_t = _run(torch_model)
    assert kernel_calls == []
    rows_n, result_n, runner_n = _run(native_model)
    layers = native_model.config.num_hidden_layers
    assert kernel_calls == [layers] * 9  # 10 decisions: one prefill (torch) and nine decode calls (native)
    assert result_n.output_ids == result_t.output_ids
    assert max((a - b).abs().max().item() for a, b in zip(rows_t, rows_n)) <= LOGIT_TOL["tiny"]
    assert runner_n.frontier() == runner_t.frontier()
    ct, cn = runner_t.cache, runner_n.cache
    assert cn.committed_length == ct.committed_length and cn.layer_lengths() == ct.layer_lengths()
    for (kt, vt), (kn, vn) in zip(ct.committed_tensors(), cn.committed_tensors()):
        assert torch.allclose(kt, kn, atol=1e-5, rtol=0) and torch.allclose(vt, vn, atol=1e-5, rtol=0)
        assert not kt.equal(kn)  # the decode rows were written by the kernel (another summation order)


def test_results_do_not_depend_on_the_thread_count(pair):
    _, native_model = pair
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rows_1, _, _ = _run(native_model)
        torch.set_num_threads(2)
        rows_2, _, _ = _run(native_model)
    finally:
        torch.set_num_threads(before)
    assert all(a.equal(b) for a, b in zip(rows_1, rows_2))


@pytest.mark.parametrize("case", ["dynamic", "hooked_layer"])
def test_calls_the_kernel_does_not_cover_run_the_torch_path_bitwise(pair, kernel_calls, case):
    torch_model, native_model = pair
    cache = "dynamic" if case == "dynamic" else "static"
    rows_t, _, _ = _run(torch_model, cache=cache)
    handle = native_model.model.layers[1].mlp.register_forward_hook(lambda *a: None) if case == "hooked_layer" else None
    try:
        rows_n, _, _ = _run(native_model, cache=cache)
    finally:
        if handle is not None:
            handle.remove()
    assert kernel_calls == []
    assert all(a.equal(b) for a, b in zip(rows_t, rows_n))


def test_a_padded_batch_runs_the_torch_path(pair, kernel_calls):
    _torch_model, _native_model = pair
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with torch.inference_mode():
        outs = []
        for model in pair:
            cache = StaticCache(model.cache_abi, 8, batch_size=2)
            model(ids, past_key_values=cache, attention_mask=cache.key_validity(3))
            outs.append(model(ids[:, :1], past_key_values=cache, attention_mask=cache.key_validity(1)).logits)
    assert kernel_calls == [] and outs[0].equal(outs[1])


def test_a_write_past_capacity_is_refused_before_any_slot_changes(pair, kernel_calls):
    _, native_model = pair
    cache = StaticCache(native_model.cache_abi, 4)
    with torch.inference_mode():
        native_model(torch.tensor([[5, 6, 7, 8]]), past_key_values=cache, attention_mask=cache.key_validity(4))
        keys = [k.clone() for k in cache.key_cache]
        with pytest.raises(ResourceLimit) as info:
            native_model(torch.tensor([[9]]), past_key_values=cache, cache_position=torch.tensor([4]))
    assert info.value.code == "cache.capacity_exceeded" and kernel_calls == []
    assert cache.layer_lengths() == (4,) * native_model.config.num_hidden_layers and cache.committed_length == 4
    assert all(a.equal(b) for a, b in zip(keys, cache.key_cache))


def test_a_device_fault_inside_a_kernel_call_leaves_the_torch_lanes(pair, kernel_calls):
    """The layers before the faulted one run in the kernel and are written, as on torch; ALL_OLD, recovery, retry."""
    outcomes = []
    for model in pair:
        runner = RequestRunner(model, request(PROMPT, max_new_tokens=4, cache="static", max_retries=1),
                               faults=FaultPlan.of(DeviceFault(call_id=2, layer=2)))
        rows, result = drive(runner)
        outcomes.append((result.output_ids, result.finish_reason, [r.clone() for r in rows], runner.cache.layer_lengths()))
    assert kernel_calls and kernel_calls.count(2) == 1  # the faulted call ran layers 0 and 1 in the kernel
    assert outcomes[0][0] == outcomes[1][0] and outcomes[0][1] == outcomes[1][1] and outcomes[0][3] == outcomes[1][3]
    assert max((a - b).abs().max().item() for a, b in zip(outcomes[0][2], outcomes[1][2])) <= LOGIT_TOL["tiny"]


def test_refusals_change_nothing(pair):
    _torch_model, native_model = pair
    with pytest.raises(Rejection) as info:
        native_model.set_decode_kernel("fused")
    assert info.value.code == "model.invalid_config" and native_model.decode_kernel == "native"
    bf16 = __import__("decodespec.impl.tiny", fromlist=["load_tiny"]).load_tiny(seed=0, dtype=torch.bfloat16)
    with pytest.raises(Rejection) as info:
        bf16.set_decode_kernel("native")
    assert info.value.code == "runtime.kernel_unavailable" and bf16.decode_kernel == "torch" and bf16._kernel is None


def test_a_missing_compiler_is_a_reason_not_a_crash(tmp_path):
    code = "from decodespec.impl import native; print(native.unavailable_reason())"
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "DECODESPEC_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "building the native decode kernel failed" in out.stdout and "no-such-cc" in out.stdout
    assert not list(tmp_path.glob("*.so"))


def test_the_gate_kills_a_kernel_that_scales_attention_wrongly(monkeypatch):
    from decodespec.checks.gate.cases import cases_for, run_case

    case = next(c for c in cases_for("tiny") if c.id == "matrix.torch_vs_native_kernel")
    assert run_case(case, "impl").result == "pass"
    real = native.dims

    def wrong(config, capacity):
        d = real(config, capacity)
        d.scale = d.scale * 1.5  # softmax temperature off by 1.5
        return d

    monkeypatch.setattr(native, "dims", wrong)
    result = run_case(case, "impl")
    assert result.result == "fail", result


def test_generate_cli_runs_the_native_kernel(tmp_path):
    base = [sys.executable, "-m", "decodespec.checks", "generate", "--model", "tiny", "--prompt", "hello", "--max-new-tokens", "6",
            "--cache", "static", "--json", "--device", "cpu"]
    runs = {}
    for kernel in ("torch", "native"):
        out = subprocess.run([*base, "--decode-kernel", kernel, "--trace", str(tmp_path / f"{kernel}.ndjson")],
                             check=False, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        runs[kernel] = json.loads(out.stdout)
    assert runs["native"]["decode_kernel"] == "native" and runs["native"]["output_ids"] == runs["torch"]["output_ids"]
    header = json.loads((tmp_path / "native.ndjson").read_text().splitlines()[0])
    assert header["runtime"]["decode_kernel"] == "native"
    check = subprocess.run([sys.executable, "-m", "decodespec.checks", "validate-trace", str(tmp_path / "native.ndjson")],
                           check=False, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    bad = subprocess.run([*base, "--decode-kernel", "native", "--dtype", "bfloat16"], check=False, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and json.loads(bad.stderr)["error"]["code"] == "runtime.kernel_unavailable" and bad.stdout == ""


@pytest.mark.smollm2
def test_smollm2_greedy_with_the_kernel_matches_torch(smollm2_model, kernel_calls):
    """The real model: 24 greedy tokens and every score row within the SmolLM2 logit tolerance."""
    from decodespec.impl.generate import generate

    prompt = list(range(100, 132))
    reference = generate(smollm2_model, prompt, max_new_tokens=24, eos_token_ids=(), cache="static")
    smollm2_model.set_decode_kernel("native")
    try:
        got = generate(smollm2_model, prompt, max_new_tokens=24, eos_token_ids=(), cache="static")
    finally:
        smollm2_model.set_decode_kernel("torch")
    assert len(kernel_calls) == 23 and got.output_ids == reference.output_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, reference.logprobs)) <= LOGIT_TOL["smollm2"]


@pytest.mark.parametrize("case", ["hooked_stack", "hooked_rotary", "grad_mode", "keep_tensor"])
def test_hooks_and_options_the_kernel_cannot_honour_take_the_torch_path(pair, kernel_calls, case):
    """A hook on the decoder stack or the rotary module, grad mode: the torch path, bitwise; logits_to_keep as a
    tensor: the layers in the kernel, the head on torch over the kept rows."""
    outs = []
    for model in pair:
        cache = StaticCache(model.cache_abi, 8)
        with torch.no_grad() if case == "grad_mode" else torch.inference_mode():  # grad mode needs non-inference buffers
            model(torch.tensor([[5, 6, 7]]), past_key_values=cache, attention_mask=cache.key_validity(3))
        target = {"hooked_stack": model.model, "hooked_rotary": model.model.rotary_emb}.get(case)
        handle = None if target is None else target.register_forward_hook(lambda module, args, out: out)
        keep = torch.tensor([0, 0]) if case == "keep_tensor" else 0
        try:
            with torch.enable_grad() if case == "grad_mode" else torch.inference_mode():
                outs.append(model(torch.tensor([[9]]), past_key_values=cache, attention_mask=cache.key_validity(1),
                                  logits_to_keep=keep).logits.detach())
        finally:
            if handle is not None:
                handle.remove()
    if case == "keep_tensor":  # the layers run in the kernel, the head on torch over the kept rows
        assert kernel_calls == [4] and outs[1].shape == outs[0].shape == (1, 2, 512)
        assert torch.allclose(outs[0], outs[1], atol=LOGIT_TOL["tiny"], rtol=0)
    else:
        assert kernel_calls == [] and outs[0].equal(outs[1])


def test_a_slot_mismatch_is_refused_before_capacity_as_on_torch(pair):
    codes = []
    for model in pair:
        cache = StaticCache(model.cache_abi, 4)
        with torch.inference_mode():
            model(torch.tensor([[5, 6, 7, 8]]), past_key_values=cache, attention_mask=cache.key_validity(4))
            with pytest.raises(Rejection) as info:
                model(torch.tensor([[9]]), past_key_values=cache, cache_position=torch.tensor([6]))
        codes.append(info.value.code)
    assert codes == ["cache.slot_mismatch", "cache.slot_mismatch"]


def test_a_model_with_the_kernel_can_be_copied_and_pickled(pair, kernel_calls):
    import copy
    import pickle

    _, native_model = pair
    rows, _, _ = _run(native_model)
    for clone in (copy.deepcopy(native_model), pickle.loads(pickle.dumps(native_model))):
        assert clone.decode_kernel == "native" and clone._kernel is native_model._kernel
        assert all(layer.__dict__.get("_native_weights") is None for layer in clone.model.layers)
        calls_before = len(kernel_calls)
        clone_rows, _, _ = _run(clone)
        assert len(kernel_calls) > calls_before and all(a.equal(b) for a, b in zip(rows, clone_rows))
