"""The DFlash trainer end to end on a tiny target: what ``train-dflash`` saves loads in
vLLM as a DFlash block drafter, vLLM's blocks are exactly the trained torch forward's
(so the layout, the inputs and the attention vLLM uses are the ones trained), the
target accepts its blocks more often than a random drafter's, and greedy output stays
identical to plain decoding, under vLLM's own DFlash and under Graft-TAIL."""

from __future__ import annotations

import json

import pytest

from tests.vllm.conftest import assert_greedy_identical, graft_spec, running_llm, spec_metrics
from tests.vllm.test_greedy_lossless import MAX_TOKENS
from tests.vllm.test_greedy_lossless import PROMPTS as LOSSLESS_PROMPTS
from tests.vllm.test_train_head import PROMPTS
from vllm_graft.training.data import extract_features, generate_answers, read_answers
from vllm_graft.training.dflash import default_target_layer_ids, feature_layers, train_dflash

BLOCK = 4


@pytest.fixture(scope="module")
def trained_drafter(tiny_models, tmp_path_factory):
    work = tmp_path_factory.mktemp("dflash-train")
    answers = generate_answers(str(tiny_models.target), PROMPTS, work / "answers.jsonl",
                               max_prompt_tokens=256, max_tokens=64, dtype="float32")
    ids = default_target_layer_ids(4, 3)  # the tiny target has 4 layers: [0, 1, 2]
    features = extract_features(str(tiny_models.target), read_answers(answers),
                                work / "features", aux_layers=feature_layers(ids))
    report = train_dflash(tiny_models.target, features, work / "drafter", target_layer_ids=ids,
                          layers=1, block=BLOCK, epochs=12, lr=4e-3, anchors_per_seq=64,
                          batch_predictions=1024)
    return work / "drafter", report


def _record_proposals(worker) -> None:
    """Wrap the drafter's ``propose``: keep each call's context and returned blocks."""
    drafter = worker.model_runner.drafter
    original = drafter.propose
    drafter.recorded = []

    def propose(num_speculative_tokens, target_token_ids, target_positions, *args, **kwargs):
        blocks = original(num_speculative_tokens, target_token_ids, target_positions, *args,
                          **kwargs)
        rejected = kwargs.get("num_rejected_tokens_gpu")
        drafter.recorded.append({  # batch of one: the block's anchor and its first token
            "anchor": int(target_positions[-1]) + 1 - (int(rejected[0]) if rejected is not None
                                                       else 0),
            "token": int(kwargs["next_token_ids"][0]), "blocks": blocks.tolist()})
        return blocks
    drafter.propose = propose


def _recorded(worker) -> list[dict]:
    return worker.model_runner.drafter.recorded


def test_vllm_drafts_the_trained_blocks(tiny_models, trained_drafter):
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from vllm_graft.training.dflash import DFlashDrafter

    drafter_dir, report = trained_drafter
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["causal"] is True and config["block_size"] == BLOCK
    assert report["trained_predictions"] > 0 and report["loss_curve"]
    assert report["loss_curve"][-1]["loss"] < report["loss_curve"][0]["loss"]

    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": BLOCK}
    with running_llm(tiny_models.target, spec, max_num_seqs=1) as llm:
        llm.collective_rpc(_record_proposals)
        out = llm.generate([PROMPTS[5].text], SamplingParams(temperature=0.0, max_tokens=24),
                           use_tqdm=False)[0]
        recorded = llm.collective_rpc(_recorded)[0]
    sequence = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    # the last step's block may follow tokens cut off at max_tokens
    recorded = [r for r in recorded if r["anchor"] < len(sequence)]
    assert all(sequence[r["anchor"]] == r["token"] for r in recorded)
    drafter = DFlashDrafter.from_vllm(drafter_dir, tiny_models.target)
    target = AutoModelForCausalLM.from_pretrained(tiny_models.target, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
        aux = torch.cat([hidden[i][0] for i in feature_layers(
            config["dflash_config"]["target_layer_ids"])], dim=-1)[None]
        anchors = torch.tensor([[r["anchor"] for r in recorded]])
        states = drafter(torch.tensor([sequence]), aux, torch.tensor([len(sequence)]), anchors,
                         torch.ones_like(anchors, dtype=torch.bool), BLOCK)
        blocks = drafter.logits(states).argmax(-1)[0].tolist()
    assert len(recorded) > 5  # the prefill's block and the decoding steps'
    assert [r["blocks"][0] for r in recorded] == blocks


def _acceptance(target, spec) -> float:
    from vllm import SamplingParams

    with running_llm(target, spec) as llm:
        llm.generate([p.text for p in PROMPTS[:12]],
                     SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                     use_tqdm=False)
        m = spec_metrics(llm)
    return m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_drafts"]


def test_trained_drafter_is_accepted_more_than_a_random_one(tiny_models, trained_drafter,
                                                            tmp_path):
    from vllm_graft.testing.tiny_models import build_dflash_drafter

    drafter_dir, _ = trained_drafter
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": BLOCK}
    trained = _acceptance(tiny_models.target, spec)
    random_drafter = build_dflash_drafter(tiny_models.target, tmp_path / "random")
    random = _acceptance(tiny_models.target, {**spec, "model": str(random_drafter)})
    assert trained > 0.05 and trained > 3 * random, (trained, random)


@pytest.mark.parametrize("method", ["dflash", "graft"])
def test_trained_drafter_greedy_output_is_identical(tiny_models, plain_outputs, trained_drafter,
                                                    method):
    drafter_dir, _ = trained_drafter
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": BLOCK} \
        if method == "dflash" else graft_spec(drafter_dir, drafter="dflash", variant="tail",
                                              budget=BLOCK)
    with running_llm(tiny_models.target, spec) as llm:
        assert_greedy_identical(llm, LOSSLESS_PROMPTS, plain_outputs, MAX_TOKENS)
        metrics = spec_metrics(llm)
    assert metrics["spec_decode_num_drafts"] > 0


def test_bench_dflash_rows_use_the_drafter_and_its_block_calibration():
    from vllm_graft.bench.methods import methods

    table = methods(60, chain_tokens=5, dflash_block=6)
    args = ("HEAD", "w.bin", "tree.json", "eagle3", "chain.json", "DFLASH_DIR", "blocks.json")
    assert table["dflash"].speculative_config(*args) == {
        "method": "dflash", "model": "DFLASH_DIR", "num_speculative_tokens": 6}
    assert table["tail_dflash"].speculative_config(*args) == {
        "method": "graft", "model": "DFLASH_DIR",
        "graft": {"variant": "tail", "drafter": "dflash", "budget": 6, "warmup": "w.bin",
                  "calibration": "blocks.json"}}
    # a draft-model run's rows keep their own drafter; the EAGLE-3 tail keeps its file
    assert table["tail_dflash"].speculative_config(
        "DRAFT", "w.bin", None, "draft_model", "chain.json", "DFLASH_DIR", None)["graft"] \
        == {"variant": "tail", "drafter": "dflash", "budget": 6, "warmup": "w.bin"}
    assert table["tail"].speculative_config(*args)["graft"]["calibration"] == "chain.json"
