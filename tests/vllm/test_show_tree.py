"""``vllm-graft generate --show-tree`` on the real engine: one verified tree drawn per
prompt, with the accepted path marked and the drafting checkpoints named."""

from __future__ import annotations

import json

from tests.vllm.conftest import graft_spec


def test_generate_draws_one_verified_tree_per_prompt(tiny_models, tmp_path, capfd):
    from vllm_graft.cli import generate

    spec = tmp_path / "graft.json"
    spec.write_text(json.dumps(graft_spec(tiny_models.head, budget=16)))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fib(n):\\n\nwhile True:\\n\n")
    code = generate.main([str(tiny_models.target), "--speculative-config", str(spec),
                          "--prompts-file", str(prompts), "--dtype", "float32",
                          "--max-tokens", "24", "--max-model-len", "512", "--show-tree",
                          "--log-file", str(tmp_path / "engine.log")])
    assert code == 0
    out = capfd.readouterr().out
    assert out.count("tree of  ") == 2
    assert out.count("verified tree") == 2, out
    assert out.count("checkpoints ") == 2 and "\u2713 accepted" in out
    assert "\u2514\u2500\u2500 " in out  # branches drawn under the root
