"""The head trainer end to end on a tiny target: what it saves loads in vLLM as an
EAGLE-3 drafter and drafts that the target accepts far more often than a random head's
(so the trained forward pass is the served one); and Graft's tree drafting with that
head, shaped as a chain, proposes exactly what vLLM's own EAGLE-3 chain proposes (so
Graft feeds the head the right tokens, positions and hidden states at every depth)."""

from __future__ import annotations

import json

import pytest

from tests.vllm.conftest import graft_spec, running_llm, spec_metrics
from vllm_graft.assets.datasets import Prompt
from vllm_graft.training.data import extract_features, generate_answers, read_answers
from vllm_graft.training.train import train_head

PROMPTS = [Prompt(f"def function_{i}(x):\n    return x * {i}\n" * (1 + i % 3), False, "toy")
           for i in range(48)]


@pytest.fixture(scope="module")
def trained_head(tiny_models, tmp_path_factory):
    work = tmp_path_factory.mktemp("head")
    answers = generate_answers(str(tiny_models.target), PROMPTS, work / "answers.jsonl",
                               max_prompt_tokens=256, max_tokens=64, dtype="float32")
    aux = (1, 2, 3)  # the tiny target has 4 layers
    features = extract_features(str(tiny_models.target), read_answers(answers),
                                work / "features", aux_layers=aux)
    report = train_head(tiny_models.target, features, work / "head", draft_vocab=1024,
                        aux_layers=aux, steps=3, epochs=20, lr=2e-3, batch_tokens=512)
    return work / "head", report


def _metrics(target, spec):
    from vllm import SamplingParams

    with running_llm(target, spec) as llm:
        llm.generate([p.text for p in PROMPTS[:12]],
                     SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                     use_tqdm=False)
        return spec_metrics(llm)


def _acceptance(metrics):
    return metrics["spec_decode_num_accepted_tokens"] / metrics["spec_decode_num_draft_tokens"]


def test_trained_head_is_served_and_accepted(tiny_models, trained_head):
    head, report = trained_head
    config = json.loads((head / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert report["trained_tokens"] > 0 and report["final_top1_accuracy_by_step"][0] > 0.5
    chain = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    trained = _acceptance(_metrics(tiny_models.target, chain))
    random_head = _acceptance(_metrics(tiny_models.target, {**chain, "model": str(tiny_models.head)}))
    assert trained > 0.3 and trained > 5 * random_head, (trained, random_head)


def test_graft_chain_drafts_what_vllms_eagle3_chain_drafts(tiny_models, trained_head):
    head, _ = trained_head
    vllm_chain = _metrics(tiny_models.target,
                          {"method": "eagle3", "model": str(head), "num_speculative_tokens": 7})
    graft_chain = _metrics(tiny_models.target, graft_spec(
        head, variant="dense_tree", top_k=1, max_depth=7, budget=7, checkpoints=[],
        draft_keep=[]))
    # same drafts at every depth -> same per-depth acceptance, step for step
    assert graft_chain["spec_decode_num_accepted_tokens_per_pos"][:7] == \
        vllm_chain["spec_decode_num_accepted_tokens_per_pos"][:7]
    assert graft_chain["spec_decode_num_drafts"] == vllm_chain["spec_decode_num_drafts"]
    assert vllm_chain["spec_decode_num_accepted_tokens_per_pos"][2] > 0  # depth 3 exercised
