"""Which requests the drafter follows and which may draft in a step: the admission
decided once per request (:meth:`DraftingAdmission.admit`), the modes no request of a
batch can draft in, and each request's obstacle to drafting in a step's mode."""

from __future__ import annotations

from vllm_graft.core.config import StepMode
from vllm_graft.vllm.sampling import plain_decoding_reason


def speculates_ever(req_state) -> bool:
    """Whether the request's options allow drafts at some point of its life: all but
    ``min_tokens`` of the reasons for plain decoding last as long as the request."""
    params = req_state.sampling_params
    return params is not None and plain_decoding_reason(params, params.min_tokens) is None


def speculates_now(req_state) -> bool:
    """Whether the request's options allow drafts at its next position."""
    return plain_decoding_reason(req_state.sampling_params,
                                 len(req_state.output_token_ids)) is None


class DraftingAdmission:
    """Admission and drafting obstacles of the drafting rounds
    (:class:`~vllm_graft.vllm.tree_drafting.GraftTreeDrafting` holds the per-request
    tables these methods read and write)."""

    #: with budget "auto", a request whose tree was cut to nothing skips drafting (the
    #: drafter's cost with it) and tries again after this many plain steps
    REPROBE_STEPS = 8

    def admit(self, req_states, trees_in_reach: bool) -> None:
        """Decide, for each request seen for the first time, whether the drafter reads
        its positions, for its whole life: not when the throughput guard had measured
        trees well below the fastest mode at the batch size it arrived in
        (``trees_in_reach`` false), nor when the request's options forbid speculation
        for its whole life (:func:`speculates_ever`). The drafter's pass over such a
        request's prompt, the projection of its rows and their deferral would serve
        only trees, which it then never drafts (copy chains and plain decoding need no
        drafter). The runner admits a round's requests before anything asks
        :meth:`follows`."""
        for req_state in req_states:
            if req_state.req_id not in self.drafter_follows:
                self.drafter_follows[req_state.req_id] = self._would_follow(
                    req_state, trees_in_reach)

    def follows(self, req_state) -> bool:
        """Whether the drafter reads this request's positions (decided by :meth:`admit`)."""
        return self.drafter_follows[req_state.req_id]

    def would_follow_any(self, req_states, trees_in_reach: bool) -> bool:
        """Whether the drafter follows (or, at first sight, would follow) any of
        ``req_states``: without one, no request can draft a tree this step."""
        return any(self._would_follow(state, trees_in_reach) for state in req_states)

    def _would_follow(self, req_state, trees_in_reach: bool) -> bool:
        """:meth:`follows` as it is, or at first sight would be, decided with
        ``trees_in_reach``."""
        follows = self.drafter_follows.get(req_state.req_id)
        if follows is None:
            return trees_in_reach and speculates_ever(req_state)
        return follows

    def unavailable_modes(self, req_states, trees_in_reach: bool) -> tuple[StepMode, ...]:
        """The speculative modes no request of the batch can draft in this step: trees
        without a request that the drafter follows and whose options allow drafting
        now, chains without any such request. A mode the guard chose that drafts
        nothing runs as plain decoding and measures nothing of its own, so its first
        probe would be asked for at every step."""
        now = [state for state in req_states if speculates_now(state)]
        if not now:
            return StepMode.TREE, StepMode.CHAIN
        if not any(self._would_follow(state, trees_in_reach) for state in now):
            return (StepMode.TREE,)
        return ()

    #: :meth:`drafting_obstacle` of a request waiting after its tree was cut to nothing
    WAITING = "waiting after a tree cut to nothing"

    def may_draft(self, req_state, root_position: int, mode: StepMode) -> bool:
        """Whether the request may draft in a step of ``mode`` (no obstacle)."""
        return self.drafting_obstacle(req_state, root_position, mode) is None

    def drafting_obstacle(self, req_state, root_position: int, mode: StepMode) -> str | None:
        """Why the request may not draft in a step of ``mode``, or None: no mode drafts
        while the throughput guard decodes plainly; a tree needs a request the drafter
        follows; the drafts (and the drafter's rows) must fit in the context; a request
        whose last tree budget "auto" found not worth verifying waits
        (:data:`WAITING`: the runner counts its waits with :meth:`wait_a_step`); a
        request whose options depend on earlier tokens is decoded plainly."""
        config = self.settings.config
        if mode is StepMode.PLAIN:
            return "plain step"
        if mode is StepMode.TREE and not self.follows(req_state):
            return "not followed"
        if root_position + max(config.budget, config.max_depth, self.chain_tokens) + 1 \
                > self.max_model_len:
            return "context"
        plain = self.plain_steps.get(req_state.req_id)
        if mode is StepMode.TREE and plain is not None and plain < self.REPROBE_STEPS:
            return self.WAITING
        return None if speculates_now(req_state) else "options"

    def wait_a_step(self, req_id: str) -> None:
        """A waiting request (:data:`WAITING`) sat out one more tree step."""
        self.plain_steps[req_id] += 1
