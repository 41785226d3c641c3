#!/usr/bin/env python3
"""A foreign runtime for decodespec's gate, written the way a runtime author would: the model calls only.

This file is the worked example of docs/adapters.md ("Write a runtime adapter"). It is an
independent Llama in plain numpy (float32 by default) with a K/V cache, reading the tiny model
that ``decodespec export-tiny --out-dir DIR`` writes (``model.safetensors`` with HF names,
``config.json``, ``tokenizer_table.json``), and it speaks the engine protocol
(``decodespec.engine.v1``, schema ``spec/schemas/engine.v1.json``) on stdin / stdout. The gate's
process owns the request contract (phases, receipts, interrupts, the repair call, refusals); this
process answers "start this request", "run the model over these positions", "roll back to P",
"pick a token from this row", "which finish triggers fire", "show me your K/V rows".

It imports nothing from decodespec (only numpy and the standard library), so it stands for a
runtime in any language. Run the gate on it:

    decodespec export-tiny --out-dir tiny/
    pytest checks/ --model tiny --runtime engine:'python docs/examples/engine_tiny.py --model-dir tiny/'

``--bug cache_position`` (or ``ENGINE_TINY_BUG=cache_position``) plants a cache bug: a call that
appends to a non-empty cache rotates its rows as if they sat one position further on (an
off-by-one ``cache_position``). The gate catches it at TENSOR.

What it declares: greedy decoding with the ``logit_bias`` and ``min_new_tokens`` transforms, the
no-cache / dynamic / static cache families, chunked prefill, static capacity, cache reuse, the
raw row, the processed row (``policy_rows``), the committed K/V rows (``cache_probe``) and eager
attention (its attention is always the explicit softmax formulation). It
also has temperature / top-k sampling with its own numpy RNG; that RNG is not the spec's
request RNG, so a sampled id could differ from the spec's draw: ``sampling`` is NOT declared
(``--declare-sampling`` declares it anyway, to see the gate judge a foreign sampler).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np

PROTOCOL = "decodespec.engine.v1"


# ----------------------------------------------------------------------------------------------
# Model files
# ----------------------------------------------------------------------------------------------

def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (8-byte little-endian header size, JSON header, raw bytes)."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    dtypes = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        raw = data[8 + size + start:8 + size + end]
        out[name] = np.frombuffer(raw, dtype=dtypes[entry["dtype"]]).reshape(entry["shape"])
    return out


class TinyLlama:
    """The Llama forward over the exported files (HF tensor names, rotate-half RoPE, tied head)."""

    def __init__(self, model_dir: Path, dtype: str):
        cfg = json.loads((model_dir / "config.json").read_text())
        self.dtype = np.dtype(dtype)
        w = {k: v.astype(self.dtype) for k, v in read_safetensors(model_dir / "model.safetensors").items()}
        self.layers = int(cfg["num_hidden_layers"])
        self.heads = int(cfg["num_attention_heads"])
        self.kv_heads = int(cfg["num_key_value_heads"])
        self.head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // self.heads)
        self.vocab = int(cfg["vocab_size"])
        self.window = int(cfg["max_position_embeddings"])
        self.eps = float(cfg["rms_norm_eps"])
        self.theta = float(cfg.get("rope_theta", 10000.0))
        self.embed = w["model.embed_tokens.weight"]  # [V, d]
        self.norm = w["model.norm.weight"]
        self.head = w.get("lm_head.weight", self.embed)  # tied: logits = h @ embed.T
        self.w = w
        table = json.loads((model_dir / "tokenizer_table.json").read_text())
        self.token_bytes = {t["id"]: bytes.fromhex(t["hex"]) if t.get("hex") else b"" for t in table["tokens"]}

    def rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(var + self.eps) * weight

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate-half RoPE (HF order) of ``x`` ``[heads, T, D]`` at ``positions`` ``[T]``."""
        half = self.head_dim // 2
        inv = 1.0 / (self.theta ** (np.arange(0, half, dtype=np.float64) * 2 / self.head_dim))
        angles = positions[:, None].astype(np.float64) * inv[None, :]  # [T, D/2]
        cos = np.cos(np.concatenate([angles, angles], -1)).astype(self.dtype)
        sin = np.sin(np.concatenate([angles, angles], -1)).astype(self.dtype)
        rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def forward(self, ids: list[int], positions: np.ndarray, cache: "KVCache | None", start: int) -> np.ndarray:
        """Rows of ``ids`` at ``positions``; with a cache, the new K/V rows go to slots ``start..`` and attention reads
        slots ``[0, start + T)``. Returns the logits of the last row, float32[V]."""
        T, D, H, Hk = len(ids), self.head_dim, self.heads, self.kv_heads
        x = self.embed[np.asarray(ids)]  # [T, d]
        past_k: list[np.ndarray] = []
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            h = self.rms(x, self.w[p + "input_layernorm.weight"])
            q = (h @ self.w[p + "self_attn.q_proj.weight"].T).reshape(T, H, D).transpose(1, 0, 2)
            k = (h @ self.w[p + "self_attn.k_proj.weight"].T).reshape(T, Hk, D).transpose(1, 0, 2)
            v = (h @ self.w[p + "self_attn.v_proj.weight"].T).reshape(T, Hk, D).transpose(1, 0, 2)
            q, k = self.rope(q, positions), self.rope(k, positions)
            if cache is not None:
                cache.write(layer, start, k, v)
                k_all, v_all = cache.read(layer, start + T)
                offset = start
            else:
                k_all, v_all, offset = k, v, 0
            S = k_all.shape[1]
            group = H // Hk
            k_rep, v_rep = np.repeat(k_all, group, axis=0), np.repeat(v_all, group, axis=0)  # [H, S, D]
            scores = q @ k_rep.transpose(0, 2, 1) / np.asarray(math.sqrt(D), dtype=self.dtype)  # [H, T, S]
            causal = np.arange(S)[None, :] > (offset + np.arange(T))[:, None]  # key after query
            scores = np.where(causal[None], -np.inf, scores)
            scores = scores - scores.max(-1, keepdims=True)
            probs = np.exp(scores)
            probs = probs / probs.sum(-1, keepdims=True)
            attn = (probs @ v_rep).transpose(1, 0, 2).reshape(T, H * D)
            x = x + attn @ self.w[p + "self_attn.o_proj.weight"].T
            h = self.rms(x, self.w[p + "post_attention_layernorm.weight"])
            gate = h @ self.w[p + "mlp.gate_proj.weight"].T
            up = h @ self.w[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ self.w[p + "mlp.down_proj.weight"].T
        last = self.rms(x[-1], self.norm)
        return (last @ self.head.T).astype(np.float32)


class KVCache:
    """K (after RoPE) and V rows per layer: ``[layers, H_kv, slots, D]``; dynamic grows, static holds ``capacity`` slots."""

    def __init__(self, model: TinyLlama, capacity: int | None):
        self.model, self.capacity = model, capacity
        slots = capacity or 0
        shape = (model.layers, model.kv_heads, slots, model.head_dim)
        self.k, self.v = np.zeros(shape, model.dtype), np.zeros(shape, model.dtype)
        self.length = 0  # P: rows held

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        end = start + k.shape[1]
        if self.capacity is None and end > self.k.shape[2]:  # dynamic: grow
            grow = end - self.k.shape[2]
            pad = np.zeros((self.model.layers, self.model.kv_heads, grow, self.model.head_dim), self.model.dtype)
            self.k, self.v = np.concatenate([self.k, pad], 2), np.concatenate([self.v, pad], 2)
        self.k[layer, :, start:end], self.v[layer, :, start:end] = k, v
        if layer == self.model.layers - 1:
            self.length = end

    def read(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def crop(self, processed: int) -> None:
        self.length = min(self.length, processed)
        if self.capacity is None:
            self.k, self.v = self.k[:, :, :processed].copy(), self.v[:, :, :processed].copy()
        else:
            self.k[:, :, processed:] = 0
            self.v[:, :, processed:] = 0

    def reset(self) -> None:
        self.crop(0)

    @property
    def physical(self) -> int:
        return self.capacity if self.capacity is not None else self.k.shape[2]


# ----------------------------------------------------------------------------------------------
# The engine: one request at a time
# ----------------------------------------------------------------------------------------------

class EngineError(Exception):
    """An answer ``{"error": {"code", "message"}}`` with a registered decodespec error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Engine:
    def __init__(self, model_dir: Path, dtype: str, bug: str | None, declare_sampling: bool):
        self.model_dir, self.dtype, self.bug = model_dir, dtype, bug
        self.declare_sampling = declare_sampling
        self.model: TinyLlama | None = None
        self.cache: KVCache | None = None
        self.config: dict = {}
        self.rng = np.random.default_rng(0)

    def loaded(self, config: dict) -> TinyLlama:
        if config["model"] != "tiny":
            raise EngineError("adapter.unsupported", f"this engine runs the tiny model only, not {config['model']!r}")
        if self.model is None:
            self.model = TinyLlama(self.model_dir, self.dtype)
        return self.model

    # -- methods ---------------------------------------------------------------------------
    def hello(self, protocol: str) -> dict:
        caps = ["cache:none", "cache:dynamic", "cache:static", "prefill_chunk", "runtime.static_capacity", "reuse",
                "policy_rows", "cache_probe", "transform:logit_bias", "transform:min_new_tokens", "termination.min_new_tokens",
                "runtime.attention:eager"]
        if self.declare_sampling:
            caps += ["sampling", "transform:temperature", "transform:top_k"]
        return {"protocol": PROTOCOL, "name": "engine_tiny", "version": "1", "language": "python (numpy)",
                "capabilities": caps, "methods": ["triggers", "text", "cache_probe"]}

    def window(self, config: dict) -> dict:
        return {"window": self.loaded(config).window}

    def start(self, config: dict, context_cap: int, reuse: bool) -> dict:
        model = self.loaded(config)
        if config["dtype"] != "float32" or config["device"] != "cpu":
            raise EngineError("adapter.unsupported", "float32 on the CPU only")
        policy = config["policy"]
        if policy["family"] not in ("greedy", "multinomial"):
            raise EngineError("adapter.unsupported", f"no {policy['family']!r} family")
        for t in policy.get("transforms", []):
            if t["name"] not in ("logit_bias", "min_new_tokens", "temperature", "top_k"):
                raise EngineError("adapter.unsupported", f"no {t['name']!r} transform")
        prompt = config["prompt_ids"]
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < model.vocab), None)
        if bad is not None:
            raise EngineError("runtime.invalid_request", f"prompt_ids[{bad}] = {prompt[bad]} is not an id in [0, {model.vocab})")
        L, G = len(prompt), config["max_new_tokens"]
        if config["cache"] == "none":
            self.cache = None
        else:
            capacity = None
            if config["cache"] == "static":
                capacity = config["static_capacity"] or min(L + G + 1, model.window)
                if capacity > model.window:
                    raise EngineError("model.context_window_exceeded", f"static capacity {capacity} > window {model.window}")
                if capacity < L + (1 if G else 0):
                    raise EngineError("cache.capacity_exceeded", f"static capacity {capacity} cannot hold the prompt")
            old = self.cache
            if reuse and old is not None and old.capacity == capacity:
                old.reset()  # the same cache object, every row forgotten
            else:
                self.cache = KVCache(model, capacity)
        self.config, self.context_cap = config, context_cap
        self.rng = np.random.default_rng(config["seed"] or 0)
        return self.frontiers()

    def frontiers(self) -> dict:
        if self.cache is None:
            return {"processed": 0, "physical": 0}
        return {"processed": self.cache.length, "physical": self.cache.physical}

    def forward(self, start: int, length: int, ids: list[int]) -> dict:
        positions = np.arange(start, start + length)
        if self.bug == "cache_position" and self.cache is not None and start > 0:
            positions = positions + 1  # the planted bug: rows appended to a non-empty cache are rotated one slot too far
        if self.cache is not None and self.cache.capacity is not None and start + length > self.cache.capacity:
            raise EngineError("cache.capacity_exceeded", f"write [{start}, {start + length}) past {self.cache.capacity} slots")
        row = self.model.forward(ids, positions, self.cache, start)
        return {"logits": row.tolist(), **self.frontiers()}

    def rollback(self, processed: int) -> dict:
        if self.cache is not None:
            self.cache.crop(processed)
        return self.frontiers()

    def decide(self, logits: list[float], ids: list[int], output_count: int) -> dict:
        """Greedy (lowest id on ties) or temperature / top-k sampling, after the logit bias and the min_new_tokens mask."""
        scores = np.asarray(logits, dtype=np.float64)
        policy, c = self.config["policy"], self.config
        names = {t["name"]: t for t in policy.get("transforms", [])}
        if "logit_bias" in names:
            for token, bias in names["logit_bias"]["bias"].items():
                scores[int(token)] += bias
        if output_count < c["min_new_tokens"]:
            scores[[t for t in c["eos_ids"] if t < len(scores)]] = -np.inf
        if policy["family"] == "multinomial":
            if "temperature" in names and names["temperature"]["temperature"] > 0:
                scores = scores / names["temperature"]["temperature"]
            if "top_k" in names:
                k = names["top_k"]["k"]
                order = np.lexsort((np.arange(len(scores)), -scores))  # descending score, lower id first
                scores[order[k:]] = -np.inf
        support = np.flatnonzero(np.isfinite(scores))
        probs = np.exp(scores[support] - scores[support].max())
        probs /= probs.sum()
        if policy["family"] == "greedy":
            token = int(np.argmax(scores))
        else:
            token = int(support[self.rng.choice(len(support), p=probs)])
        return {"token_id": token, "support_ids": support.tolist(), "support_probs": probs.tolist(),
                "draws": 0 if policy["family"] == "greedy" else 1}

    def triggers(self, ids: list[int], output_count: int) -> dict:
        fired = []
        if ids[-1] in self.config["eos_ids"]:
            fired.append("eos")
        if len(ids) >= self.context_cap:
            fired.append("context_length")
        if output_count >= self.config["max_new_tokens"]:
            fired.append("length")
        return {"triggers": fired}

    def text(self, ids: list[int]) -> dict:
        return {"text": b"".join(self.model.token_bytes.get(i, b"") for i in ids).decode("utf-8", errors="replace")}

    def cache_probe(self, processed: int) -> dict:
        k, v = self.cache.k[:, :, :processed], self.cache.v[:, :, :processed]
        return {"cache": np.stack([k, v], axis=1).astype(np.float32).tolist()}  # [layers, 2, H_kv, P, D]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, type=Path, help="the folder decodespec export-tiny wrote")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="compute dtype (rows are sent as float32)")
    parser.add_argument("--bug", default=os.environ.get("ENGINE_TINY_BUG") or None, choices=["cache_position"],
                        help="plant a cache bug (also ENGINE_TINY_BUG)")
    parser.add_argument("--declare-sampling", action="store_true", help="declare the foreign sampler (its RNG is not the spec's)")
    args = parser.parse_args()
    engine = Engine(args.model_dir, args.dtype, args.bug, args.declare_sampling)
    out = sys.stdout
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        method, params = request["method"], request["params"]
        try:
            result = getattr(engine, method)(**params) if method != "stop" else {}
            answer = {"id": request["id"], "result": result}
        except EngineError as exc:
            answer = {"id": request["id"], "error": {"code": exc.code, "message": exc.message}}
        out.write(json.dumps(answer) + "\n")
        out.flush()
        if method == "stop":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
