"""The draft loop in CUDA graphs (``vllm_graft.vllm.draft_graphs``), driven on the CPU
engine with a stand-in for capture that replays by running the captured loop again: what
a replay sees is the round's inputs copied into the graph's own tensors, so trees built
through replays must equal eager ones, and a graph that does not do the round's work
must be caught by the replay checks (the graphs turn off, the trees stay right). On a
GPU the same code captures real graphs; no GPU here has vLLM."""

from __future__ import annotations

import torch

from tests.vllm.conftest import graft_spec, running_llm

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the nth Fibonacci number.\"\"\"\n" * 3,
           "import os\nimport sys\n\nclass Config:\n", "The quick brown fox",
           "1, 2, 3, 4, 5, 6,"]


class RerunGraph:
    """A stand-in graph: replaying runs the captured callable again."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


class IdleGraph:
    """A broken graph: replaying does nothing (as a graph writing other buffers would)."""

    def __init__(self, fn):
        pass

    def replay(self):
        pass


def graphs_state(worker) -> dict:
    graphs = worker.model_runner.drafter.tree_builder.fused.draft_loop
    if graphs is None:
        return {}
    return {"captures": graphs.captures, "replays": graphs.replays,
            "off": graphs.off_reason, "sizes": sorted(graphs.loops)}


def built_trees(tiny_models, monkeypatch, graph=None, require_kernel=False):
    """The trees of a greedy run with the fused build's wait-free draft loop (as on a
    GPU), through the draft graphs when ``graph`` is a stand-in class; and the graphs'
    state."""
    from vllm import SamplingParams

    from vllm_graft.core.graft import GraftTreeBuilder
    from vllm_graft.vllm import draft_graphs

    original_init, original_build = GraftTreeBuilder.__init__, GraftTreeBuilder.build
    trees = []

    def wait_free_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.wait_free = True  # every request drafted at every depth, as on a GPU

    def recording_build(self, *args, **kwargs):
        tree, stats = original_build(self, *args, **kwargs)
        trees.append((tree.tokens.clone(), tree.parents.clone()))
        return tree, stats

    def install_on_cpu(drafting, vllm_config, device):
        fused = drafting.tree_builder.fused
        fused.draft_loop = draft_graphs.DraftLoopGraphs(
            fused, drafting, capture=lambda fn, pool: graph(fn),
            require_kernel=require_kernel)
        return fused.draft_loop

    with monkeypatch.context() as patch:
        patch.setattr(GraftTreeBuilder, "__init__", wait_free_init)
        patch.setattr(GraftTreeBuilder, "build", recording_build)
        patch.setattr(draft_graphs, "install",
                      install_on_cpu if graph is not None else lambda *args: None)
        spec = graft_spec(tiny_models.head, budget=60, thresholds=[0.3, 0.2, 0.1])
        with running_llm(tiny_models.target, spec, block_size=32) as llm:
            llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=n,
                                                  ignore_eos=True) for n in (24, 16, 12, 8)],
                         use_tqdm=False)
            state = llm.collective_rpc(graphs_state)[0]
    return trees, state


def assert_same_trees(got, expected):
    assert len(got) == len(expected) >= 10
    for (tokens, parents), (tokens_eager, parents_eager) in zip(got, expected):
        assert torch.equal(tokens, tokens_eager) and torch.equal(parents, parents_eager)


def test_replayed_draft_loops_build_the_eager_trees(tiny_models, monkeypatch):
    eager, none = built_trees(tiny_models, monkeypatch)
    replayed, state = built_trees(tiny_models, monkeypatch, RerunGraph)
    assert none == {}
    assert state["off"] is None, state
    # batch sizes 4, 3, 2, 1 as the requests finish: one loop each, replayed after
    assert state["captures"] == len(state["sizes"]) >= 3, state
    assert state["replays"] >= 10, state
    assert_same_trees(replayed, eager)


def test_a_graph_that_skips_the_rounds_work_is_caught(tiny_models, monkeypatch):
    eager, _ = built_trees(tiny_models, monkeypatch)
    idle, state = built_trees(tiny_models, monkeypatch, IdleGraph)
    assert state["off"] is not None and "unlike an eager run" in state["off"], state
    assert state["replays"] == 1 and state["sizes"] == [], state
    assert_same_trees(idle, eager)  # the check's eager run stood in for the replay


def test_a_loop_whose_layers_take_the_sdpa_path_is_never_captured(tiny_models, monkeypatch):
    # the CPU has no tree kernel: every drafter layer takes the SDPA path, whose lengths
    # a captured loop would keep from its capture
    eager, _ = built_trees(tiny_models, monkeypatch)
    kept, state = built_trees(tiny_models, monkeypatch, RerunGraph, require_kernel=True)
    assert state["off"] is not None and "SDPA path" in state["off"], state
    assert state["captures"] == 0 and state["replays"] == 0, state
    assert_same_trees(kept, eager)
