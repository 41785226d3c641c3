"""M3.10 0x01 Minimal encoder-decoder greedy loop: an Annotated-Transformer model with two cache lifetimes.

The model is the Annotated Transformer's (``make_model``, ``encode``, ``decode``, ``generator``,
``subsequent_mask``; pre-norm residual sublayers, ``masked_fill(mask == 0, -1e9)``,
sinusoidal positions), with seeded random weights (a ``torch.Generator``, no global RNG).  On
top of its uncached loop (decode the whole target prefix every step, read ``out[:, -1]``) it
has a cached loop with the encoder-decoder profile's three state lanes
(:data:`decodespec.spec.profiles.PROFILES` ``["encoder_decoder"]``):

* ``encoder_memory`` (fixed): ``memory = encode(src, src_mask)`` ``[B, S, d_model]``, computed
  once per request and never mutated;
* ``cross_kv`` (fixed): per decoder layer, the cross-attention keys and values projected from
  the memory once per request, ``[B, h, S, d_k]`` each;
* ``self_kv`` (advancing): per decoder layer, the target self-attention keys and values, one row
  per processed target input (the decoder-start token, then each selected token once it is fed).

The source mask ``[B, 1, S]`` is applied in the encoder's self-attention and in every
cross-attention (a PAD source column is never read).  :class:`FixedLaneFingerprint` records the
version counter and SHA-256 of every fixed-lane tensor, so a test can prove that target decode
never changed them (tensors built under ``torch.no_grad()``, not ``inference_mode``, which
would drop version counters).  Inference refuses a model in training mode
(``model.training_mode``: dropout would be active).  Greedy selection is the project's declared
rule (lowest id among the maxima, ``torch.argmax``); the loop runs ``max_len - 1`` steps like the
Annotated Transformer's ``greedy_decode`` (no EOS).

Source: M3.10 0x01 "Minimal encoder-decoder greedy loop", "Encoder-decoder cached state has two
lifetimes", "Architecture-qualified conformance tests" (fixed encoder memory/cross state across
target steps; cached target self-state versus full target-prefix decode); 0x0B "Encoder-decoder
memory bugs" and "Runtime-mode bugs"; harvardnlp/annotated-transformer ``the_annotated_transformer.py``
(``make_model``, ``EncoderDecoder``, ``MultiHeadedAttention``, ``greedy_decode``).
"""

from __future__ import annotations

import copy
import hashlib
import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from decodespec.spec.errors import Rejection
from decodespec.spec.positions import INVALID_MASK

from .batch import check_attention_mask
from .model import TRAINING_MODE

__all__ = [
    "LANES",
    "TRAINING_MODE",
    "Decoder",
    "DecoderLayer",
    "EncDecCache",
    "EncDecResult",
    "Encoder",
    "EncoderDecoder",
    "EncoderLayer",
    "FixedLaneFingerprint",
    "Generator",
    "MultiHeadedAttention",
    "greedy_decode",
    "make_model",
    "subsequent_mask",
]

#: The cached state lanes, in the roster order of the spec's ``encoder_decoder`` profile.
LANES = ("encoder_memory", "cross_kv", "self_kv")


