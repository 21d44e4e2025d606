"""One benchmark engine in a process of its own.

``python -m vllm_graft.bench.worker JOB.json RESULT.json``: starts one in-process vLLM
engine with the job's speculative config, warms it up on the job's warm-up prompts
(untimed, prompts no dataset holds), generates every dataset of the job as one batch,
and writes per dataset the generated token ids, the engine's counter deltas and the
wall time. Separate processes keep methods from sharing any process state
(vLLM 0.32 cannot start an engine in a process where its ngram proposer was imported).

``python -m vllm_graft.bench.worker --serve JOB.json REPLY_FD``: the same engine, kept
alive: after its warm-up it writes ``{"ready": true, "warmup_seconds": S}`` to the file
descriptor REPLY_FD, then reads one JSON command a line from standard input,
``{"dataset": NAME}`` (generate that dataset once, reply with its result) or
``{"stop": true}``. The batch sweep keeps one such engine per method and runs them in
turn, round after round, so that a drift in the machine's speed falls on every method
alike.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def generate_counting_steps(llm, prompts: list, params, clock=None
                            ) -> tuple[list[list[int]], list[int], list[tuple[float, float]],
                                       float]:
    """Greedy generation through the engine's own step loop, with outputs streamed as
    deltas: each output a request receives is one decoding step that emitted tokens for
    it (the first one is the prefill's token). vLLM's speculative counters only count
    steps that carried drafts, so this is how steps without any draft (prompt lookup
    without a match, a request decoded plainly) are counted too.

    With a :class:`~vllm_graft.vllm.timing.TargetComputeClock`, also returns for every
    decoding step (every request past its prefill) its wall seconds and the seconds of
    the target's forward and logits in it. Last, the prefill phase's wall seconds: from
    the first step until every request has its first token (with chunked prefill, the
    steps that run prompts, and decoding steps beside them)."""
    from vllm.sampling_params import RequestOutputKind

    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    engine = llm.llm_engine
    ids = [f"bench-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    tokens = {request_id: [] for request_id in ids}
    steps = dict.fromkeys(ids, 0)
    split = []
    prefilled = 0  # requests that received their first token
    started, prefill_seconds = time.perf_counter(), None
    while engine.has_unfinished_requests():
        decoding = clock is not None and prefilled == len(ids)
        compute, start = (clock.seconds, time.perf_counter()) if decoding else (0.0, 0.0)
        outputs = engine.step()
        if decoding:
            split.append((time.perf_counter() - start, clock.seconds - compute))
        for output in outputs:
            new = output.outputs[0].token_ids
            if new:
                tokens[output.request_id] += list(new)
                prefilled += steps[output.request_id] == 0
                steps[output.request_id] += 1
        if prefill_seconds is None and prefilled == len(ids):
            prefill_seconds = time.perf_counter() - started
    if prefill_seconds is None:  # a request that never emitted (cancelled)
        prefill_seconds = time.perf_counter() - started
    return [tokens[i] for i in ids], [steps[i] for i in ids], split, prefill_seconds


def step_split(split: list[tuple[float, float]]) -> dict:
    """Medians over decoding steps, in ms: the whole step, the target's forward and
    logits, and the rest (each step's own difference)."""
    if not split:
        return {}
    return {"decode_steps": len(split),
            "step_ms": round(statistics.median(s for s, _ in split) * 1e3, 3),
            "target_ms": round(statistics.median(t for _, t in split) * 1e3, 3),
            "other_ms": round(statistics.median(s - t for s, t in split) * 1e3, 3)}


def warm_up(llm, job: dict) -> float:
    """Untimed in the datasets' runs: the first batches of a fresh engine pay one-off
    costs (kernel set-up for each new shape, allocator growth, first-touch page faults;
    for budget "auto", the guard's first measurement of each mode at the batch's size)
    that a long-running server pays once. Then one prefill (a token each) of every
    batch in ``warmup_prefills``: each dataset's prefill shapes, on prompts of no
    dataset (:func:`vllm_graft.bench.engines.prefill_warmups`). Returns the warm-up's
    wall seconds, reported beside the runs so that the one-off cost is not hidden."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    if job.get("warmup"):
        generate_counting_steps(llm, [TokensPrompt(prompt_token_ids=p)
                                      for p in job["warmup"]],
                                SamplingParams(temperature=0.0, ignore_eos=True,
                                               max_tokens=job["warmup_tokens"]))
    for batch in job.get("warmup_prefills", ()):  # each dataset's prefill shapes
        # whole prefills: the warm-up text is cached, and a hit would shorten them
        llm.reset_prefix_cache()
        generate_counting_steps(llm, [TokensPrompt(prompt_token_ids=p) for p in batch],
                                SamplingParams(temperature=0.0, ignore_eos=True,
                                               max_tokens=1))
    return time.perf_counter() - start


def run_dataset(llm, job: dict, name: str, clock=None) -> dict:
    """Generate one dataset of the job as one batch: its tokens, steps per request, the
    engine's counter deltas, the wall time, and with a ``clock`` the median split of
    its decoding steps (:func:`step_split`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_graft.offline.engine import counter_delta, counters

    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    # every timed run starts from a cold prefix cache: a later round of the same prompts
    # would otherwise skip its prefill in engines that hit the cache (plain decoding and
    # prompt lookup do; EAGLE-3 and Graft engines drop one 128-token block from every
    # hit, which leaves nothing of these short prompts), and a repeated round would
    # measure that instead of decoding
    llm.reset_prefix_cache()
    before = counters(llm)
    start = time.perf_counter()
    tokens, steps, split, prefill_seconds = generate_counting_steps(
        llm, [TokensPrompt(prompt_token_ids=p) for p in job["datasets"][name]], params,
        clock)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "steps": steps, **step_split(split),
            "prefill_ms": round(prefill_seconds * 1e3, 3),
            "delta": counter_delta(counters(llm), before), "seconds": seconds}


def run_job(job: dict) -> dict:
    from vllm_graft.offline.engine import engine
    from vllm_graft.vllm.timing import install_target_clock

    out = {"datasets": {}}
    started = time.time()
    with engine(job["target"], job["spec"], **job["engine"]) as llm:
        clock = install_target_clock(llm)
        out["warmup_seconds"] = warm_up(llm, job)
        for name in job["datasets"]:
            out["datasets"][name] = run_dataset(llm, job, name, clock)
    out["wall_seconds"] = time.time() - started
    return out


def serve_job(job: dict, commands, replies) -> None:
    """The engine of ``job`` kept alive, running the datasets it is told to (module
    docstring)."""
    from vllm_graft.offline.engine import engine
    from vllm_graft.vllm.timing import install_target_clock

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    with engine(job["target"], job["spec"], **job["engine"]) as llm:
        clock = install_target_clock(llm)
        reply({"ready": True, "warmup_seconds": warm_up(llm, job)})
        for line in commands:
            command = json.loads(line)
            if command.get("stop"):
                break
            reply(run_dataset(llm, job, command["dataset"], clock))


def main() -> int:
    from vllm_graft.offline.engine import cpu_runtime_defaults

    cpu_runtime_defaults()
    if sys.argv[1] == "--serve":
        with open(sys.argv[2]) as f:
            job = json.load(f)
        with os.fdopen(int(sys.argv[3]), "w") as replies:
            serve_job(job, sys.stdin, replies)
        return 0
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    result = run_job(job)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
