"""Requests a user sends over HTTP, answered by a Graft server exactly as by a plain one
(or refused with the same clear 4xx), with both servers alive afterwards: text stop
strings, logprobs of 20 tokens, n = 8 seeded choices, prompts at and one token short of
max_model_len, structured output (a JSON schema), and top-k / top-p / min-p sampling
with seeds. A real ``vllm-graft serve`` beside a plain one, on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from tests.vllm.conftest import graft_spec
from tests.vllm.served import ServedModel

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("servers")
    config = workdir / "graft.json"
    config.write_text(json.dumps(graft_spec(tiny_models.head, budget=60)))
    plain = ServedModel(tiny_models.target, workdir / "plain.log", None, "--seed", "0",
                        max_model_len=MAX_MODEL_LEN)
    graft = ServedModel(tiny_models.target, workdir / "graft.log", config, "--seed", "0",
                        max_model_len=MAX_MODEL_LEN)
    try:
        plain.wait_ready()
        graft.wait_ready()
        yield plain, graft
        assert plain.alive() and graft.alive()  # every request below left them serving
    finally:
        plain.stop()
        graft.stop()


def _same(servers, **body) -> dict:
    """Both servers' answers to ``body``: the choices' texts (and tokens' logprobs
    where asked) equal; returns the Graft server's."""
    plain, graft = servers
    (plain_status, expected), (graft_status, got) = plain.complete(**body), graft.complete(**body)
    assert plain_status == graft_status == 200, (plain_status, graft_status, expected, got)
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in expected["choices"]]
    assert [c["finish_reason"] for c in got["choices"]] \
        == [c["finish_reason"] for c in expected["choices"]]
    return got


PROMPT = "def fibonacci(n):\n    \"\"\"Return the nth Fibonacci number.\"\"\"\n"


def test_text_stop_strings(servers):
    got = _same(servers, prompt=PROMPT, max_tokens=64, temperature=0, stop=["\n\n", "return"])
    assert got["choices"][0]["finish_reason"] in ("stop", "length")


def test_twenty_logprobs(servers):
    plain, graft = servers
    body = dict(prompt=PROMPT, max_tokens=24, temperature=0, logprobs=20)
    got = _same(servers, **body)
    expected = plain.complete(**body)[1]
    got_lp, expected_lp = got["choices"][0]["logprobs"], expected["choices"][0]["logprobs"]
    assert got_lp["tokens"] == expected_lp["tokens"]
    for mine, theirs in zip(got_lp["top_logprobs"], expected_lp["top_logprobs"]):
        # 20 ids; fewer keys where two ids decode to the same text, alike in both
        assert 15 <= len(mine) <= 20 and set(mine) == set(theirs)
        assert all(abs(mine[t] - theirs[t]) < 1e-3 for t in mine)


def test_eight_seeded_choices(servers):
    got = _same(servers, prompt=PROMPT, max_tokens=24, temperature=1.0, n=8, seed=3)
    assert len(got["choices"]) == 8


def test_prompts_at_and_one_short_of_max_model_len(servers):
    plain, graft = servers
    at_limit = " x" * MAX_MODEL_LEN  # more than max_model_len tokens: refused alike
    statuses = (plain.complete(prompt=at_limit, max_tokens=4)[0],
                graft.complete(prompt=at_limit, max_tokens=4)[0])
    assert statuses[0] == statuses[1] and 400 <= statuses[0] < 500, statuses
    # a prompt that leaves room for a few tokens only: no tree may reach past the end
    short = " x" * (MAX_MODEL_LEN - 12)
    _same(servers, prompt=short, max_tokens=64, temperature=0)


def test_structured_output_with_a_json_schema(servers):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    got = _same(servers, prompt="A person as JSON: ", max_tokens=48, temperature=0,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "person", "schema": schema}})
    text = got["choices"][0]["text"]
    assert text.lstrip().startswith("{"), text  # the grammar held (a tiny random model's
    if got["choices"][0]["finish_reason"] == "stop":  # object may run past max_tokens)
        json.loads(text)


@pytest.mark.parametrize("sampling", [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.1),
                                      dict(top_k=20, top_p=0.9, min_p=0.05)],
                         ids=["top_k", "top_p", "min_p", "all"])
def test_seeded_filtered_sampling(servers, sampling):
    _same(servers, prompt=PROMPT, max_tokens=32, temperature=0.9, seed=11, **sampling)
