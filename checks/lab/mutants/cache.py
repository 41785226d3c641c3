"""Failure lab, cache and position group: slots, key coordinates, RoPE and the cache ABI disagree.

Every bug keeps the tensors' shapes; the gate's TENSOR layer (score rows against the reference
row of the same prefix, committed K/V rows against the reference K/V) sees it.

Source: M3.10 0x0B "Cache and position bugs" and "Cache equivalence bugs", 0x09 "A cache is an
ABI, not an untyped tuple", 0x0A "Position and cache consistency", "Chunked input equivalence".
"""

from __future__ import annotations

from . import Patch, mutant

_G = "cache and positions"
_FORWARD = "decodespec.impl.runtime:RequestRunner._forward"
_MODEL_CALL = "past_key_values=cache, cache_position=cache_position,"


@mutant(
    "cache_position_reset_after_prefill", group=_G, representative=True,
    title="cache_position restarts at 0 after prefill",
    section="M3.10 0x0B Cache and position bugs (cache_position reset after prefill)",
    statement="impl/runtime.py RequestRunner._forward passes cache_position = 0..T-1 for every call after the prefill "
    "(RoPE positions stay right), and the cache trusts the caller's slots (its slot check removed, the static cache "
    "writes at cache_position like HF's index_copy_): generated K/V overwrite prompt K/V in a static cache and the "
    "query's causal coordinate is 0, so it sees only key 0. TENSOR fails (score rows, committed K/V).",
)
def _cache_position_reset_after_prefill():
    return [
        Patch(_FORWARD, edits=[
            ("cache_position = torch.arange(call.start, call.end, device=device)  # [T]",
             "cache_position = torch.arange(call.start, call.end, device=device) - (0 if call.kind is CallKind.PREFILL else call.start)  # [T]"),
            (_MODEL_CALL, _MODEL_CALL + " position_ids=torch.arange(call.start, call.end, device=device)[None],"),
        ]),
        Patch("decodespec.impl.cache:_CacheLedger._check_update", edits=[(
            'if cache_position is not None and cache_position.device.type == "cpu" and shape[2] and (',
            'if False and (')]),
        Patch("decodespec.impl.cache:StaticCache.update", source="decodespec.impl.cache:_CacheLedger.update", edits=[(
            "keys, values = self._store(key_states, value_states, layer_idx, start)",
            "keys, values = self._store(key_states, value_states, layer_idx, start if cache_position is None else int(cache_position[0]))")]),
    ]


@mutant(
    "read_only_seqlen", group=_G,
    title="Cache writes [start, start + T) but attention reads only [:T]",
    section="M3.10 0x0B Cache and position bugs (write [start_pos:start_pos+seqlen] but read only [:seqlen])",
    statement="impl/cache.py DynamicCache.update stores the rows at [start, start + T) but returns only the first T "
    "slots, and key_length reports T: the current token attends to the first T cached rows (the prompt's first "
    "token for a decode call) and the cached history is invisible. Prefill (start 0) is unaffected. TENSOR fails.",
)
def _read_only_seqlen():
    return [
        Patch("decodespec.impl.cache:DynamicCache.update", source="decodespec.impl.cache:_CacheLedger.update", edits=[
            ("return self._peek(key_states, value_states, layer_idx, start)",
             "return tuple(t[..., :num, :] for t in self._peek(key_states, value_states, layer_idx, start))"),
            ("\n    return keys, values\n", "\n    return keys[..., :num, :], values[..., :num, :]\n"),
        ]),
        Patch("decodespec.impl.cache:DynamicCache.key_length", edits=[("return self._lengths[0] + num_new_tokens", "return num_new_tokens")]),
    ]


@mutant(
    "stale_static_slots_visible", group=_G,
    title="Decode without a mask: unfilled static slots become visible",
    section="M3.10 0x0B Cache and position bugs (read stale static-cache slots); Cache equivalence bugs (static cache exposes unfilled slots)",
    statement="impl/model.py LlamaForCausalLM.forward drops the attention mask for a one-row call (every key of a "
    "dynamic cache is history, so the shortcut looks harmless): over a static cache the query reads all S reserved "
    "slots, and the unfilled (zero or stale) slots enter the softmax denominator. TENSOR fails on static-cache decode.",
)
def _stale_static_slots_visible():
    return [Patch("decodespec.impl.model:LlamaForCausalLM.forward", edits=[(
        "mask = build_attention_mask(", "mask = None if q_len == 1 else build_attention_mask(")])]


