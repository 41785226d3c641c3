"""Failure lab, beam group: the joint top-K decision and the coupled branch state of impl/beam.py.

The gate's beam case drives the spec's ``beam_step`` over the runtime's own processed rows (the
decisions, every exported branch lane, the step invariants) and checks each live beam's raw row
against the reference row of its own prefix (TENSOR: the cache follows the parent map).

Source: M3.10 0x0B "Beam bookkeeping bugs", "RNG and policy-state bugs" (beam parent reorder
omits constraint or RNG state), 0x05 "Fork parent state before appending the child token";
M3.8 0x12 items 43 to 47, 0x0F "Length penalty".
"""

from __future__ import annotations

from . import Patch, mutant

_G = "beams"
_DECIDE = "decodespec.impl.beam:BeamRunner.decide"


@mutant(
    "beam_parents_not_gathered", group=_G, representative=True,
    title="Children keep the lanes of the slot they land in, not their parent's",
    section="M3.10 0x0B Beam bookkeeping bugs (parent beam IDs not gathered; beam expansion without row remapping)",
    statement="impl/beam.py BeamRunner.decide forks each live child from the branch in the child's own slot instead "
    "of the parent the flat index names (the cache is still reordered by the parent map): new tokens attach to the "
    "wrong prefix. DECISION fails (exported branch lanes) and TENSOR (the next rows are not the reference rows of "
    "the children's prefixes).",
)
def _beam_parents_not_gathered():
    return [Patch(_DECIDE, edits=[(
        "parent = self.live[parents[i]]",
        "parent = self.live[child_ranks.index(i) % len(self.live)] if i in child_ranks else self.live[parents[i]]")])]


@mutant(
    "beam_completed_expanded", group=_G,
    title="Completed (EOS) beams stay in the live frontier",
    section="M3.10 0x0B Beam bookkeeping bugs (completed beams expanded again); M3.8 0x0F First-step and finished-set contracts",
    statement="impl/beam.py BeamRunner.decide refills the live frontier with the best K candidates including EOS "
    "ones: a hypothesis that completed keeps expanding after EOS while it is also in the completed set. DECISION "
    "fails (the step's live tokens and parents).",
)
def _beam_completed_expanded():
    return [Patch(_DECIDE, edits=[("live_ranks = [i for i in ranks if tokens[i] not in eos][:k]", "live_ranks = list(ranks)[:k]")])]


@mutant(
    "beam_cache_not_reordered", group=_G,
    title="The K/V cache is not reordered with the beams",
    section="M3.10 0x0B Beam bookkeeping bugs (KV cache not reordered with beams); M3.8 0x12 item 45",
    statement="impl/beam.py BeamRunner._reorder keeps cache row r for child r (it only expands the single prefill "
    "row at the first step): the token prefix and the cached prefix are different hypotheses. TENSOR fails (a "
    "live beam's row is not the reference row of its prefix).",
)
def _beam_cache_not_reordered():
    return [Patch("decodespec.impl.beam:BeamRunner._reorder", edits=[(
        "self.cache.reorder_cache(torch.tensor(parents, dtype=torch.long))",
        "self.cache.reorder_cache(torch.arange(len(parents)) % self.cache.batch_size)")])]


@mutant(
    "beam_duplicate_first_step", group=_G,
    title="Every first-step beam initialised from the root",
    section="M3.8 0x12 item 46 (initializing every duplicate first-step beam at zero); M3.8 0x0F First-step contract",
    statement="impl/beam.py BeamRunner starts with K identical live roots (score 0) instead of one: the first step's "
    "candidates are K copies of each token, so duplicates occupy the frontier. DECISION fails (the first step's "
    "parents and branch states).",
)
def _beam_duplicate_first_step():
    return [Patch("decodespec.impl.beam:BeamRunner.__init__", edits=[(
        "consumed_step=None, logprobs=())]", "consumed_step=None, logprobs=())] * params.num_beams")])]


@mutant(
    "beam_token_mod_k", group=_G,
    title="Token decoded from the flat index with % K",
    section="M3.8 0x12 item 44 (using % K to decode a flattened beam candidate token)",
    statement="impl/beam.py BeamRunner.decide decodes the token of flat index i = k V + v as i % K instead of i % V: "
    "every kept token id is below K. DECISION fails (the step's tokens).",
)
def _beam_token_mod_k():
    return [Patch(_DECIDE, edits=[("tokens_t = flat_idx % vocab", "tokens_t = flat_idx % params.num_beams")])]


@mutant(
    "beam_rank_without_parent_scores", group=_G,
    title="Beam candidates ranked without the parents' scores",
    section="M3.8 0x12 item 43 (ranking beam tokens without parent sequence scores)",
    statement="impl/beam.py BeamRunner.decide ranks the flat candidates by the step's log-probabilities alone (the "
    "parents' cumulative scores set to 0): the search chooses local tokens, not scored continuations. DECISION fails "
    "(the kept candidates) once parents' scores differ.",
)
def _beam_rank_without_parent_scores():
    return [Patch(_DECIDE, edits=[(
        "flat_idx = top_flat_candidates(beam_scores, rows64,", "flat_idx = top_flat_candidates(torch.zeros_like(beam_scores), rows64,")])]


@mutant(
    "beam_stop_at_first_eos", group=_G,
    title="Beam search stops at the first completed hypothesis",
    section="M3.8 0x12 item 47 (stopping at the first EOS without a valid score bound)",
    statement="impl/beam.py BeamRunner._may_stop ends the search as soon as one hypothesis completed, whatever the "
    "termination contract: a live hypothesis that could still outrank it under the length score is dropped. "
    "DECISION fails (the stop and the steps after it) under the normative 'exact' termination.",
)
def _beam_stop_at_first_eos():
    return [Patch("decodespec.impl.beam:BeamRunner._may_stop", edits=[
        ("if kind is EarlyStop.AT_CAP or len(completed) < n:", "if kind is EarlyStop.AT_CAP or not completed:"),
        ("if kind is EarlyStop.FIXED_COUNT:", "if completed:"),
    ])]


@mutant(
    "beam_length_penalty_counts_prompt", group=_G,
    title="Length penalty counts the prompt",
    section="M3.8 0x0F Length penalty (|y| counts generated tokens, never the prompt); docs/design.md beam choices",
    statement="impl/beam.py BeamRunner._export normalizes a branch's score by lp(L + |y|) instead of lp(|y|): the "
    "exported normalized score and the completed ranking change. DECISION fails (exported branch lanes, completed "
    "metadata).",
)
def _beam_length_penalty_counts_prompt():
    return [Patch("decodespec.impl.beam:BeamRunner._export", edits=[(
        "normalized=b.score / _lp(self.params.length_penalty, length) if length else None",
        "normalized=b.score / _lp(self.params.length_penalty, length + self.request.prompt_len) if length else None")])]


@mutant(
    "beam_fork_without_policy_state", group=_G,
    title="Beam reorder omits the parent's policy state (constraint / RNG lanes)",
    section="M3.10 0x0B RNG and policy-state bugs (beam parent reorder omits constraint or RNG state); M3.8 0x12 item 45",
    statement="impl/beam.py BeamRunner.decide advances every child's policy state (constraint automaton state, RNG "
    "counter) from the beam in slot 0 instead of its own parent: prefix and cache align, but the child's policy "
    "state belongs to another parent. DECISION fails (the exported constraint lane) under a constraint automaton.",
)
def _beam_fork_without_policy_state():
    return [Patch(_DECIDE, edits=[(
        "policy_state=next_state(self.policy, parent.policy_state,", "policy_state=next_state(self.policy, self.live[0].policy_state,")])]
