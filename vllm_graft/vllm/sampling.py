"""Which requests may be speculated with a tree.

Tree acceptance samples every node with vLLM's own sampler, so everything that depends
only on the node's logits works unchanged on trees: temperature, top-k, top-p, min-p,
logit bias, allowed tokens, seeds, logprobs. Features whose effect depends on the tokens
emitted before (penalties, bad words, min_tokens until reached, structured outputs,
thinking budgets, watermarking) would need that history per tree path; such a request
gets no tree and is decoded by vLLM's sampler alone, which is exact.
"""

from __future__ import annotations


def plain_decoding_reason(params, num_output_tokens: int) -> str | None:
    """Why this request must be decoded without a tree right now (None: it may use one)."""
    if params is None:
        return "not a generation request"
    if (params.presence_penalty or params.frequency_penalty
            or params.repetition_penalty != 1.0):
        return "penalties"
    if params.bad_words or getattr(params, "_bad_words_token_ids", None):
        return "bad_words"
    if num_output_tokens < params.min_tokens:
        return "min_tokens"
    if params.structured_outputs is not None:
        return "structured_outputs"
    if params.thinking_token_budget is not None:
        return "thinking_token_budget"
    if getattr(params, "watermarking", None):
        return "watermarking"
    return None


def filters_are_plain_sampling(sampling_metadata) -> bool:
    """Whether vLLM's sampler would draw each row of this batch from temperature, top-k
    and top-p applied to the raw logits alone (greedy rows: the argmax), with no
    logprobs to return and no seeded generator to follow: then Graft's fused sampled
    acceptance (:func:`vllm_graft.ops.graft_accept_sampled`) samples what vLLM's sampler
    would, in one op for the whole tree walk. Anything else that edits logits (min-p,
    logit bias, allowed tokens, bad words, penalties, thinking budgets, another logits
    processor holding a request) or consumes a request's own random stream keeps the
    walk with vLLM's sampler at each level."""
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    if sampling_metadata.all_greedy or sampling_metadata.generators:
        return False
    if sampling_metadata.max_num_logprobs is not None or sampling_metadata.logprob_token_ids:
        return False
    if sampling_metadata.allowed_token_ids_mask is not None \
            or sampling_metadata.bad_words_token_ids or not sampling_metadata.no_penalties:
        return False
    holder = sampling_metadata.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return False
    processors = sampling_metadata.logitsprocs
    for processor in (*processors.argmax_invariant, *processors.non_argmax_invariant):
        if isinstance(processor, LogitBiasLogitsProcessor) and not processor.biases:
            continue
        if isinstance(processor, MinTokensLogitsProcessor) and not processor.min_toks:
            continue
        if isinstance(processor, MinPLogitsProcessor) and not processor.min_p_count:
            continue
        return False
    return True


def argmax_is_the_sample(sampling_metadata) -> bool:
    """Whether vLLM's sampler would emit the plain argmax of the raw logits at every row
    of this batch: every request greedy, no logprobs, and nothing that edits logits
    before the greedy choice (allowed-token masks, bad words, penalties, thinking
    budgets, or an active logits processor that can move the argmax: vLLM's built-in
    logit bias and min-tokens processors hold no request; any other such processor
    counts as active). Then a tree's acceptance needs only the argmax at each row, read
    from the same top-k pass the successor matrix learns from."""
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    if not sampling_metadata.all_greedy or sampling_metadata.max_num_logprobs is not None:
        return False
    if sampling_metadata.logprob_token_ids or sampling_metadata.allowed_token_ids_mask \
            is not None or sampling_metadata.bad_words_token_ids \
            or not sampling_metadata.no_penalties:
        return False
    holder = sampling_metadata.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return False
    for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
        if isinstance(processor, LogitBiasLogitsProcessor) and not processor.biases:
            continue
        if isinstance(processor, MinTokensLogitsProcessor) and not processor.min_toks:
            continue
        return False
    return True
