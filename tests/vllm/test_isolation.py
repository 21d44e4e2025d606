"""``graft.isolation`` on the real engine: under ``tenant`` one tenant's traffic leaves
another tenant's trees (and a request naming no tenant's) unchanged, under ``global`` it
changes them; a batch mixing tenants stays greedy-identical to plain decoding; bad
tenant fields are refused before they reach the engine; the tenant comes only from the
source the operator chose (the helpers that choose it, and the engine's matrices)."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import graft_spec, greedy_token_ids, running_llm
from vllm_graft.core.hybrid import SOURCE_RETRIEVED

PROBE = "def fib(n):\n    if n < 2:\n        return n\n"
TRAFFIC = ["The quick brown fox jumps over the lazy dog. " * 6,
           "import numpy as np\nimport torch\n" * 5,
           "SELECT name, price FROM items WHERE price > 10 ORDER BY price;\n" * 4]
MAX_TOKENS = 40


def _sampling(tenant: str | None, max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args=None if tenant is None else {"graft_tenant": tenant})


def _probe_trees(llm, tenant: str | None) -> list[tuple]:
    """The trees verified while ``tenant`` generates the probe, in order."""
    from vllm_graft.vllm.rpc import start_tree_recording, take_tree_records

    llm.collective_rpc(start_tree_recording)
    llm.generate([PROBE], _sampling(tenant), use_tqdm=False)
    records = llm.collective_rpc(take_tree_records)[0]
    return [(r["position"], tuple(r["tokens"]), tuple(r["source"])) for r in records]


@pytest.mark.parametrize("mode, newcomer", [("tenant", "newcomer"), ("tenant", None),
                                           ("global", "newcomer")])
def test_one_tenants_traffic_and_another_tenants_trees(tiny_models, mode, newcomer):
    """Tenant "first" generates the probe on a fresh matrix; tenant "other" then sends
    other text (and "first" the probe again); a tenant never seen before, or a request
    naming none, generates the same probe. Its matrix starts from the same seed as
    "first"'s did, so under ``tenant`` its trees are exactly "first"'s; under ``global``
    the shared matrix learned from all and they differ."""
    spec = graft_spec(tiny_models.head, budget=24,
                      isolation={"mode": mode, "tenant_source": "extra"})
    with running_llm(tiny_models.target, spec) as llm:
        before = _probe_trees(llm, "first")
        llm.generate(TRAFFIC, _sampling("other", 64), use_tqdm=False)
        llm.generate([PROBE], _sampling("first"), use_tqdm=False)
        after = _probe_trees(llm, newcomer)
    # the matrix took part: the probe's own trees retrieved nodes (it learns as it goes)
    assert any(tag & SOURCE_RETRIEVED for _, _, src in after for tag in src)
    if mode == "tenant":
        assert after == before
    else:
        assert after != before


@pytest.mark.parametrize("mode", ["tenant", "request"])
def test_a_batch_mixing_tenants_stays_greedy_identical(tiny_models, mode):
    from tests.vllm.test_greedy_lossless import PROMPTS

    from vllm_graft.vllm.rpc import request_state_counts

    prompts = PROMPTS[:6]
    tenants = ["a", "b", None, "a", "c", None]
    with running_llm(tiny_models.target) as llm:
        expected = greedy_token_ids(llm, prompts, MAX_TOKENS)
    spec = graft_spec(tiny_models.head, budget=24,  # some go without a matrix
                      isolation={"mode": mode, "max_matrices": 2, "tenant_source": "extra"})
    with running_llm(tiny_models.target, spec) as llm:
        outputs = llm.generate(prompts, [_sampling(t) for t in tenants], use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        llm.llm_engine.step()  # the step after the last finish tells the runner
        counts = llm.collective_rpc(request_state_counts)[0]
        assert counts["matrix_partitions"] == 0
        assert counts["matrix_refusals"] > 0  # some requests really went without


@pytest.mark.parametrize("extra, message", [
    ({"graft_tenant": 5}, "graft_tenant must be a non-empty string"),
    ({"graft_tenant": ""}, "graft_tenant must be a non-empty string"),
    ({"graft_tenant": "x" * 300}, "at most 256"),
    ({"graft_tennant": "a"}, "unknown Graft request field 'graft_tennant'"),
])
def test_bad_tenant_fields_are_refused_up_front(tiny_models, extra, message):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    spec = graft_spec(tiny_models.head, budget=8)
    with running_llm(tiny_models.target, spec) as llm:
        with pytest.raises(VLLMValidationError, match=message):
            llm.generate(["def f():"], SamplingParams(max_tokens=4, extra_args=extra),
                         use_tqdm=False)
        out = llm.generate(["def f():"], _sampling("fine", 4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def _owners(worker) -> list[str]:
    """Who holds a successor matrix in this engine (tenants keep theirs between
    requests; a private matrix is freed when its request ends)."""
    return sorted(worker.model_runner.drafter.isolation.owner_of)


@pytest.mark.parametrize("isolation, owners", [
    ({"tenant_source": "extra"}, ["tenant:by-extra"]),
    ({"tenant_source": "cache_salt"}, ["tenant:by-salt"]),
    ({"tenant_source": "user"}, []),  # offline, no request has a user: all private
    ({"tenant_source": "user", "unnamed": "shared"}, ["unnamed"]),
])
def test_the_engine_takes_the_tenant_from_the_chosen_source_only(tiny_models, plain_outputs,
                                                                 isolation, owners):
    """A request naming a tenant through the extra argument and the cache salt at once,
    and one naming none: only the chosen source's tenant gets a matrix (offline, with no
    OpenAI handler, ``user`` and header sources name none); greedy outputs stay plain
    decoding's."""
    from vllm import SamplingParams

    from tests.vllm.test_greedy_lossless import MAX_TOKENS as TOKENS
    from tests.vllm.test_greedy_lossless import PROMPTS

    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True,
                            extra_args={"graft_tenant": "by-extra"})
    spec = graft_spec(tiny_models.head, budget=8, isolation=isolation)
    with running_llm(tiny_models.target, spec) as llm:
        outputs = llm.generate([{"prompt": PROMPTS[0], "cache_salt": "by-salt"}], params,
                               use_tqdm=False)
        outputs += llm.generate(PROMPTS[1:2], _sampling(None, TOKENS), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == plain_outputs[:2]
        llm.llm_engine.step()  # the step after the last finish tells the runner
        assert llm.collective_rpc(_owners)[0] == owners


def test_the_tenant_choice():
    """Each source names the tenant alone; empty values name none, long ones are
    hashed; a tenant header must come once."""
    from starlette.datastructures import Headers
    from vllm.exceptions import VLLMValidationError

    from vllm_graft.vllm.replacements.tenants import (handler_tenant, request_tenant,
                                                      tenant_name, with_tenant)

    headers = Headers(raw=[(b"x-tenant", b"gateway"), (b"x-other", b"client")])
    assert handler_tenant("user", "alice", headers) == "alice"
    assert handler_tenant("user", "", headers) is None
    assert handler_tenant("user", None, headers) is None
    assert handler_tenant("header:X-Tenant", "alice", headers) == "gateway"
    assert handler_tenant("header:x-tenant", "alice", headers) == "gateway"
    assert handler_tenant("header:X-Missing", "alice", headers) is None
    assert handler_tenant("header:X-Tenant", "alice", None) is None  # not over HTTP
    for source in ("cache_salt", "extra"):  # read where the engine request is made
        assert handler_tenant(source, "alice", headers) is None
    twice = Headers(raw=[(b"x-tenant", b"gateway"), (b"x-tenant", b"client")])
    with pytest.raises(VLLMValidationError, match="X-Tenant.*tenant_source.*2 times"):
        handler_tenant("header:X-Tenant", None, twice)

    extra = {"graft_tenant": "by-extra", "other": 1}
    isolation = {"tenant_field": "graft_tenant"}

    def chosen(source, handler="by-handler"):
        return request_tenant({**isolation, "tenant_source": source}, extra, "by-salt",
                              handler)

    assert chosen("extra") == "by-extra"
    assert chosen("cache_salt") == "by-salt"
    assert chosen("user") == chosen("header:X-Tenant") == "by-handler"
    assert chosen("user", None) is None  # the extra argument never stands in
    assert request_tenant({**isolation, "tenant_source": "extra"}, None, "s", "h") is None
    assert request_tenant({**isolation, "tenant_source": "cache_salt"}, extra, None,
                          "h") is None

    assert with_tenant(extra, "graft_tenant", "t") == {"graft_tenant": "t", "other": 1}
    assert with_tenant(extra, "graft_tenant", None) == {"other": 1}
    assert with_tenant({"graft_tenant": "x"}, "graft_tenant", None) is None
    assert extra == {"graft_tenant": "by-extra", "other": 1}  # never changed in place
    assert tenant_name("") is None and tenant_name("a" * 256) == "a" * 256
    long = tenant_name("u" * 1000)
    assert long.startswith("sha256:") and len(long) <= 256 and long != tenant_name("u" * 999)


@pytest.mark.parametrize("mode, tenants, peers_of_a", [
    ("global", {"a": None, "b": None, "c": None}, {"b", "c"}),
    ("tenant", {"a": "t1", "b": "t1", "c": "t2"}, {"b"}),  # a tenant's requests only
    ("tenant", {"a": None, "b": None, "c": "t2"}, set()),  # unnamed: private matrices
    ("request", {"a": "t1", "b": "t1", "c": "t1"}, set())])
def test_requests_copy_from_the_outputs_of_those_sharing_their_matrix(mode, tenants,
                                                                       peers_of_a):
    """Cross-request copies (``context.cross_request``) reach exactly the requests that
    read the same successor matrix: another tenant's or a private request's output is
    never proposed; finished outputs are shared in global mode only."""
    from types import SimpleNamespace

    from vllm_graft.core.config import ContextRetrievalConfig
    from vllm_graft.core.context import ContextIndex
    from vllm_graft.core.shared_outputs import RecentOutputsIndex
    from vllm_graft.core.isolation import IsolationMode, MatrixPartitions
    from vllm_graft.core.successor import SuccessorMatrix
    from vllm_graft.vllm.tree_drafting import GraftTreeDrafting

    isolation = MatrixPartitions(IsolationMode(mode), SuccessorMatrix.empty(32, 2), 8)
    indexes = {}
    for req_id, tenant in tenants.items():
        isolation.assign(req_id, tenant)
        indexes[req_id] = ContextIndex()
        indexes[req_id].extend([1, 2, 3])
    finished = RecentOutputsIndex(max_tokens=64) if mode == "global" else None
    drafting = SimpleNamespace(
        uses_context=True, context_config=ContextRetrievalConfig(), isolation=isolation,
        context_indexes=indexes, prompt_lengths=dict.fromkeys(tenants, 1),
        shared_context=finished)
    shared = GraftTreeDrafting.shared_outputs(drafting, ["a"])[0]
    got = set() if shared is None else {
        req_id for req_id, index in indexes.items()
        if any(index is peer for peer, _ in shared.peers)}
    assert got == peers_of_a
    if mode == "global":
        assert shared.finished is finished
    else:
        assert shared is None or shared.finished is None
    drafting.context_config = ContextRetrievalConfig(cross_request=False)
    assert GraftTreeDrafting.shared_outputs(drafting, ["a"]) == [None]
