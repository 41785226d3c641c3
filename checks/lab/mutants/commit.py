"""Failure lab, commit group: the frontier, the lane roster, masks and receipts claim state that is not there.

Source: M3.10 0x0B "Commit and streaming bugs", 0x08 "One model call prepares a complete logical
state candidate" (closed lane roster; ALL_NEW only when every lane wrote its interval), 0x06 "One
selection is an output-state transaction" (a receipt is consumed exactly once).
"""

from __future__ import annotations

from . import Patch, mutant

_G = "commit"
_RUNNER = "decodespec.impl.runtime:RequestRunner"


@mutant(
    "final_token_claimed_processed", group=_G, representative=True,
    title="The finishing token is counted as processed without a model call",
    section="M3.10 0x0B Commit and streaming bugs (committing selected final-token K/V without processing that token)",
    statement="impl/runtime.py RequestRunner.commit closes the output with U = [] and P + 1 instead of U = [token] "
    "CLOSED_UNPROCESSED: the frontier claims the final token's K/V although no call processed it (the cache holds P "
    "rows). The output text looks right; STATE fails (frontier pending / processed).",
)
def _final_token_claimed_processed():
    return [Patch(f"{_RUNNER}.commit", edits=[(
        "self.pending_tag = PendingTag.CLOSED_UNPROCESSED",
        "self.pending_ids, self.pending_tag, self.processed = (), PendingTag.EMPTY, self.processed + 1")])]


@mutant(
    "rejected_row_relabelled", group=_G,
    title="A row computed for another token is labelled as the final token's",
    section="M3.10 0x0B Commit and streaming bugs (relabeling rejected candidate K/V as a correction token)",
    statement="impl/runtime.py RequestRunner.launch feeds the repair call the previous input token instead of the "
    "closed final token, and the ledger labels the written slot as the final token's: the cache row exists and has "
    "the right shape, but its values belong to another token, and a resumed request conditions on them. TENSOR fails "
    "(committed K/V rows against the reference after the repair call).",
)
def _rejected_row_relabelled():
    return [Patch(f"{_RUNNER}.launch", edits=[(
        "input_ids = sequence[start:start + length]",
        "shift = 1 if kind is CallKind.REPAIR else 0; input_ids = sequence[start - shift:start + length - shift]")])]


@mutant(
    "missing_lane_all_new", group=_G,
    title="ALL_NEW selected although a layer skipped its cache write",
    section="M3.10 0x0B Commit and streaming bugs (compute path reaches vocabulary logits but one advancing state lane is missing)",
    statement="impl/runtime.py RequestRunner._completion_reason ignores the lane roster and the cache ledger's "
    "commit_call claims every layer's length: a call whose layer skipped its K/V write still exposes its [V] score "
    "and advances the frontier (ALL_NEW), where the contract requires ALL_OLD. STATE fails (phase, quarantine, "
    "frontier) at the completion.",
)
def _missing_lane_all_new():
    return [
        Patch(f"{_RUNNER}._completion_reason", edits=[(
            "if report.generation != call.generation or report.lanes != expected:", "if report.generation != call.generation:")]),
        Patch("decodespec.impl.cache:_CacheLedger.commit_call", edits=[(
            'assert self.complete_layers() == self.abi.num_layers, f"incomplete lane roster {self._writes}"',
            "self._lengths = [call.start + call.length] * self.abi.num_layers  # every lane claimed")]),
    ]


@mutant(
    "pre_append_mask_reused", group=_G,
    title="The pre-append key-validity mask is reused for the call",
    section="M3.10 0x0B Commit and streaming bugs (pre-append decision mask reused as the next call's post-append mask); 0x07",
    statement="impl/cache.py StaticCache.key_validity returns the revision before this call's rows are appended "
    "(slots < committed) instead of the post-append one (slots < committed + T): the call's own rows are invisible "
    "to its queries (a prefill sees no key at all). The mask keeps its [B, S] shape; TENSOR fails on a static cache.",
)
def _pre_append_mask_reused():
    return [Patch("decodespec.impl.cache:StaticCache.key_validity", edits=[("end = self._committed + num_new_tokens", "end = self._committed")])]


@mutant(
    "receipt_consumed_twice", group=_G,
    title="A consumed decision receipt is committed again",
    section="M3.10 0x06 One selection is an output-state transaction; 0x0B Commit and streaming bugs",
    statement="impl/runtime.py RequestRunner.commit looks a receipt id up among the consumed receipts and commits it "
    "again (its token is appended a second time) instead of refusing the duplicate: the exactly-once commit is "
    "broken. STATE fails (the spec refuses the duplicate receipt, the runtime accepts it).",
)
def _receipt_consumed_twice():
    return [Patch(f"{_RUNNER}.commit", edits=[
        ('self._require(all(d.receipt_id != receipt_id for d in self.consumed), "transition.commit", "receipt was never consumed")',
         "pending = next((d for d in self.consumed if d.receipt_id == receipt_id), pending)"),
        ("pending.score_id == self.score.score_id and self.score.generation == self.generation",
         "self.score.generation == self.generation"),
        ("pending.rng_counter_before == self.policy_state.rng_counter", "True"),
    ])]


@mutant(
    "empty_support_refused", group=_G,
    title="An empty legal support refuses the decision instead of finishing the request",
    section="M3.10 0x02 branch table (constraint/parser error: typed terminal error with no unsupported next call)",
    statement="impl/runtime.py RequestRunner.decide re-raises policy.empty_support when the constraint leaves no legal "
    "token: the request stays SCORED, no finish is published and a generate --trace run loses its trace. STATE fails "
    "(the spec finishes with constraint_error, the runtime refuses the decision).",
)
def _empty_support_refused():
    return [Patch(f"{_RUNNER}.decide", edits=[("reason = TERMINAL_DECISION_CODES.get(exc.code)", "reason = None")])]


@mutant(
    "repair_failure_rewrites_finish", group=_G,
    title="A failed repair call rewrites the published finish reason",
    section="M3.10 The first-output off-by-one (the repair call is not another output decision); 0x06 Finish reason and RNG precedence",
    statement="impl/runtime.py RequestRunner._finish takes the canonical reason of every trigger, so a repair call that "
    "fails after length closed the output publishes device_error instead of length. SEQUENCE fails (finish reason).",
)
def _repair_failure_rewrites_finish():
    return [Patch(f"{_RUNNER}._finish", edits=[(
        "self.finish_reason = published_finish_reason(self.triggers)", "self.finish_reason = canonical_finish_reason(self.triggers)")])]


@mutant(
    "repair_ignores_interrupts", group=_G,
    title="A cancel or timeout during the repair call is refused",
    section="M3.10 0x02 branch table (cancellation/timeout in flight: await, select ALL_OLD)",
    statement="impl/runtime.py RequestRunner.interrupt_point maps the FINISHED phase to no interrupt point even while the "
    "repair call is in flight, so a timeout during the repair call is refused and the repair completes. STATE fails "
    "(the spec accepts the interrupt, the runtime refuses it).",
)
def _repair_ignores_interrupts():
    return [Patch(f"{_RUNNER}.interrupt_point", edits=[("call_interrupt_point(self.phase, self.in_flight is not None)",
                                                        "call_interrupt_point(self.phase, self.phase is Phase.IN_FLIGHT)")])]
