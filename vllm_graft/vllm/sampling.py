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