def subsequent_mask(size: int) -> torch.Tensor:
    """Target causal visibility ``bool[1, t, t]``: ``True`` where key ``j <= query i``.  Source: Annotated Transformer."""
    return torch.triu(torch.ones((1, size, size), dtype=torch.uint8), diagonal=1) == 0


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention, masked keys filled with ``-1e9`` (the Annotated Transformer's rule).

    Shapes: ``query [B, h, T, d_k]``, ``key``/``value [B, h, S, d_k]``, ``mask`` broadcastable to
    ``[B, h, T, S]`` (``0``/``False`` = hidden) -> ``[B, h, T, d_k]``.
    """
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(query.size(-1))  # [B, h, T, S]
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    return torch.matmul(scores.softmax(dim=-1), value)  # [B, h, T, d_k]


class MultiHeadedAttention(nn.Module):
    """``h`` heads of width ``d_k = d_model / h``; ``linears`` = q, k, v, out projections (with bias).

    :meth:`project_kv` and :meth:`attend` split the forward so a cache can hold projected K/V.
    """

    def __init__(self, h: int, d_model: int, dropout: float = 0.1):
        super().__init__()
        assert d_model % h == 0
        self.d_k = d_model // h
        self.h = h
        self.linears = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(4))
        self.dropout = nn.Dropout(p=dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1, self.h, self.d_k).transpose(1, 2)  # [B, h, T, d_k]

    def project_kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, S, d_model]`` -> projected ``[B, h, S, d_k]`` each."""
        return self._heads(self.linears[1](key)), self._heads(self.linears[2](value))

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``query [B, T, d_model]`` over projected ``keys``/``values [B, h, S, d_k]`` -> ``[B, T, d_model]``.

        ``mask``: ``[B, 1, S]`` or ``[B|1, T, S]`` (a head axis is added).
        """
        q = self._heads(self.linears[0](query))  # [B, h, T, d_k]
        x = attention(q, keys, values, None if mask is None else mask.unsqueeze(1))  # [B, h, T, d_k]
        x = x.transpose(1, 2).contiguous().view(query.shape[0], -1, self.h * self.d_k)  # [B, T, d_model]
        return self.linears[3](x)

    def forward(self, query, key, value, mask=None) -> torch.Tensor:
        keys, values = self.project_kv(key, value)
        return self.attend(query, keys, values, mask)


class PositionwiseFeedForward(nn.Module):
    """``w_2(dropout(relu(w_1(x))))``.  Shapes ``[B, T, d_model] -> [B, T, d_model]``."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.dropout(self.w_1(x).relu()))


class LayerNorm(nn.Module):
    """The Annotated Transformer's layer norm: ``a_2 * (x - mean) / (std + eps) + b_2`` (unbiased std)."""

    def __init__(self, features: int, eps: float = 1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class SublayerConnection(nn.Module):
    """Pre-norm residual: ``x + dropout(sublayer(norm(x)))``."""

    def __init__(self, size: int, dropout: float):
        super().__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        return x + self.dropout(sublayer(self.norm(x)))


class EncoderLayer(nn.Module):
    """Self-attention (under the source mask) then feed-forward."""

    def __init__(self, size: int, self_attn: MultiHeadedAttention, feed_forward: PositionwiseFeedForward, dropout: float):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = nn.ModuleList(SublayerConnection(size, dropout) for _ in range(2))
        self.size = size

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, y, mask))
        return self.sublayer[1](x, self.feed_forward)


class Encoder(nn.Module):
    """``N`` encoder layers and a final norm."""

    def __init__(self, layer: EncoderLayer, n: int):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(n))
        self.norm = LayerNorm(layer.size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class DecoderLayer(nn.Module):
    """Masked target self-attention, cross-attention to the memory (under the source mask), feed-forward."""

    def __init__(self, size: int, self_attn: MultiHeadedAttention, src_attn: MultiHeadedAttention, feed_forward: PositionwiseFeedForward, dropout: float):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = nn.ModuleList(SublayerConnection(size, dropout) for _ in range(3))

    def forward(self, x, memory, src_mask, tgt_mask) -> torch.Tensor:
        """The uncached layer over the whole target prefix ``[B, t, d_model]``."""
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, y, tgt_mask))
        x = self.sublayer[1](x, lambda y: self.src_attn(y, memory, memory, src_mask))
        return self.sublayer[2](x, self.feed_forward)

    def step(self, x: torch.Tensor, cache: EncDecCache, layer_idx: int) -> torch.Tensor:
        """The cached layer for new target rows ``x [B, T, d_model]`` at target positions ``[t, t+T)``.

        Appends this call's self K/V to the ``self_kv`` lane and reads the fixed ``cross_kv`` lane.
        """

        def self_block(y: torch.Tensor) -> torch.Tensor:
            keys, values = self.self_attn.project_kv(y, y)  # [B, h, T, d_k]
            keys, values = cache.append_self(layer_idx, keys, values)  # [B, h, t + T, d_k]
            start, length = keys.shape[2] - y.shape[1], y.shape[1]
            visible = torch.arange(start + length, device=y.device)[None, :] <= torch.arange(start, start + length, device=y.device)[:, None]
            return self.self_attn.attend(y, keys, values, visible[None])  # causal over [0, t + T)

        cross_keys, cross_values = cache.cross_kv[layer_idx]
        x = self.sublayer[0](x, self_block)
        x = self.sublayer[1](x, lambda y: self.src_attn.attend(y, cross_keys, cross_values, cache.src_mask))
        return self.sublayer[2](x, self.feed_forward)


