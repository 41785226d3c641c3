"""The GPU check script (``python -m decodespec.checks.gpu_check``) runs its comparisons end to end.

There is no GPU here: ``--device cpu`` runs the same tiny-model comparisons (runtime ids, the
graph path's eager step, padded batches) so the script itself is exercised before a GPU session
needs it; without CUDA the default invocation exits 2 and says why.
"""

from __future__ import annotations

import pytest
import torch

from decodespec.checks import gpu_check


def test_tiny_comparisons_run_and_pass_on_the_cpu():
    results = gpu_check.check_tiny("cpu")
    assert set(results) == {"tiny_parity", "tiny_graph", "tiny_padded"}
    assert all(r["ok"] for r in results.values()), results
    assert results["tiny_graph"]["captured"] is False  # no CUDA graph off CUDA


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA exit status")
def test_without_cuda_the_script_exits_2(capsys):
    assert gpu_check.main([]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
