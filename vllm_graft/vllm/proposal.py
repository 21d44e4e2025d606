"""What one drafting round decided: the hand-off from the proposer to the runner.

The runner makes a :class:`StepProposal` at the start of each round (after timing the
step that verified the last one), the throughput guard and the chain scout write their
decisions into it, the proposer fills in what it proposed, and the runner keeps it as
``runner._graft_proposal`` until the next round: the step that verifies the proposal
reads its mode (what to learn, how to sample), and the next round times that step by
what it ran. One value per step, returned and passed, in place of attributes one class
sets and another reads back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_graft.core.budget import Choice
from vllm_graft.core.config import StepMode
from vllm_graft.core.graft import BuildStats
from vllm_graft.step_clock import Spans


@dataclass
class StepProposal:
    """One round's decisions and results.

    mode: the throughput guard's choice for the step being scheduled (``TREE`` without
        a guard: every step drafts trees); trees_in_reach: whether trees are still
        worth preparing for at this batch size (the guard's word; requests seen for the
        first time are followed by the drafter only then)
    scout_replaced: the mode the chain scout turned into a chain step this round (a
        plain or a tree step the guard chose), None: the scout fired no step
    ran: what the proposals really were: a tree or chain round in which no request
        drafted is plain decoding, and is timed as such
    drafts: each persistent-batch row's draft tokens, for the scheduler
    build: the tree build's facts (None: no tree built); chains: copy chains built and
        their nodes (None: none); choice: budget "auto"'s sizing of the round
    predicted_credit: what the guard was predicted to credit a chain round's step with
        (:meth:`ChainDrafting.predicted_credit`), for the scout's correction
    shadow_trials: chain nodes the acceptance model learned from shadows this round
    tree_preparation_spans: the drafter's catch-up that served only trees to come (a
        round that was no tree round but fed the drafter), charged to trees when the
        next round times this one (:attr:`tree_preparation`)
    """

    mode: StepMode = StepMode.TREE
    trees_in_reach: bool = True
    scout_replaced: StepMode | None = None
    ran: StepMode = StepMode.PLAIN
    drafts: list[list[int]] = field(default_factory=list)
    build: BuildStats | None = None
    chains: tuple[int, int] | None = None
    choice: Choice | None = None
    predicted_credit: float | None = None
    shadow_trials: int = 0
    tree_preparation_spans: Spans | None = None
    #: the chains the scout built to decide (settled rows, drafting batch rows, chains,
    #: choice, predicted credit): a chain step it fires verifies these, built once
    scouted: tuple | None = None

    @property
    def tree_preparation(self) -> float:
        """Seconds of :attr:`tree_preparation_spans`. Read by the next round, after the
        step between has read its result from the device, so the catch-up has passed and
        nothing waits (it would wait only for the catch-up itself)."""
        spans = self.tree_preparation_spans
        return 0.0 if spans is None else spans.seconds(wait=True)


def last_proposal(runner) -> StepProposal:
    """The proposal the step now running verifies (before the first round: a tree round
    that drafted nothing, what a fixed budget's first step is)."""
    proposal = getattr(runner, "_graft_proposal", None)
    return proposal if proposal is not None else StepProposal()
