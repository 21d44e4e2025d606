"""Copy-chain drafting, the throughput guard's cheap tier: a chain per request from
its context and the successor matrix (no drafter forward), cut by the sizer, the chains
the scout builds to decide whether a plain step should verify chains instead, and the
shadow chains that teach the chain acceptance model what verification never tried."""

from __future__ import annotations

from vllm_graft.core.budget import Choice
from vllm_graft.core.chain import HostChains, walk_chains
from vllm_graft.core.config import StepMode
from vllm_graft.core.context import match_score
from vllm_graft.vllm.draft_records import HostRows, SettledRows, ShadowChain
from vllm_graft.vllm.proposal import StepProposal
from vllm_graft.vllm.tp_agreement import agree


class ChainDrafting:
    """Copy chains of :class:`~vllm_graft.vllm.tree_drafting.GraftTreeDrafting` (its
    matrix, context indexes, sizer and scout)."""

    def _propose_chains(self, runner, settled: list[SettledRows], drafting: list[int],
                        proposal: StepProposal) -> None:
        """The guard's cheap tier: a copy chain per request (:mod:`vllm_graft.core.chain`),
        no drafter forward; the chains the scout built for this batch when it ran them."""
        scouted, proposal.scouted = proposal.scouted, None
        rows = [settled[i].batch_row for i in drafting]
        if scouted is not None and scouted[0] is settled and scouted[1] == rows:
            chains, proposal.choice, proposal.predicted_credit = scouted[2:]
        else:
            chains, proposal.choice, trials = self._build_chains(runner, settled, drafting)
            proposal.shadow_trials += trials
            if proposal.choice is not None and self.guard is not None:
                proposal.predicted_credit = self.predicted_credit(
                    proposal.choice, self._credit_order(runner, settled, drafting))
        chains = agree(chains)
        drafts = proposal.drafts
        tree = chains.to_tree()
        req_ids = runner.input_batch.req_ids
        rows = HostRows([len(tokens) for tokens in chains.tokens], chains.tokens)
        nodes = 0
        for t, i in enumerate(drafting):
            req_id = req_ids[settled[i].batch_row]
            kept = self._schedule(tree, rows, t, req_id, settled[i].batch_row, drafts,
                                  chain=True) - 1
            self._mark_verified(req_id, kept)
            nodes += kept
        proposal.chains = (len(drafting), nodes)

    def _build_chains(self, runner, settled: list[SettledRows], drafting: list[int]
                      ) -> tuple[HostChains, Choice | None, int]:
        """Each drafting request's copy chain, on the host, cut by the sizer (with its
        choice) when budget "auto" is on; the whole chains teach the acceptance model
        once decoding has passed them (:meth:`_shadow_chains`: the nodes it learned from
        come third)."""
        req_ids = runner.input_batch.req_ids
        drafting_ids = [req_ids[settled[i].batch_row] for i in drafting]
        matrix = self.matrix.for_batch(self.partitions(runner, drafting_ids))
        matches = [(0, [])] * len(drafting)
        if self.uses_context:
            indexes = [self._context_index(runner, settled[i]) for i in drafting]
            matches = [index.best_match(self.chain_tokens, shared) for index, shared
                       in zip(indexes, self.shared_outputs(drafting_ids))]
        min_ngram = self.context_config.min_ngram
        chains = walk_chains([settled[i].next_tokens[-1] for i in drafting],
                             [tokens for _, tokens in matches], matrix, self.chain_tokens,
                             self.chain_walk,
                             [match_score(length, min_ngram) for length, _ in matches])
        if self.sizer is None:
            return chains, None, 0
        trials = self._shadow_chains(runner, settled, drafting, chains) \
            if self.uses_context else 0
        return (*self.sizer.trim_chains(chains), trials)

    def _shadow_chains(self, runner, settled: list[SettledRows], drafting: list[int],
                       chains: HostChains) -> int:
        """Teach the chain acceptance model from chain nodes no step verified: each
        drafting request's chain of an earlier build, once decoding has emitted every
        position it proposed (:func:`vllm_graft.core.budget.copied_prefix`), past the
        nodes a chain step verified; and keep this build's whole chain (before any cut)
        for a request with none waiting. A scout's look teaches what plain steps would
        have accepted; a chain step, the odds of the nodes its cut left out, which the
        sizer would otherwise only learn by verifying them (a class once measured poor,
        or never tried, such as the matrix's walk after a copy, would stay cut). Returns
        how many chain nodes it learned from."""
        req_ids = runner.input_batch.req_ids
        outcomes = []
        for t, i in enumerate(drafting):
            req_id = req_ids[settled[i].batch_row]
            context = self.context_indexes[req_id].tokens
            waiting = self.shadows.get(req_id)
            if waiting is not None:
                end = waiting.root + 1 + len(waiting.tokens)
                if len(context) < end:
                    continue  # not every position it proposed was emitted yet
                outcomes.append(waiting.outcome(context[waiting.root + 1:end]))
            self.shadows[req_id] = ShadowChain(len(context) - 1, chains.tokens[t][1:],
                                               chains.source[t][1:], chains.score[t][1:])
        return self.sizer.chain_acceptance.observe_chains(outcomes) if outcomes else 0

    def _mark_verified(self, req_id: str, nodes: int) -> None:
        """A chain step verifies the first ``nodes`` nodes of the chain built this step
        for ``req_id``: its shadow (if chains keep shadows) leaves them to verification's
        lesson."""
        shadow = self.shadows.get(req_id)
        if shadow is not None and shadow.root == len(self.context_indexes[req_id].tokens) - 1:
            shadow.verified = nodes

    def scout_chains(self, runner, settled: list[SettledRows], rate: float | None,
                     proposal: StepProposal) -> bool:
        """Whether this step, which the guard would decode plainly or with trees (measured
        at ``rate``), should verify copy chains instead
        (:class:`vllm_graft.core.budget.ChainScout`); the chains built to decide go into
        ``proposal`` for :meth:`_propose_chains`."""
        proposal.scouted = None
        drafting = [i for i, s in enumerate(settled) if s.drafts and self.may_draft(
            runner.requests[runner.input_batch.req_ids[s.batch_row]],
            s.first_position + len(s.rows), StepMode.CHAIN)]
        if not drafting:
            return False
        chains, choice, trials = self._build_chains(runner, settled, drafting)
        proposal.shadow_trials += trials
        credit = self.predicted_credit(choice, self._credit_order(runner, settled, drafting))
        if not self.scout.promising(credit, choice.step_ms, rate):
            return False
        proposal.scouted = (settled, [settled[i].batch_row for i in drafting], chains, choice,
                            credit)
        return True

    @staticmethod
    def _credit_order(runner, settled: list[SettledRows], drafting: list[int]) -> list[str]:
        """The step's requests in the order of a chain choice's
        :meth:`~vllm_graft.core.budget.Choice.tokens_by_request`: the drafting ones
        first, then the others."""
        req_ids = runner.input_batch.req_ids
        chosen = set(drafting)
        order = drafting + [i for i in range(len(settled)) if i not in chosen]
        return [req_ids[settled[i].batch_row] for i in order]

    def predicted_credit(self, choice: Choice, req_ids: list[str]) -> float:
        """The tokens the throughput guard will credit a chain step of the requests
        ``req_ids`` (in :meth:`_credit_order`) with, as ``choice`` predicts them
        (:meth:`ThroughputGuard.credited_tokens`), not the requests' sum. Predicting
        the sum, the scout fired on a batch where a few requests copied and the median
        one could gain nothing: one chain step a run on gsm8k at batch 32, at 1.5 plain
        steps' time, each emitting one token for most requests (a 2-core CPU). A choice
        that kept no tokens per request (a tree's) is predicted by its sum."""
        if choice.request_tokens is None:
            return choice.step_tokens(len(req_ids))
        return self.guard.credited_tokens(choice.tokens_by_request(len(req_ids)), req_ids)