class Decoder(nn.Module):
    """``N`` decoder layers and a final norm."""

    def __init__(self, layer: DecoderLayer, n: int):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(n))
        self.norm = LayerNorm(layer.size)

    def forward(self, x, memory, src_mask, tgt_mask) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)


class Embeddings(nn.Module):
    """Token embedding scaled by ``sqrt(d_model)``."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lut(x) * math.sqrt(self.d_model)


class PositionalEncoding(nn.Module):
    """Sinusoidal positions added to the embeddings; ``start`` offsets a cached step's rows."""

    def __init__(self, d_model: int, dropout: float, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))  # [1, max_len, d_model]

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        return self.dropout(x + self.pe[:, start:start + x.size(1)])


class Generator(nn.Module):
    """``log_softmax(proj(x))``: the vocabulary head.  Shapes ``[B, d_model] -> [B, V_tgt]``."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.proj(x), dim=-1)


class EncoderDecoder(nn.Module):
    """The encoder-decoder: ``encode(src, src_mask) -> memory``, ``decode(memory, src_mask, tgt, tgt_mask)``."""

    def __init__(self, encoder: Encoder, decoder: Decoder, src_embed: nn.Sequential, tgt_embed: nn.Sequential, generator: Generator):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.src_embed = src_embed
        self.tgt_embed = tgt_embed
        self.generator = generator

    def forward(self, src, tgt, src_mask, tgt_mask) -> torch.Tensor:
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """``src int64[B, S]``, ``src_mask [B, 1, S]`` -> ``memory [B, S, d_model]``."""
        return self.encoder(self.src_embed(src), src_mask)

    def decode(self, memory, src_mask, tgt, tgt_mask) -> torch.Tensor:
        """The uncached decoder over the whole target prefix ``tgt int64[B, t]`` -> ``[B, t, d_model]``."""
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)

    def new_cache(self, memory: torch.Tensor, src_mask: torch.Tensor) -> EncDecCache:
        """The request's lanes: the memory, every layer's cross K/V projected once, an empty self K/V lane."""
        cross = tuple(layer.src_attn.project_kv(memory, memory) for layer in self.decoder.layers)
        return EncDecCache(memory=memory, src_mask=src_mask, cross_kv=cross, self_kv=[None] * len(cross))

    def decode_step(self, tgt: torch.Tensor, cache: EncDecCache) -> torch.Tensor:
        """The cached decoder for new target rows ``tgt int64[B, T]`` after ``cache.processed`` rows -> ``[B, T, d_model]``."""
        embed, positions = self.tgt_embed[0], self.tgt_embed[1]
        x = positions(embed(tgt), start=cache.processed)  # [B, T, d_model]
        for idx, layer in enumerate(self.decoder.layers):
            x = layer.step(x, cache, idx)
        cache.processed += tgt.shape[1]
        return self.decoder.norm(x)


@attrs.frozen
class FixedLaneFingerprint:
    """Version counter and SHA-256 of every tensor of the fixed lanes (``encoder_memory``, ``cross_kv``).

    Two fingerprints are equal iff no fixed-lane tensor was written in place (version counters)
    and every byte is the same (hashes).
    """

    versions: tuple[int, ...]
    sha256: tuple[str, ...]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@attrs.define(eq=False)
class EncDecCache:
    """The per-request state lanes of the encoder-decoder profile (see the module docstring).

    Attributes:
        memory: ``[B, S, d_model]`` encoder memory (fixed lane ``encoder_memory``).
        src_mask: ``bool[B, 1, S]`` source validity.
        cross_kv: Per layer ``(keys, values)`` ``[B, h, S, d_k]`` (fixed lane ``cross_kv``).
        self_kv: Per layer ``(keys, values)`` ``[B, h, t, d_k]`` or ``None`` before the first step.
        processed: ``t``, target inputs processed (the ``self_kv`` frontier).
    """

    memory: torch.Tensor
    src_mask: torch.Tensor
    cross_kv: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    self_kv: list[tuple[torch.Tensor, torch.Tensor] | None]
    processed: int = 0

    def append_self(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, h, T, d_k]`` rows to layer ``layer_idx``'s self K/V; return every row ``[B, h, t + T, d_k]``."""
        old = self.self_kv[layer_idx]
        if old is not None:
            keys, values = torch.cat([old[0], keys], dim=2), torch.cat([old[1], values], dim=2)
        self.self_kv[layer_idx] = (keys, values)
        return keys, values

    def lane_frontiers(self) -> dict[str, int]:
        """``{lane: frontier}`` in :data:`LANES` order: the fixed lanes hold the ``S`` source slots, ``self_kv`` ``t`` rows."""
        source_len = self.memory.shape[1]
        return {"encoder_memory": source_len, "cross_kv": source_len, "self_kv": self.processed}

    def fixed_fingerprint(self) -> FixedLaneFingerprint:
        """The :class:`FixedLaneFingerprint` of the memory and every cross K/V tensor (reads them; a device sync)."""
        tensors = [self.memory] + [t for pair in self.cross_kv for t in pair]
        return FixedLaneFingerprint(tuple(t._version for t in tensors), tuple(_digest(t) for t in tensors))


