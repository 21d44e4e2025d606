"""Per-token sources on the real engine: the recorded trees placed in each output must
agree with the output tokens, the labelled counts with the engine's acceptance
counters, and ``vllm-graft generate --json`` must carry them for every token."""

from __future__ import annotations

import json
from collections import Counter

from tests.vllm.conftest import graft_spec, running_llm, spec_metrics
from tests.vllm.test_greedy_lossless import PROMPTS

ACCEPTED = ("draft", "retrieved", "both", "context", "padding")


def test_labels_match_outputs_and_acceptance_counters(tiny_models):
    from vllm import SamplingParams

    from vllm_graft.cli.sources import label_output, mismatches, records_by_request
    from vllm_graft.vllm.rpc import start_tree_recording, take_tree_records

    prompts = PROMPTS[:6]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=16)) as llm:
        llm.collective_rpc(start_tree_recording)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        records = llm.collective_rpc(take_tree_records)[0]
        metrics = spec_metrics(llm)

    by_request = records_by_request(records)
    assert set(by_request) == {o.request_id for o in outputs}
    labelled, cut = Counter(), Counter()
    for output in outputs:
        tokens = list(output.outputs[0].token_ids)
        mine = by_request[output.request_id]
        prompt_len = len(output.prompt_token_ids)
        assert mismatches(mine, prompt_len, tokens) == []
        result = label_output(mine, prompt_len, tokens)
        assert len(result.sources) == len(tokens) == 40
        assert result.sources[0] == "target"  # the prefill's token
        labelled += result.counts()
        cut += result.cut
    assert sum(labelled[s] for s in ("draft", "retrieved", "both", "context")) > 0
    for source in ACCEPTED:
        assert labelled[source] + cut[source] == metrics.get(f"graft_accepted_{source}", 0), source
    accepted = sum(labelled[s] + cut[s] for s in ACCEPTED)
    assert accepted == metrics["spec_decode_num_accepted_tokens"]
    # every output token carries exactly one label
    assert sum(labelled.values()) == 40 * len(prompts)


def test_generate_json_carries_sources(tiny_models, tmp_path):
    from vllm_graft.cli import generate

    spec = tmp_path / "graft.json"
    spec.write_text(json.dumps(graft_spec(tiny_models.head, budget=16)))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fib(n):\\n\nwhile True:\\n\n")
    out = tmp_path / "report.json"
    code = generate.main([str(tiny_models.target), "--speculative-config", str(spec),
                          "--prompts-file", str(prompts), "--dtype", "float32",
                          "--max-tokens", "24", "--ignore-eos", "--max-model-len", "512",
                          "--json", str(out),
                          "--log-file", str(tmp_path / "engine.log")])
    assert code == 0
    report = json.loads(out.read_text())
    assert "mean_accepted_tokens" in report["graft"]
    assert len(report["outputs"]) == 2
    for item in report["outputs"]:
        assert len(item["tokens"]) == len(item["pieces"]) == len(item["sources"]) == 24
        assert set(item["sources"]) <= {*ACCEPTED, "target"}
    by_source = report["graft"]["tokens_by_source"]
    assert sum(by_source.values()) == 48
    assert report["warmup_tokens"] == 16  # the default warm-up ran, and is reported
    assert (tmp_path / "engine.log").read_text()  # engine logs went to the file


def test_generate_counts_the_timed_run_alone(tiny_models):
    """The statistics ``generate`` reports leave out its warm-up: the engine's counters
    over the timed run must agree with the trees recorded in it (recording starts after
    the warm-up). The warm-up of 24 tokens a prompt verifies trees too, so counters read
    without the delta around the timed run would count more of them."""
    from vllm_graft.cli import generate

    spec = graft_spec(tiny_models.head, budget=16)
    args = generate.parse_args([str(tiny_models.target), "--speculative-config",
                                json.dumps(spec), "--dtype", "float32", "--max-tokens",
                                "24", "--ignore-eos", "--max-model-len", "512",
                                "--warmup-tokens", "24"])
    result = generate.run(args.model, spec, PROMPTS[:2], args, record=True)
    records = result["records"]
    assert len(records) >= 2 * 16  # a tree every step (budget 16), most steps
    assert result["metrics"]["spec_decode_num_drafts"] == len(records)
    assert result["metrics"]["spec_decode_num_accepted_tokens"] \
        == sum(len(record["accepted_rows"]) for record in records)


def test_a_prompts_file_keeps_every_character_and_decodes_escapes(tmp_path):
    """``generate --prompts-file FILE``: UTF-8 lines, backslash escapes decoded. Decoded as
    Latin-1 bytes, "Résumé" came out "RÃ©sumÃ©", and the comparison with plain decoding
    still agreed, on the garbled prompt."""
    from vllm_graft.cli.generate import load_prompts

    path = tmp_path / "prompts.txt"
    path.write_text("Résumé 你好 “quoted”\\nnext line\n\n\\ttab \\u00e9\n", encoding="utf-8")
    assert load_prompts(str(path)) == ["Résumé 你好 “quoted”\nnext line", "\ttab é"]


def test_generate_times_the_prompts_one_at_a_time_too(tiny_models, tmp_path):
    """--one-at-a-time decodes each prompt alone after the batched run, in both engines:
    its tokens are plain decoding's (a mismatch makes greedy_identical false) and its
    speed is reported beside the batched one."""
    from vllm_graft.cli import generate

    out = tmp_path / "report.json"
    code = generate.main([str(tiny_models.target), "--speculative-config",
                          json.dumps(graft_spec(tiny_models.head, budget=16)),
                          "--dtype", "float32", "--max-tokens", "16", "--ignore-eos",
                          "--max-model-len", "512", "--compare", "--one-at-a-time",
                          "--json", str(out), "--log-file", str(tmp_path / "engine.log")])
    report = json.loads(out.read_text())
    assert code == 0 and report["greedy_identical"] is True
    alone = report["graft"]["one_at_a_time"]
    assert alone["tokens_per_s"] > 0 and alone["mean_accepted_tokens"] >= 1
    assert report["plain"]["one_at_a_time"]["tokens_per_s"] > 0
    assert report["speedup_one_at_a_time"] > 0
