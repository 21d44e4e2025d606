"""One benchmark engine in a process of its own.

``python -m vllm_graft.bench.worker JOB.json RESULT.json``: starts one in-process vLLM
engine with the job's speculative config, warms it up on the job's warm-up prompts
(untimed, prompts no dataset holds), generates every dataset of the job as one batch,
and writes per dataset the generated token ids, the engine's counter deltas and the
wall time. Separate processes keep methods from sharing any process state
(vLLM 0.32 cannot start an engine in a process where its ngram proposer was imported).
"""

from __future__ import annotations

import json
import sys
import time


def generate_counting_steps(llm, prompts: list, params) -> tuple[list[list[int]], list[int]]:
    """Greedy generation through the engine's own step loop, with outputs streamed as
    deltas: each output a request receives is one decoding step that emitted tokens for
    it (the first one is the prefill's token). vLLM's speculative counters only count
    steps that carried drafts, so this is how steps without any draft (prompt lookup
    without a match, a request decoded plainly) are counted too."""
    from vllm.sampling_params import RequestOutputKind

    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    engine = llm.llm_engine
    ids = [f"bench-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    tokens = {request_id: [] for request_id in ids}
    steps = dict.fromkeys(ids, 0)
    while engine.has_unfinished_requests():
        for output in engine.step():
            new = output.outputs[0].token_ids
            if new:
                tokens[output.request_id] += list(new)
                steps[output.request_id] += 1
    return [tokens[i] for i in ids], [steps[i] for i in ids]


def run_job(job: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_graft.cli.common import counter_delta, counters, engine

    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    out = {"datasets": {}}
    started = time.time()
    with engine(job["target"], job["spec"], **job["engine"]) as llm:
        if job.get("warmup"):
            # untimed: the first batches of a fresh engine pay one-off costs (kernel
            # set-up for each new shape, allocator growth, first-touch page faults) that
            # a start-up profile pays for a Graft engine but not for a plain one
            generate_counting_steps(llm, [TokensPrompt(prompt_token_ids=p)
                                          for p in job["warmup"]],
                                    SamplingParams(temperature=0.0, ignore_eos=True,
                                                   max_tokens=job["warmup_tokens"]))
        for name, prompts in job["datasets"].items():
            before = counters(llm)
            start = time.perf_counter()
            tokens, steps = generate_counting_steps(
                llm, [TokensPrompt(prompt_token_ids=p) for p in prompts], params)
            seconds = time.perf_counter() - start
            out["datasets"][name] = {
                "tokens": tokens, "steps": steps,
                "delta": counter_delta(counters(llm), before), "seconds": seconds}
    out["wall_seconds"] = time.time() - started
    return out


def main() -> int:
    from vllm_graft.cli.main import cpu_runtime_defaults

    cpu_runtime_defaults()
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    result = run_job(job)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