@attrs.frozen(eq=False)
class EncDecResult:
    """What :func:`greedy_decode` returned.

    Attributes:
        ys: ``int64[B, max_len]``: the decoder-start token then ``max_len - 1`` selected tokens.
        scores: ``[max_len - 1, B, V_tgt]`` the generator's log-probabilities at each step (float32).
        lanes: Lane frontiers at the end (``None`` uncached).
        fingerprint_before, fingerprint_after: Fixed-lane fingerprints right after the memory
            and cross K/V were computed and after the last step.
    """

    ys: torch.Tensor
    scores: torch.Tensor
    lanes: dict[str, int] | None
    fingerprint_before: FixedLaneFingerprint
    fingerprint_after: FixedLaneFingerprint


def greedy_decode(
    model: EncoderDecoder,
    src: torch.Tensor,
    src_mask: torch.Tensor,
    max_len: int,
    start_symbol: int,
    *,
    use_cache: bool = True,
) -> EncDecResult:
    """Greedy target generation: the Annotated Transformer's ``greedy_decode``, cached or uncached.

    Uncached: every step decodes the whole target prefix under ``subsequent_mask`` and reads
    ``out[:, -1]``.  Cached: one :meth:`EncoderDecoder.decode_step` per step over the lanes of
    :meth:`EncoderDecoder.new_cache` (memory and cross K/V computed once).  Both compute the
    memory once; both select the lowest id among the maxima.

    Args:
        model: In evaluation mode.
        src: ``int64[B, S]`` source ids.
        src_mask: ``[B, 1, S]`` (or ``[B, S]``) Boolean source validity (bool or 0/1).
        max_len: Length of ``ys`` including the start token (``>= 1``).
        start_symbol: The decoder-start token id.
        use_cache: Cached (default) or the reference uncached loop.

    Returns:
        :class:`EncDecResult`.

    Raises:
        Rejection: ``model.training_mode`` for a model in training mode;
            ``runtime.invalid_mask`` / ``runtime.empty_input_row`` for a bad source mask or
            one whose shape differs from ``src``.
    """
    if model.training:
        raise Rejection(TRAINING_MODE, "call model.eval() before inference (dropout would be active)", "$.model.training")
    mask_2d = src_mask.squeeze(1) if src_mask.dim() == 3 and src_mask.shape[1] == 1 else src_mask
    valid = check_attention_mask(mask_2d, path="$.src_mask")  # [B, S]
    if valid.shape != src.shape:
        raise Rejection(INVALID_MASK, f"src_mask {tuple(src_mask.shape)} does not cover src {tuple(src.shape)}", "$.src_mask")
    src_mask = valid[:, None, :]  # [B, 1, S]
    batch = src.shape[0]
    with torch.no_grad():  # not inference_mode: the fixed lanes keep their version counters
        memory = model.encode(src, src_mask)  # [B, S, d_model]
        cache = model.new_cache(memory, src_mask) if use_cache else EncDecCache(memory, src_mask, (), [])
        before = cache.fixed_fingerprint()
        ys = torch.full((batch, 1), start_symbol, dtype=torch.long, device=src.device)  # [B, 1]
        scores = []
        for _ in range(max_len - 1):
            if use_cache:
                out = model.decode_step(ys[:, -1:], cache)  # [B, 1, d_model]
            else:
                out = model.decode(memory, src_mask, ys, subsequent_mask(ys.shape[1]).to(src.device))  # [B, t, d_model]
            logprobs = model.generator(out[:, -1])  # [B, V_tgt]
            scores.append(logprobs.float())
            next_word = torch.argmax(logprobs, dim=-1)  # [B]: the first maximal index (lowest id)
            ys = torch.cat([ys, next_word[:, None]], dim=1)  # [B, t + 1]
        after = cache.fixed_fingerprint()
    empty = torch.empty(0, batch, model.generator.proj.out_features)
    return EncDecResult(ys, torch.stack(scores) if scores else empty, cache.lane_frontiers() if use_cache else None, before, after)