@mutant(
    "left_padding_position_ids", group=_G, text=True,
    title="Position ids are column indices under left padding",
    section="M3.10 0x0B Cache and position bugs (cache_position and position_ids violate the explicit translation); 0x0A",
    statement="impl/batch.py position_ids_from_mask returns the rectangular column index instead of the valid-token "
    "count minus one: a left-padded row's tokens are rotated for positions shifted by its padding while the decode "
    "steps continue at L_b (the translation receipt no longer holds). TENSOR fails on the left-padded batch.",
)
def _left_padding_position_ids():
    return [Patch("decodespec.impl.batch:position_ids_from_mask", edits=[(
        "return (valid.long().cumsum(dim=-1) - 1).masked_fill_(~valid, PAD_POSITION_FILL)",
        "return torch.arange(valid.shape[-1], device=valid.device).expand(valid.shape).clone()")])]


@mutant(
    "rope_q_not_k", group=_G,
    title="RoPE applied to queries but not to keys before the cache write",
    section="M3.10 0x0B Cache and position bugs (RoPE applied to Q but not K before cache write)",
    statement="impl/model.py LlamaAttention.forward rotates the query heads only; the keys are stored unrotated "
    "although the cache ABI declares keys_rotated: K keeps its shape but lives in the wrong coordinate system. "
    "TENSOR fails (score rows and committed K rows).",
)
def _rope_q_not_k():
    return [Patch("decodespec.impl.model:LlamaAttention.forward", edits=[
        ("key = rotated[:, :, heads:].transpose(1, 2)",
         "key = qkv[..., heads * dim:(heads + kv_heads) * dim].view(batch, q_len, kv_heads, dim).transpose(1, 2)"),
        ("key = rotate_heads(self.k_proj(hidden_states).view(batch, q_len, kv_heads, dim), cos, signed_sin).transpose(1, 2)",
         "key = self.k_proj(hidden_states).view(batch, q_len, kv_heads, dim).transpose(1, 2)"),
    ])]


@mutant(
    "gqa_expanded_before_storage", group=_G,
    title="GQA key/value heads expanded before storage",
    section="M3.10 0x0B Cache equivalence bugs (GQA cache expands KV heads before storage unexpectedly); 0x09 cache ABI",
    statement="impl/model.py LlamaAttention.forward stores K/V expanded to the H query heads (repeat_interleave) in a "
    "dynamic cache, evading the cache's compact-head check (relaxed to a multiple of H_kv, as a cache that accepts "
    "'any head count' would), while the attention still reads the cache as compact and takes its first H_kv heads: "
    "the memory contract and the head-repeat logic disagree. TENSOR fails (score rows; committed K/V have H heads).",
)
def _gqa_expanded_before_storage():
    return [
        Patch("decodespec.impl.model:LlamaAttention.forward", edits=[(
            "key, value = past_key_values.update(key, value, self.layer_idx, cache_position)",
            "n_rep = self.num_key_value_groups if type(past_key_values).__name__ == 'DynamicCache' else 1; "
            "key, value = (t[:, :kv_heads] for t in past_key_values.update(key.repeat_interleave(n_rep, dim=1), "
            "value.repeat_interleave(n_rep, dim=1), self.layer_idx, cache_position))")]),
        Patch("decodespec.impl.cache:DynamicCache._check_update", source="decodespec.impl.cache:_CacheLedger._check_update", edits=[(
            "or shape[1] != self.abi.num_key_value_heads", "or shape[1] % self.abi.num_key_value_heads")]),
    ]


@mutant(
    "chunked_prefill_position_reset", group=_G,
    title="Each prefill chunk restarts its positions at 0",
    section="M3.10 0x0B Cache equivalence bugs (one-shot and chunked prefill use different position resets); 0x0A Chunked input equivalence",
    statement="impl/runtime.py RequestRunner._forward passes position_ids = 0..c-1 for every prefill chunk (the slots "
    "stay right): a chunk after the first is rotated as if it started the sequence, so chunk boundaries change the "
    "model geometry. TENSOR fails (one-shot versus chunked score rows and K rows).",
)
def _chunked_prefill_position_reset():
    return [Patch(_FORWARD, edits=[(
        _MODEL_CALL, _MODEL_CALL + " position_ids=(cache_position - call.start if call.kind is CallKind.PREFILL else cache_position)[None],")])]


@mutant(
    "final_norm_bypassed", group="hidden state", representative=True,
    title="The head reads the hidden states before the final norm",
    section="M3.8 0x12 item 2 (skipping the final norm expected by a Pre-LN checkpoint)",
    statement="impl/model.py LlamaModel.forward computes the final RMSNorm but returns the un-normalized hidden "
    "states to the LM head: same [B, T, d_model] shape, wrong inputs to the projection. TENSOR fails (score rows).",
)
def _final_norm_bypassed():
    return [Patch("decodespec.impl.model:LlamaModel.forward", edits=[(
        "return self.norm(hidden_states)", "self.norm(hidden_states)  # computed for another consumer\n    return hidden_states")])]
