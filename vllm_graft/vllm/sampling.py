"""Which requests may be speculated with a tree, and the target distribution they use.

Tree acceptance reproduces vLLM's sampler for temperature, top-k, top-p and seeds
(using vLLM's own top-k/top-p code, so ties and the "keep at least one" rule match).
Features that vLLM applies along a *chain* of drafts (penalties, bad words, logit bias,
allowed tokens, min-p, min_tokens, structured outputs, thinking budgets) are not
reimplemented per tree path: such a request simply gets no drafts and is decoded by
vLLM's own sampler, which is exact. Logprobs are supported: they are the target's raw
logprobs at the row that produced each emitted token, as in plain decoding.
"""

from __future__ import annotations

import torch

from vllm_graft.core.acceptance import ProbsFn, SamplingBatch

SAMPLING_EPS = 1e-5  # vLLM's threshold below which a temperature means greedy


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
    if params.logit_bias:
        return "logit_bias"
    if params.allowed_token_ids:
        return "allowed_token_ids"
    if params.min_p and params.min_p > SAMPLING_EPS:
        return "min_p"
    if params.structured_outputs is not None:
        return "structured_outputs"
    if params.logprob_token_ids:
        return "logprob_token_ids"
    if params.thinking_token_budget is not None:
        return "thinking_token_budget"
    if getattr(params, "watermarking", None):
        return "watermarking"
    return None


def sampling_batch(sampling_metadata, batch_rows: torch.Tensor) -> SamplingBatch:
    """Settings of the requests at ``batch_rows`` (persistent-batch rows) for the core."""
    count = batch_rows.numel()
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        return SamplingBatch.greedy(count, device=batch_rows.device)
    temperature = sampling_metadata.temperature[batch_rows].float()
    temperature = torch.where(temperature < SAMPLING_EPS, 0.0, temperature)
    generators = {}
    for i, row in enumerate(batch_rows.tolist()):
        gen = sampling_metadata.generators.get(row)
        if gen is not None:
            generators[i] = gen
    return SamplingBatch(
        temperature=temperature,
        top_k=None if sampling_metadata.top_k is None else sampling_metadata.top_k[batch_rows],
        top_p=None if sampling_metadata.top_p is None else sampling_metadata.top_p[batch_rows],
        generators=generators,
    )


def vllm_probs_fn(params: SamplingBatch) -> ProbsFn:
    """Target distribution as vLLM's sampler computes it: temperature, then vLLM's own
    top-k / top-p, then a float32 softmax."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    def probs(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        logits = logits.float() / params.temperature[idx].clamp(min=SAMPLING_EPS).unsqueeze(1)
        top_k = None if params.top_k is None else params.top_k[idx]
        top_p = None if params.top_p is None else params.top_p[idx]
        logits = apply_top_k_top_p(logits, top_k, top_p)
        return logits.softmax(dim=-1, dtype=torch.float32)

    return probs


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's greedy choice (its CPU op where it uses one), so ties break alike."""
    if logits.device.type == "cpu" and hasattr(torch.ops._C, "greedy_argmax"):
        return torch.ops._C.greedy_argmax(logits.float().contiguous()).long().view(-1)
    return logits.argmax(dim=-1)