def make_model(
    src_vocab: int,
    tgt_vocab: int,
    N: int = 6,  # the Annotated Transformer's name
    d_model: int = 512,
    d_ff: int = 2048,
    h: int = 8,
    dropout: float = 0.1,
    *,
    seed: int = 0,
) -> EncoderDecoder:
    """Build an encoder-decoder with seeded random weights, in evaluation mode.

    Every matrix is ``xavier_uniform_`` (as the Annotated Transformer) and every bias
    ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (``nn.Linear``'s default bound), all drawn from
    ``torch.Generator().manual_seed(seed)`` in parameter order; norm gains 1, offsets 0.

    Args:
        src_vocab, tgt_vocab: Vocabulary sizes.
        N: Layers in the encoder and in the decoder.
        d_model, d_ff, h: Width, feed-forward width, heads.
        dropout: Dropout probability (inactive in evaluation mode).
        seed: Weight seed.
    """
    attn = MultiHeadedAttention(h, d_model, dropout)
    ff = PositionwiseFeedForward(d_model, d_ff, dropout)
    position = PositionalEncoding(d_model, dropout)
    c = copy.deepcopy
    model = EncoderDecoder(
        Encoder(EncoderLayer(d_model, c(attn), c(ff), dropout), N),
        Decoder(DecoderLayer(d_model, c(attn), c(attn), c(ff), dropout), N),
        nn.Sequential(Embeddings(d_model, src_vocab), c(position)),
        nn.Sequential(Embeddings(d_model, tgt_vocab), c(position)),
        Generator(d_model, tgt_vocab),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p, generator=gen)
            elif name.endswith("bias"):
                module = model.get_submodule(name.rsplit(".", 1)[0])
                bound = 1.0 / math.sqrt(module.in_features)
                p.uniform_(-bound, bound, generator=gen)
    return model.eval()
