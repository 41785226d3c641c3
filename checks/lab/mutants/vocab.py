"""Failure lab, vocabulary group: a runtime whose vocabulary is not the checkpoint's, with every shape kept or not.

The gate compares the runtime's ordered vocabulary identity at ``ladder.STATE`` (the hash of its
id -> token-bytes table, which its receipts carry, and its output rows; see
:mod:`decodespec.checks.gate.vocab_check`) with the checkpoint's as the gate reads it.  These bugs are
killed there on the first observation, not by luck at a later layer (a permuted pair of tokens is
only seen by SEQUENCE when one of them happens to be emitted).

Source: M3.8 0x08 The vocabulary-axis identity contract; 0x12 items 25, 26, 53.
"""

from __future__ import annotations

from . import Patch, mutant

_G = "vocabulary"


@mutant(
    "vocab_table_permuted", group=_G, representative=True,
    title="The tokenizer's id order differs from the output-row order (two ids swapped)",
    section="M3.8 0x12 Vocabulary and tying bugs (item 25); 0x08 The vocabulary-axis identity contract",
    statement="impl/tokenizer.py ByteTokenizer.token_bytes decodes id 100 as 'b' and id 101 as 'a' (the table's two rows "
    "swapped), while the head still scores the checkpoint's order: every shape and every score row is right, and text "
    "differs only when one of the two ids is emitted. The runtime's ordered vocabulary hash differs from the "
    "checkpoint's: STATE fails (vocab.hash) on the first observation.",
)
def _vocab_table_permuted():
    return [Patch("decodespec.impl.tokenizer:ByteTokenizer.token_bytes", edits=[(
        "return bytes([token_id - self.NUM_SPECIAL])",
        "return bytes([{100: 101, 101: 100}.get(token_id, token_id) - self.NUM_SPECIAL])")])]


@mutant(
    "vocab_head_resized", group=_G,
    title="The output head has 64 extra (unused, zero) rows",
    section="M3.8 0x12 Vocabulary and tying bugs (item 26); 0x08 The vocabulary-axis identity contract",
    statement="impl/model.py LlamaForCausalLM.forward pads the logits with 64 zero columns (a head resized past the "
    "tokenizer's table, as by a pad-to-multiple resize): the first 512 scores are right, but V_out is 576 and ids the "
    "tokenizer cannot decode get probability. STATE fails (vocab.rows) at the first scored observation, before the "
    "TENSOR shape check.",
)
def _vocab_head_resized():
    return [Patch("decodespec.impl.model:LlamaForCausalLM.forward", edits=[(
        "logits = self.lm_head(hidden_states)  # [B, T_kept, V]",
        "logits = torch.nn.functional.pad(self.lm_head(hidden_states), (0, 64))  # [B, T_kept, V + 64]")])]
