"""M3.10 0x09 "A cache is an ABI": the Llama-architecture configuration, built from GGUF metadata.

One frozen record holds every architectural constant the decoder needs (gpt-fast's
``ModelArgs``; HF's ``LlamaConfig`` names).  It is built from the file's own metadata by
:meth:`LlamaConfig.from_gguf_metadata` with the key map HF transformers uses
(``transformers/integrations/ggml.py``, ``GGUF_CONFIG_MAPPING["llama"]``), and its validators
reject an inconsistent configuration with a typed error before any module is built.

Source: M3.10 0x09 "A cache is an ABI, not an untyped tuple" (layer set, ``H_kv``, ``d_h`` and
the positional transform ``rho`` are fixed by the checkpoint); M3.10 0x0A "Position and cache
consistency" (RoPE base and scaling belong to the positional transform).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from decodespec.spec.errors import Rejection, register_code

from .gguf import UNSUPPORTED_ARCHITECTURE

__all__ = ["ATTN_IMPLEMENTATIONS", "INVALID_CONFIG", "LlamaConfig", "RopeScaling"]

INVALID_CONFIG = register_code(
    "model.invalid_config",
    "rejection",
    "M3.10 0x09 cache ABI (architecture constants)",
    "A model configuration value is out of range or inconsistent (e.g. query heads not a multiple of K/V heads).",
)

#: Attention implementations the decoder offers (both compute the same function).
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")

#: RoPE scaling types this decoder implements ("linear" divides every frequency by ``factor``).
ROPE_SCALING_TYPES = ("linear",)


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise Rejection(INVALID_CONFIG, f"{attribute.name} must be a positive number, got {value!r}", f"$.config.{attribute.name}")


def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise Rejection(INVALID_CONFIG, f"{attribute.name} must be a positive integer, got {value!r}", f"$.config.{attribute.name}")


def _optional_token_id(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < instance.vocab_size:
        raise Rejection(INVALID_CONFIG, f"{attribute.name} must be None or an id in [0, vocab_size), got {value!r}", f"$.config.{attribute.name}")


def _one_of(choices: tuple[str, ...]):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise Rejection(INVALID_CONFIG, f"{attribute.name} must be one of {choices}, got {value!r}", f"$.config.{attribute.name}")

    return check


@attrs.frozen
class RopeScaling:
    """A RoPE frequency scaling (HF ``rope_parameters`` / GGUF ``<arch>.rope.scaling.*``).

    Attributes:
        rope_type: ``"linear"``: every inverse frequency is divided by ``factor``
            (HF ``_compute_linear_scaling_rope_parameters``; llama.cpp ``freq_scale = 1/factor``).
        factor: Scaling factor (> 0).
    """

    rope_type: str = attrs.field(validator=_one_of(ROPE_SCALING_TYPES))
    factor: float = attrs.field(converter=float, validator=_positive)


@attrs.frozen
class LlamaConfig:
    """Architecture constants of a Llama-family decoder (HF ``LlamaConfig`` names).

    Attributes:
        vocab_size: V, rows of ``embed_tokens`` and ``lm_head``.
        hidden_size: d_model.
        intermediate_size: Width of the SwiGLU MLP.
        num_hidden_layers: Number of decoder layers (the cache-producing layer set L_c).
        num_attention_heads: H, query heads.
        num_key_value_heads: H_kv, K/V heads (grouped-query attention; H % H_kv == 0).
        head_dim: D, width of one head (even: RoPE rotates pairs).
        max_position_embeddings: Context window C; every position id lies in ``[0, C)``.
        rms_norm_eps: Epsilon of every ``LlamaRMSNorm``.
        rope_theta: RoPE base (SmolLM2: 1e5).
        rope_scaling: ``None`` (plain RoPE) or a :class:`RopeScaling`.
        tie_word_embeddings: ``lm_head`` is the same Parameter as ``embed_tokens``.
        attn_implementation: ``"eager"`` (matmul + softmax, HF's reference) or ``"sdpa"``
            (``torch.nn.functional.scaled_dot_product_attention``).
        bos_token_id, eos_token_id, pad_token_id: Special ids from the file, or ``None``.

    Raises:
        Rejection: ``model.invalid_config`` on construction (or :func:`attrs.evolve`) with an
            out-of-range or inconsistent value.
    """

    vocab_size: int = attrs.field(validator=_positive_int)
    hidden_size: int = attrs.field(validator=_positive_int)
    intermediate_size: int = attrs.field(validator=_positive_int)
    num_hidden_layers: int = attrs.field(validator=_positive_int)
    num_attention_heads: int = attrs.field(validator=_positive_int)
    num_key_value_heads: int = attrs.field(validator=_positive_int)
    head_dim: int = attrs.field(validator=_positive_int)
    max_position_embeddings: int = attrs.field(validator=_positive_int)
    rms_norm_eps: float = attrs.field(converter=float, validator=_positive)
    rope_theta: float = attrs.field(converter=float, validator=_positive)
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = True
    attn_implementation: str = attrs.field(default="sdpa", validator=_one_of(ATTN_IMPLEMENTATIONS))
    bos_token_id: int | None = attrs.field(default=None, validator=_optional_token_id)
    eos_token_id: int | None = attrs.field(default=None, validator=_optional_token_id)
    pad_token_id: int | None = attrs.field(default=None, validator=_optional_token_id)

    def __attrs_post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise Rejection(
                INVALID_CONFIG,
                f"num_attention_heads={self.num_attention_heads} is not a multiple of num_key_value_heads={self.num_key_value_heads}",
                "$.config.num_key_value_heads",
            )
        if self.head_dim % 2:
            raise Rejection(INVALID_CONFIG, f"head_dim={self.head_dim} must be even (RoPE rotates pairs)", "$.config.head_dim")

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per K/V head, ``H // H_kv``."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: Mapping[str, Any],
        *,
        tie_word_embeddings: bool = True,
        attn_implementation: str = "sdpa",
    ) -> LlamaConfig:
        """The configuration a llama-architecture GGUF file declares.

        Args:
            metadata: The file's key/value metadata (:func:`decodespec.impl.gguf.read_metadata`).
            tie_word_embeddings: Whether ``lm_head`` reuses ``embed_tokens`` (true when the file
                holds no ``output.weight`` tensor; the loader decides from the tensor set).
            attn_implementation: ``"eager"`` or ``"sdpa"``.

        Returns:
            A validated :class:`LlamaConfig`.

        Raises:
            Rejection: ``model.unsupported_architecture`` when ``general.architecture`` is not
                ``llama``, a required key is missing, or the RoPE scaling type is not implemented;
                ``model.invalid_config`` when a value is out of range.

        Source: HF ``transformers/integrations/ggml.py`` ``GGUF_CONFIG_MAPPING["llama"]`` (key
        names); llama.cpp ``gguf-py/gguf/constants.py`` (``Keys.Rope``).
        """
        arch = metadata.get("general.architecture")
        if arch != "llama":
            raise Rejection(UNSUPPORTED_ARCHITECTURE, f"general.architecture is {arch!r}; only 'llama' is implemented", "$.artifact.architecture")

        def need(key: str) -> Any:
            full = f"llama.{key}"
            if full not in metadata:
                raise Rejection(UNSUPPORTED_ARCHITECTURE, f"GGUF metadata lacks {full!r}", f"$.artifact.metadata.{full}")
            return metadata[full]

        hidden_size = int(need("embedding_length"))
        num_heads = int(need("attention.head_count"))
        head_dim = int(metadata.get("llama.rope.dimension_count", 0)) or hidden_size // num_heads
        if "llama.vocab_size" in metadata:
            vocab_size = int(metadata["llama.vocab_size"])
        elif "tokenizer.ggml.tokens" in metadata:
            vocab_size = len(metadata["tokenizer.ggml.tokens"])
        else:
            raise Rejection(UNSUPPORTED_ARCHITECTURE, "GGUF metadata gives no vocabulary size", "$.artifact.metadata.llama.vocab_size")
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=int(need("feed_forward_length")),
            num_hidden_layers=int(need("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(metadata.get("llama.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            max_position_embeddings=int(need("context_length")),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(metadata.get("llama.rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling_from_metadata(metadata),
            tie_word_embeddings=tie_word_embeddings,
            attn_implementation=attn_implementation,
            bos_token_id=_token_id(metadata, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_token_id(metadata, "tokenizer.ggml.eos_token_id"),
            pad_token_id=_token_id(metadata, "tokenizer.ggml.padding_token_id"),
        )


def _token_id(metadata: Mapping[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    return int(value) if value is not None else None


def _rope_scaling_from_metadata(metadata: Mapping[str, Any]) -> RopeScaling | None:
    """``llama.rope.scaling.{type,factor}`` (or the older ``llama.rope.scale_linear``) -> RopeScaling.

    Raises:
        Rejection: ``model.unsupported_architecture`` for a scaling type other than none/linear
            (YaRN, LongRoPE, ... change attention as well as frequencies and are not implemented).
    """
    kind = metadata.get("llama.rope.scaling.type")
    if kind in (None, "none"):
        legacy = metadata.get("llama.rope.scale_linear")
        if legacy is not None and float(legacy) != 1.0:
            return RopeScaling(rope_type="linear", factor=float(legacy))
        return None
    if kind == "linear":
        factor = float(metadata.get("llama.rope.scaling.factor", 1.0))
        return None if factor == 1.0 else RopeScaling(rope_type="linear", factor=factor)
    raise Rejection(UNSUPPORTED_ARCHITECTURE, f"RoPE scaling type {kind!r} is not implemented (only none/linear)", "$.artifact.metadata.llama.rope.scaling.type")
