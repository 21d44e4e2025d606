"""The target logits vLLM computes for every tree node equal Hugging Face transformers
run on prompt + root-to-node path: positions, tree mask and KV handling are right for
every node (drafted or retrieved, accepted or not), across steps (accepted KV moved)
and across KV blocks."""

from __future__ import annotations

import torch

from tests.vllm.conftest import graft_spec, running_llm

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the nth Fibonacci number.\"\"\"\n" * 3,
           "import os\nimport sys\n\nclass Config:\n"]


def test_every_tree_node_matches_transformers(tiny_models, monkeypatch):
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    import vllm_graft.vllm.tree_sampling as sampling_module

    recorded = []
    original_sample = sampling_module.sample_with_trees

    def recording_sample(runner, logits, spec_decode_metadata):
        step = runner._graft_step
        trees = list(step.trees) if step else []
        counts = torch.tensor(spec_decode_metadata.num_draft_tokens) + 1
        starts = torch.cumsum(counts, 0) - counts
        recorded.append({
            "trees": trees,
            "prefixes": {t.req_id: runner.input_batch.token_ids_cpu[
                t.batch_row, :t.prefix_len + 1].tolist() for t in trees},
            "logits": [logits[starts[t.batch_row] + torch.arange(t.tree.tokens.numel())].clone()
                       for t in trees]})
        return original_sample(runner, logits, spec_decode_metadata)

    monkeypatch.setattr(sampling_module, "sample_with_trees", recording_sample)
    # block size 32: prompts and trees cross KV block boundaries
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=60),
                     block_size=32) as llm:
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                     use_tqdm=False)

    model = AutoModelForCausalLM.from_pretrained(str(tiny_models.target),
                                                 dtype=torch.float32).eval()
    steps = [r for r in recorded if r["trees"]]
    assert len(steps) >= 5
    checked, worst, linear_differs = 0, 0.0, 0
    for record in steps[::3]:
        for t, verified in enumerate(record["trees"]):
            prefix = record["prefixes"][verified.req_id]
            tokens, parents = verified.tree.tokens.tolist(), verified.tree.parents.tolist()
            for node in range(len(tokens)):
                path, j = [], node
                while j > 0:
                    path.append(tokens[j])
                    j = parents[j]
                sequence = prefix + path[::-1]
                with torch.no_grad():
                    expected = model(torch.tensor([sequence])).logits[0, -1]
                got = record["logits"][t][node]
                worst = max(worst, float((got - expected).abs().max()))
                checked += 1
                if node > 1 and parents[node] != node - 1:  # a linear reading would differ
                    linear = prefix + tokens[1:node + 1]
                    with torch.no_grad():
                        wrong = model(torch.tensor([linear])).logits[0, -1]
                    linear_differs += int((wrong - expected).abs().max() > 1e-2)
    assert checked >= 100
    assert linear_differs > 10  # the trees really branch, so the check has teeth
    assert worst < 1e-3, worst
