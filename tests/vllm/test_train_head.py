"""The head trainer end to end on a tiny target: what it saves loads in vLLM as an
EAGLE-3 drafter, and drafts that the target accepts far more often than a random
head's (so the trained forward pass is the served one)."""

from __future__ import annotations

import json

from tests.vllm.conftest import running_llm, spec_metrics
from vllm_graft.assets.datasets import Prompt
from vllm_graft.training.data import extract_features, generate_answers, read_answers
from vllm_graft.training.train import train_head

PROMPTS = [Prompt(f"def function_{i}(x):\n    return x * {i}\n" * (1 + i % 3), False, "toy")
           for i in range(48)]


def _acceptance(target, head):
    from vllm import SamplingParams

    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    with running_llm(target, spec) as llm:
        llm.generate([p.text for p in PROMPTS[:12]],
                     SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                     use_tqdm=False)
        m = spec_metrics(llm)
    return m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_draft_tokens"]


def test_trained_head_is_served_and_accepted(tiny_models, tmp_path):
    answers = generate_answers(str(tiny_models.target), PROMPTS, tmp_path / "answers.jsonl",
                               max_prompt_tokens=256, max_tokens=64, dtype="float32")
    aux = (1, 2, 3)  # the tiny target has 4 layers
    features = extract_features(str(tiny_models.target), read_answers(answers),
                                tmp_path / "features", aux_layers=aux)
    report = train_head(tiny_models.target, features, tmp_path / "head", draft_vocab=1024,
                        aux_layers=aux, steps=3, epochs=20, lr=2e-3, batch_tokens=512)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert report["trained_tokens"] > 0 and report["final_top1_accuracy_by_step"][0] > 0.5
    trained = _acceptance(tiny_models.target, tmp_path / "head")
    random_head = _acceptance(tiny_models.target, tiny_models.head)
    assert trained > 0.3 and trained > 5 * random_head, (trained, random_head)
