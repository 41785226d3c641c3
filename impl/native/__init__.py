"""The native CPU decode kernel: every decoder layer, the final norm and the head of a one-row call, in C.

A batch-1 float32 decode step on the CPU streams every weight once (513 MiB for SmolLM2).  The
matrix-vector products run near the memory bandwidth in torch too; what costs is the rest: the
stream evicts the caches, and each of the ~20 small torch operations per layer then pays tens to
hundreds of microseconds (measured: the first small op after a weight stream takes ~250 us against
~8 us warm).  ``llama_decode.c`` runs the whole stack for one row in one OpenMP region per call:
per layer RMSNorm, the fused q/k/v product, RoPE, the K/V write, attention over every
static-cache slot under the additive mask, o_proj, the fused gate/up product, SwiGLU and
down_proj; then the final norm and ``lm_head``.  The static cache's ledger still checks every
layer's write before the call (:meth:`decodespec.impl.cache.StaticCache.reserve_row`) and records
it after (``record_rows``); the stage observer is told every stage.

Which calls take it (:meth:`decodespec.impl.model.LlamaForCausalLM.set_decode_kernel`,
``--decode-kernel native``): calls of one row, batch 1, float32 on the CPU with a
:class:`~decodespec.impl.cache.StaticCache`, when no forward hook watches a layer, every layer's
weights are contiguous float32 (fused matrices present) and the open call drops no layer's
write; the final norm and the head join when nothing hooks them.  An observer's ``fault_layer``
``k`` runs layers ``0..k-1`` in the kernel, then the fault is raised as on torch.  Every other call
(prefill, chunks, padded batches, the dynamic cache, bfloat16, CUDA) runs the torch path.  The
results are not bitwise those of torch (dot products and softmax sums are reduced in another
order; within the gate's logit tolerance, tested), and they do not depend on the thread count
(rows are split between threads, never sums).

Build: on first use, ``cc -O3 -mavx2 -mfma -ffp-contract=off -fopenmp -shared`` into
``$DECODESPEC_CACHE_DIR`` (default ``~/.cache/decodespec``), named by the source's hash and
renamed into place atomically; an x86-64 CPU with AVX2 and FMA and a C compiler are needed
(:func:`unavailable_reason` says which is missing).

Source: the operation order of :mod:`decodespec.impl.model` (HF ``LlamaDecoderLayer``);
M3.10 0x09 (rotated keys stored compact, before attention reads them).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from decodespec.spec.errors import Rejection, register_code

__all__ = ["DECODE_KERNELS", "KERNEL_UNAVAILABLE", "NativeKernel", "kernel", "unavailable_reason"]

KERNEL_UNAVAILABLE = register_code(
    "runtime.kernel_unavailable",
    "rejection",
    "M3.10 envelope (runtime plane)",
    "The requested decode kernel cannot run here (no C compiler, no AVX2/FMA, or a model it does not cover).",
)

#: Decode kernels a model can be set to: ``torch`` (every call through torch) or ``native``.
DECODE_KERNELS = ("torch", "native")

SOURCE = Path(__file__).with_name("llama_decode.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")

_P = ctypes.POINTER(ctypes.c_float)


class _Dims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "capacity")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("input_norm", "qkv", "o_proj", "post_norm", "gate_up", "down")]


class _Scratch(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("xn", "qkv", "attn", "gu", "act", "scores")]


def _ptr(tensor: torch.Tensor):
    return ctypes.cast(tensor.data_ptr(), _P)


def _cpu_reason() -> str | None:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the native decode kernel needs an x86-64 CPU with AVX2 and FMA (torch reports {capability})"
    return None


def cache_dir() -> Path:
    """Where built kernels live: ``$DECODESPEC_CACHE_DIR`` or ``~/.cache/decodespec``."""
    return Path(os.environ.get("DECODESPEC_CACHE_DIR") or Path.home() / ".cache" / "decodespec")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.lru_cache(maxsize=1)
def _build() -> tuple[ctypes.CDLL | None, str | None]:
    reason = _cpu_reason()
    if reason is not None:
        return None, reason
    compiler = _compiler()
    if compiler is None:
        return None, "the native decode kernel needs a C compiler (cc/gcc, or $CC) to build llama_decode.c"
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    target = cache_dir() / f"llama_decode-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            try:
                proc = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE)], check=False, capture_output=True, text=True)
            except OSError as exc:
                return None, f"building the native decode kernel failed ({compiler}): {exc}"
            if proc.returncode != 0:
                return None, f"building the native decode kernel failed ({compiler}): {proc.stderr.strip()[:500]}"
            os.replace(built, target)  # atomic: a concurrent builder renames an identical file
    torch.get_num_threads()  # torch (and its libgomp) is loaded: the kernel's libgomp.so.1 resolves to it
    lib = ctypes.CDLL(str(target))
    ptr = ctypes.c_void_p  # tensors are passed as their data_ptr() integers
    lib.decodespec_layers.argtypes = [ctypes.POINTER(_Layer), ctypes.c_int32, ctypes.POINTER(_Dims), ptr, ptr, ptr, ctypes.c_int32, ptr,
                                      ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_Scratch), ctypes.c_int32,
                                      ptr, ptr, ctypes.c_int32, ptr]
    lib.decodespec_layers.restype = None
    return lib, None


def unavailable_reason() -> str | None:
    """Why the native kernel cannot run on this machine (``None``: it can; builds it on first call)."""
    return _build()[1]


def kernel() -> NativeKernel:
    """The process's native kernel (built on first use; one instance per process).

    Raises:
        Rejection: ``runtime.kernel_unavailable`` with :func:`unavailable_reason`.
    """
    lib, reason = _build()
    if lib is None:
        raise Rejection(KERNEL_UNAVAILABLE, reason or "unavailable", "$.runtime.decode_kernel")
    return _instance(lib)


@functools.lru_cache(maxsize=1)
def _instance(lib: ctypes.CDLL) -> NativeKernel:
    return NativeKernel(lib)


class NativeKernel:
    """Typed calls into the built library (one per process; see :func:`kernel`).

    Calls are serialised by a lock: the scratch buffers are shared by every call.
    """

    def __reduce__(self):
        return kernel, ()  # a copied or unpickled model uses this process's kernel

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self._lock = threading.Lock()
        self._scratch: dict[tuple[int, ...], tuple[object, tuple[torch.Tensor, ...]]] = {}  # per dims: scratch struct, its buffers
        # per tuple of LayerWeights ids: the C array of their structs, and the LayerWeights (so the ids stay unique while cached)
        self._layer_arrays: dict[tuple[int, ...], tuple[ctypes.Array, list]] = {}

    def layers(self, weights: list[LayerWeights], dims: _Dims, h_in: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
               slot: int, mask: torch.Tensor | None, keys: list[torch.Tensor], values: list[torch.Tensor], *,
               final_norm: torch.Tensor | None = None, head: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoder layers ``0..n-1`` (``n = len(weights)``) for one row in one kernel call, optionally the final norm and head.

        Layer ``l`` writes its rotated key and value to slot ``slot`` of ``keys[l]``/``values[l]``
        before its attention reads every slot under ``mask``.

        Shapes: ``h_in float32[d]``; ``cos``, ``signed_sin`` ``float32[D]`` (the rotation of
        :func:`decodespec.impl.model.rotate_heads`); ``mask float32[S]`` additive, or ``None`` (every
        slot visible); ``keys[l]``, ``values[l]`` ``float32[1, H_kv, S, D]``; ``final_norm
        float32[d]``; ``head float32[V, d]`` (only with ``final_norm``); every tensor contiguous on
        the CPU.  Returns ``(hidden float32[d], logits float32[V] or None)``: the last layer's
        output, normalised by ``final_norm`` when given, and the head's logits of it.
        """
        n = len(weights)
        cached = self._layer_arrays.get(tuple(id(w) for w in weights))
        if cached is None:
            if len(self._layer_arrays) >= 4:  # each entry pins its weights' storage: keep few
                self._layer_arrays.clear()
            cached = self._layer_arrays[tuple(id(w) for w in weights)] = ((_Layer * n)(*(w.struct for w in weights)), list(weights))
        layer_array = cached[0]
        key = (dims.hidden, dims.heads, dims.kv_heads, dims.head_dim, dims.inter, dims.capacity)
        entry = self._scratch.get(key)
        if entry is None:
            if len(self._scratch) > 16:
                self._scratch.clear()
            qkv_rows = (dims.heads + 2 * dims.kv_heads) * dims.head_dim
            sizes = (dims.hidden, qkv_rows, dims.heads * dims.head_dim, 2 * dims.inter, dims.inter, dims.heads * dims.capacity)
            buffers = tuple(torch.empty(size, dtype=torch.float32) for size in sizes)
            entry = self._scratch[key] = (ctypes.byref(_Scratch(*(_ptr(b) for b in buffers))), buffers)
        hidden = torch.empty(2, dims.hidden, dtype=torch.float32)  # [2, d]: ping-pong rows
        hidden[0].copy_(h_in)
        logits = None if head is None else torch.empty(head.shape[0], dtype=torch.float32)  # [V]
        pointers = ctypes.c_void_p * n
        with self._lock:
            self.lib.decodespec_layers(layer_array, n, ctypes.byref(dims), hidden.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), slot,
                                       None if mask is None else mask.data_ptr(), pointers(*(k.data_ptr() for k in keys)),
                                       pointers(*(v.data_ptr() for v in values)), entry[0], torch.get_num_threads(),
                                       None if final_norm is None else final_norm.data_ptr(), None if head is None else head.data_ptr(),
                                       0 if head is None else head.shape[0], None if logits is None else logits.data_ptr())
        return hidden[(n + 1) % 2 if final_norm is not None else n % 2], logits


class LayerWeights:
    """The six weight pointers of one decoder layer, kept with the tensors they point into."""

    def __reduce__(self):
        return type(None), ()  # a copy holds no pointers into the original's storage: the copied layer rebuilds its own

    def __init__(self, tensors: tuple[torch.Tensor, ...], key: tuple[int, ...]):
        self.tensors = tensors  # keeps the storage alive as long as the pointers are used
        self.key = key  # the caller's validity key (storage addresses it depends on)
        self.struct = _Layer(*(_ptr(t) for t in tensors))
        self.ref = ctypes.byref(self.struct)


def dims(config, capacity: int) -> _Dims:
    """The kernel's dimensions of a :class:`decodespec.impl.config.LlamaConfig` and a static capacity ``S``."""
    return _Dims(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                 config.intermediate_size, capacity, config.rms_norm_eps, config.head_dim ** -0.5)
