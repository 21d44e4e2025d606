"""The drafter's tree rows written to its paged cache (TreeExpansion's cache mode, the
one the Triton kernel can serve on a GPU) draft exactly what the rows kept aside in a
store (store mode, the SDPA reference) draft: same children, same scores, at every
draft step of every tree; a draft step of the whole batch reads nothing from the
device (what capturing the draft loop needs). A cache mode that showed the rows a
wrong mask is caught."""

from __future__ import annotations

import pytest
import torch

from tests.vllm.conftest import graft_spec, running_llm

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the nth Fibonacci number.\"\"\"\n" * 3,
           "import os\nimport sys\n\nclass Config:\n", "The quick brown fox"]


def drafted_steps(tiny_models, monkeypatch, rows_in_cache: bool, wrong_mask: bool = False):
    """Every draft step's answers (top-k ids and log-probs, per node) of a greedy run,
    how many steps ran in cache mode, and the host reads of each cache-mode step that
    drafted for the whole batch (the drafter's forward included)."""
    from vllm import SamplingParams

    from vllm_graft.testing.op_counter import OpCounter
    from vllm_graft.vllm import drafter_forwards

    expansion = drafter_forwards.TreeExpansion
    original_expand, original_visible = expansion._expand, expansion._visible_earlier
    answers, cache_steps, host_reads = [], [], []

    def recording_expand(self, step):
        with OpCounter() as counter:
            values, ids = original_expand(self, step)
        if self.store is None and step.active.shape[0] == len(self.root_positions_host):
            host_reads.append(counter.host_waits)
        answers.append((ids.cpu().clone(), values.float().cpu().clone()))
        cache_steps.append(self.store is None)
        return values, ids

    def everything_visible(self, *args):
        return torch.ones_like(original_visible(self, *args))

    with monkeypatch.context() as patch:
        patch.setattr(expansion, "ROWS_IN_CACHE", rows_in_cache)
        patch.setattr(expansion, "_expand", recording_expand)
        if wrong_mask:
            patch.setattr(expansion, "_visible_earlier", everything_visible)
        # block size 32: the trees' rows cross KV blocks; thresholds 0: every tree
        # drafts to full depth (60 rows a request)
        spec = graft_spec(tiny_models.head, budget=60, thresholds=[0.0, 0.0, 0.0])
        with running_llm(tiny_models.target, spec, block_size=32) as llm:
            llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24,
                                                 ignore_eos=True), use_tqdm=False)
    return answers, sum(cache_steps), host_reads


def test_rows_in_the_cache_draft_what_rows_kept_aside_draft(tiny_models, monkeypatch):
    in_cache, cache_steps, host_reads = drafted_steps(tiny_models, monkeypatch,
                                                      rows_in_cache=True)
    aside, aside_cache_steps, _ = drafted_steps(tiny_models, monkeypatch, rows_in_cache=False)
    assert len(host_reads) >= 20 and set(host_reads) == {0}
    assert aside_cache_steps == 0
    assert cache_steps == len(in_cache) >= 20  # every step had its rows in the cache
    assert len(in_cache) == len(aside)
    for (ids, values), (ids_aside, values_aside) in zip(in_cache, aside):
        assert torch.equal(ids, ids_aside)
        torch.testing.assert_close(values, values_aside, rtol=1e-5, atol=1e-5)


def test_a_wrong_mask_over_the_cached_rows_changes_the_drafts(tiny_models, monkeypatch):
    # negative control: every earlier tree row made visible (siblings' and cousins'
    # rows, not only ancestors') must change what the drafter proposes
    right, _, _ = drafted_steps(tiny_models, monkeypatch, rows_in_cache=True)
    wrong, _, _ = drafted_steps(tiny_models, monkeypatch, rows_in_cache=True, wrong_mask=True)
    differing = sum(not torch.allclose(a[1], b[1], atol=1e-4)
                    for a, b in zip(right, wrong) if a[1].shape == b[1].shape)
    assert differing >= len(right) // 2, (differing, len(right))


@pytest.mark.parametrize("prefix, rows, allocated, fits", [
    ([10, 30], 60, [80, 96], True), ([10, 40], 60, [80, 96], False), ([0], 60, [60], True)])
def test_rows_go_to_the_cache_only_inside_the_allocated_slots(prefix, rows, allocated, fits):
    from vllm_graft.vllm.drafter_forwards import TreeExpansion

    assert TreeExpansion.fits_in_cache(prefix, rows, allocated) is fits
