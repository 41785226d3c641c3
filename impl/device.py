"""Device and dtype selection for the runtime.

CUDA is selected when present and not overridden; otherwise the CPU.  Every entry point that
takes ``--device`` / ``--dtype`` resolves them here so there is one rule.
"""

from __future__ import annotations

import torch

from decodespec.spec.errors import Rejection, register_code

__all__ = ["DTYPES", "INVALID_DEVICE", "INVALID_DTYPE", "resolve_device", "resolve_dtype"]

INVALID_DEVICE = register_code(
    "runtime.invalid_device",
    "rejection",
    "M3.10 envelope (runtime plane)",
    "The requested device or dtype is unknown or not available on this machine.",
)

INVALID_DTYPE = register_code(
    "runtime.invalid_dtype",
    "rejection",
    "M3.10 envelope (runtime plane, compute_dtype)",
    "The requested compute dtype is not one the runtime supports (float32, bfloat16, float16).",
)

#: dtype names accepted on the command line and in envelopes.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | None = None) -> torch.device:
    """``"auto"``/``None`` -> CUDA when available else CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` as given.

    Raises:
        Rejection: ``runtime.invalid_device`` for an unknown name or CUDA requested but absent.
    """
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise Rejection(INVALID_DEVICE, f"unknown device {name!r}", "$.runtime.device") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise Rejection(INVALID_DEVICE, "CUDA was requested but is not available", "$.runtime.device")
    if device.type not in ("cpu", "cuda"):
        raise Rejection(INVALID_DEVICE, f"device type {device.type!r} is not supported", "$.runtime.device")
    return device


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` (or that torch dtype itself) -> the torch dtype.

    Raises:
        Rejection: ``runtime.invalid_dtype`` for any other name or dtype (``torch.int8``, ``"float64"``).
    """
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        raise Rejection(INVALID_DTYPE, f"unsupported dtype {name}; expected one of {sorted(DTYPES)}", "$.runtime.compute_dtype")
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise Rejection(INVALID_DTYPE, f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}", "$.runtime.compute_dtype") from None
