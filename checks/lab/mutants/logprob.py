"""Failure lab, logprob group: the recorded logprob is not log-softmax of the raw selecting row at the token.

Source: M3.10 0x0B "RNG and policy-state bugs" (generated token logprob read from next-step
logits); M3.8 0x12 items 9 and 12, 66 (log-prob mode pinned: raw, before temperature).
"""

from __future__ import annotations

from . import Patch, mutant

_G = "logprob"
_RAW = "ScoreKind.LOGITS: lambda: torch.log_softmax(raw, dim=-1)"


@mutant(
    "logprob_next_step", group=_G, representative=True,
    title="A token's logprob read from the next step's logits",
    section="M3.10 0x0B RNG and policy-state bugs (generated token logprob read from next-step logits)",
    statement="impl/runtime.py RequestRunner._select_all_new overwrites the previous token's logprob with "
    "log-softmax of the new call's row at that token: the vocabulary shape matches, but the score refers to the "
    "following token's distribution. DECISION fails (logprobs against the reference).",
)
def _logprob_next_step():
    return [Patch("decodespec.impl.runtime:RequestRunner._select_all_new", edits=[(
        "\n    self.score = score\n",
        "\n    self.score = score\n    if self.logprobs:\n"
        "        self.logprobs[-1] = float(torch.log_softmax(score.logits.float(), dim=-1)[self.output_ids[-1]])\n")])]


@mutant(
    "logprob_after_temperature", group=_G,
    title="Logprob taken after temperature instead of from the raw row",
    section="M3.8 0x12 item 66 (log-prob mode); M3.10 Correctness matrix (logprob metadata); docs/design.md section 8",
    statement="impl/policy.py decide computes the receipt's raw logprob from the row divided by the policy's "
    "temperature: the declared contract is log-softmax of the raw logits. Greedy rows without a temperature are "
    "unaffected; DECISION fails on sampled rows (the decision's logprob).",
)
def _logprob_after_temperature():
    return [Patch("decodespec.impl.policy:decide", edits=[(
        "raw = row.to(torch.float32)",
        "raw = row.to(torch.float32) / next((float(t.get('temperature')) for t in config.transforms "
        "if t.name == 'temperature' and t.get('temperature')), 1.0)")])]


@mutant(
    "logprob_wrong_axis", group=_G,
    title="Log-softmax over the row axis instead of the vocabulary",
    section="M3.8 0x12 item 9 (softmax over the sequence axis); M3.10 0x0B (normalizing on the wrong axis)",
    statement="impl/policy.py decide normalizes the [1, V] row over dim=0: every entry is its own normalizer, so "
    "every recorded logprob is 0. Same shape; DECISION fails (logprob).",
)
def _logprob_wrong_axis():
    return [Patch("decodespec.impl.policy:decide", edits=[(_RAW, "ScoreKind.LOGITS: lambda: torch.log_softmax(raw, dim=0)")])]


@mutant(
    "logprob_low_precision", group=_G,
    title="log(softmax) in half precision instead of log_softmax",
    section="M3.8 0x12 item 12 (computing log(softmax(logits)) as separate low-precision operations)",
    statement="impl/policy.py decide records log(softmax(row)) computed in float16: the probabilities round to 11 "
    "significant bits (and underflow to 0 far in the tail), so the logprob is off by far more than the declared "
    "tolerance. DECISION fails (logprob).",
)
def _logprob_low_precision():
    return [Patch("decodespec.impl.policy:decide", edits=[(
        _RAW, "ScoreKind.LOGITS: lambda: torch.log(torch.softmax(raw.half(), dim=-1)).float()")])]
