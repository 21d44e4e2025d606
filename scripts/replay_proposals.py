"""Copy proposals replayed: tokens per step of each proposal rule on the same outputs.

A benchmark's tokens per step mix what a method proposes with what its sizing cuts and
with the order in which a batch's requests advance. Here the greedy outputs of plain
decoding are generated once per prompt of a job file (the target alone, so every
method would emit exactly these tokens), then each rule proposes at every step from the
context a request would have, and accepts the proposal's longest prefix that the output
continues with (greedy acceptance), plus the token after it. The requests of a dataset
advance in lockstep, one step each per round, as a batch does, and every proposal of a
round is made before any of its tokens are emitted, as a batch step's drafts are: a
rule that reads other requests' outputs sees what the peers had emitted before the
round.

Rules (none cut to a budget but ``graft_sized`` and ``graft_guarded``):

* ``ngram``: vLLM's prompt lookup (the longest suffix of ``--ngram-max`` down to
  ``--ngram-min`` tokens found earlier, its first occurrence's continuation),
  ``--ngram-tokens`` tokens;
* ``graft``: Graft's copy-chain match (:meth:`ContextIndex.best_match`, the graft
  variant's default n-grams), ``--graft-tokens`` tokens; ``graft_peers`` also matches
  the running peers' outputs (what requests sharing a successor matrix see);
  ``graft_sized`` (with ``--gpu-costs``): the own-text chains of a round cut together
  by Graft's sizer as a chain step on that GPU would cut them (its verification curves,
  the chain acceptance model seeded from ``--calibration`` and taught each whole
  chain's outcome), the one sized rule; with ``--warmup`` its chains continue past the
  copy with the successor matrix's top-1 walk, ``--chain-walk`` tokens, as a chain
  step's do (each request its own copy of the warm-up matrix, as a request naming no
  tenant has, taught the target's next token at every position decoding emits);
  ``graft_sized_peers`` matches the peers' outputs too and walks one matrix that all
  the requests share and teach (requests sharing a tenant's matrix, or isolation
  global);
  ``graft_guarded`` (with ``--gpu-costs``): budget auto's throughput guard and chain
  scout choosing each round between ``graft_sized``'s chains and plain decoding, as
  ``guard_modes: ["chain", "plain"]`` would (trees need the drafter, which no replay
  runs), every round measured at its priced forward (no drafting, no bookkeeping, no
  timing noise); the chains are built only for chain rounds and the scout's looks, as
  the engine builds them;
* ``suffix`` / ``suffix_own``: arctic-inference's suffix tree (vLLM's suffix method and
  its defaults), ``--suffix-tokens`` tokens, over every request's response (as vLLM
  runs it) or the request's own only; skipped when arctic-inference is not installed.

Usage, with a job file a benchmark wrote (``OUT/jobs/METHOD.job.json``)::

    python scripts/replay_proposals.py JOB.json [--datasets copy_agent copy_rag]
        [--outputs outputs.json]

``--outputs`` keeps the greedy outputs (generated when the file does not exist, read
when it does). ``--gpu-costs gpu_check.json`` adds a projection: each rule's speed over
plain decoding where a step costs the verification forward that ``scripts/gpu_check.sh``
measured on a GPU (its ``verification_cost`` curves at ``--context``) for the batch's
requests and query tokens (each request's token and its proposal) in that round, plain
decoding's rounds one token a request. Only the target's forwards are priced: drafting
and bookkeeping are not, so this bounds what the proposals could gain on that GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

#: a rule: given the request, all requests' contexts and prompt lengths, a proposal
Rule = Callable[[int, list[list[int]], list[int]], list[int]]
#: a round's rule: given the requests in the round, all contexts and prompt lengths,
#: each of those requests' proposal
RoundRule = Callable[[list[int], list[list[int]], list[int]], dict[int, list[int]]]


def accepted_prefix(proposal: Sequence[int], actual: Sequence[int]) -> int:
    """How many of ``proposal``'s tokens greedy verification accepts: its longest prefix
    that ``actual`` (the output from here on) starts with."""
    from vllm_graft.core.budget.scout import copied_prefix

    return copied_prefix(proposal[:len(actual)], actual)


def prompt_lookup(context: Sequence[int], min_ngram: int, max_ngram: int,
                  tokens: int) -> list[int]:
    """vLLM's n-gram proposal, by vLLM's own matcher: for the longest ``n`` in
    ``max_ngram``..``min_ngram`` whose last ``n`` tokens occurred earlier, the
    ``tokens`` after their first occurrence."""
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens)

    return _find_longest_matched_ngram_and_propose_tokens(
        np.asarray(context, dtype=np.int32), min_ngram, max_ngram,
        len(context) + tokens, tokens).tolist()


def replay(requests: list[tuple[list[int], list[int]]], rule: Rule | None,
           on_tokens: Callable[[int, list[int]], None] | None = None,
           rounds: list[tuple[int, int]] | None = None,
           propose_round: RoundRule | None = None) -> float:
    """Tokens per step of a rule over ``requests`` (prompt, greedy output) advancing in
    lockstep (module doc); the output's first token is the prefill's, not counted.
    ``on_tokens(request, tokens)``: called with each request's prompt and first token,
    then with each step's emitted tokens. ``rounds``: gets, per round, the requests in
    it and the query tokens their step verifies (each request's token and its proposal,
    at most as many as its output has left). ``propose_round``, instead of ``rule``:
    the proposals of a whole round, from the requests in it (a rule that sizes a
    batch's proposals together)."""
    contexts = [list(prompt) + list(output[:1]) for prompt, output in requests]
    prompt_lengths = [len(prompt) for prompt, _ in requests]
    positions = [1] * len(requests)
    if on_tokens is not None:
        for i, context in enumerate(contexts):
            on_tokens(i, context)
    steps = emitted = 0
    while any(pos < len(out) for pos, (_, out) in zip(positions, requests)):
        active = [i for i, (_, out) in enumerate(requests) if positions[i] < len(out)]
        # every proposal of a round before any of its tokens: a batch's requests draft
        # their step from what the batch had emitted before it
        proposals = propose_round(active, contexts, prompt_lengths) \
            if propose_round is not None \
            else {i: rule(i, contexts, prompt_lengths) for i in active}
        query_tokens = 0
        for i in active:
            output, pos, proposal = requests[i][1], positions[i], proposals[i]
            query_tokens += 1 + min(len(proposal), len(output) - pos - 1)
            new = list(output[pos:pos + accepted_prefix(proposal, output[pos:]) + 1])
            positions[i] += len(new)
            contexts[i].extend(new)
            if on_tokens is not None:
                on_tokens(i, new)
            steps += 1
            emitted += len(new)
        if rounds is not None:
            rounds.append((len(active), query_tokens))
    return emitted / max(steps, 1)


def plain_rounds(requests: list[tuple[list[int], list[int]]]) -> list[tuple[int, int]]:
    """Plain decoding's rounds of ``requests`` (as :func:`replay` reports them): one
    token a request a step, after the prefill's."""
    steps = [len(output) - 1 for _, output in requests]
    return [(active, active) for step in range(max(steps, default=0))
            if (active := sum(1 for count in steps if count > step))]


def projected_ms(cost, rounds: list[tuple[int, int]]) -> float:
    """The verification forwards of ``rounds`` priced by ``cost`` (a
    :class:`CostModel` of a GPU's curves), in milliseconds."""
    import torch

    return sum(float(cost.verify_ms(active, torch.tensor([float(tokens)]))[0])
               for active, tokens in rounds)


def replay_ngram(requests, min_ngram: int, max_ngram: int, tokens: int,
                 rounds: list[tuple[int, int]] | None = None) -> float:
    return replay(requests, lambda i, contexts, _: prompt_lookup(
        contexts[i], min_ngram, max_ngram, tokens), rounds=rounds)


def context_indexes(requests) -> tuple[list, Callable[[int, list[int]], None]]:
    """A context index per request (the graft variant's default n-grams), and the
    :func:`replay` ``on_tokens`` that keeps them up to date."""
    from vllm_graft.core.config import ContextRetrievalConfig
    from vllm_graft.core.context import ContextIndex

    defaults = ContextRetrievalConfig()
    indexes = [ContextIndex(min_ngram=defaults.min_ngram, max_ngram=defaults.max_ngram)
               for _ in requests]

    def index_tokens(i: int, new: list[int]) -> None:
        indexes[i].extend(new)
        indexes[i].catch_up()

    return indexes, index_tokens


def replay_graft(requests, tokens: int, peers: bool,
                 rounds: list[tuple[int, int]] | None = None) -> float:
    from vllm_graft.core.shared_outputs import PeerOutputs

    indexes, index_tokens = context_indexes(requests)

    def rule(i: int, contexts, prompt_lengths) -> list[int]:
        shared = PeerOutputs([(index, prompt_lengths[j]) for j, index in enumerate(indexes)
                              if j != i]) if peers else None
        return indexes[i].best_match(tokens, shared)[1]

    return replay(requests, rule, index_tokens, rounds)


def learn_next_tokens(matrix, previous: int, new: list[int]) -> None:
    """``matrix`` (a :class:`SuccessorMatrix`) taught that each of ``new`` follows the
    token before it (the first, ``previous``): it becomes that token's first successor
    (what a verified node's greedy target puts there), the row's others shift down,
    empty places stay empty."""
    import torch

    for token, following in zip([previous] + new[:-1], new):
        row = matrix.table[token].tolist()
        kept = [t for t in row if t != following]
        matrix.table[token] = torch.tensor([following] + kept[:matrix.k - 1],
                                           dtype=matrix.table.dtype)


class SizedChains:
    """Graft's copy chains as a chain step builds them (module doc): each round's
    chains cut together by ``sizer`` (:class:`TreeSizer`), whose chain acceptance
    model then learns each whole chain's outcome; with ``matrices`` (one
    :class:`SuccessorMatrix` a request: the same one where requests share it), each
    chain continued by its matrix's top-1 walk for at most ``walk`` tokens; ``peers``:
    copies matched in the other requests' outputs too (as of the round's start).
    :meth:`on_tokens` is :func:`replay`'s, keeping the indexes and matrices up to
    date."""

    def __init__(self, requests, tokens: int, sizer, matrices: list | None = None,
                 walk: int = 0, peers: bool = False):
        from vllm_graft.core.config import ContextRetrievalConfig

        self.requests, self.tokens, self.sizer = requests, tokens, sizer
        self.matrices, self.walk, self.peers = matrices, walk, peers
        self.min_ngram = ContextRetrievalConfig().min_ngram
        self.indexes, self._index_tokens = context_indexes(requests)
        self._started: set[int] = set()

    def on_tokens(self, i: int, new: list[int]) -> None:
        self._index_tokens(i, new)
        if self.matrices is not None and i in self._started:  # decoding's tokens
            context = self.indexes[i].tokens
            learn_next_tokens(self.matrices[i], context[len(context) - len(new) - 1], new)
        self._started.add(i)

    def build(self, active: list[int], contexts, prompt_lengths):
        """The chains of the round's ``active`` requests, cut by the sizer: the cut
        :class:`HostChains` (root first, in ``active``'s order) and the sizer's
        :class:`Choice`; the sizer learns how the whole chains fare."""
        from vllm_graft.core.chain import HostChains, walk_chains
        from vllm_graft.core.context import match_score
        from vllm_graft.core.shared_outputs import PeerOutputs

        matches = [self.indexes[i].best_match(self.tokens, PeerOutputs(
            [(index, prompt_lengths[j]) for j, index in enumerate(self.indexes) if j != i])
            if self.peers else None) for i in active]
        scores = [match_score(length, self.min_ngram) for length, _ in matches]
        built = [walk_chains([contexts[i][-1]], [continuation],
                             None if self.matrices is None else self.matrices[i],
                             self.tokens, max_walk=0 if self.matrices is None else self.walk,
                             copied_scores=[score])
                 for i, (_, continuation), score in zip(active, matches, scores)]
        chains = HostChains(*([row for chain in built for row in getattr(chain, field)]
                              for field in ("tokens", "source", "score")))
        cut, choice = self.sizer.trim_chains(chains)
        outcomes = []
        for t, i in enumerate(active):
            output = self.requests[i][1][len(contexts[i]) - prompt_lengths[i]:]
            outcomes.append((chains.source[t][1:], chains.score[t][1:],
                             accepted_prefix(chains.tokens[t][1:], output), 0))
        self.sizer.observe_chains(outcomes)
        return cut, choice


def replay_chains(chains: SizedChains, rounds: list[tuple[int, int]] | None = None) -> float:
    """Tokens per step of ``chains``' proposals made at every round."""
    def propose_round(active: list[int], contexts, prompt_lengths) -> dict[int, list[int]]:
        cut, _ = chains.build(active, contexts, prompt_lengths)
        return {i: cut.tokens[t][1:] for t, i in enumerate(active)}

    return replay(chains.requests, None, chains.on_tokens, rounds, propose_round)


def replay_graft_sized(requests, tokens: int, sizer,
                       rounds: list[tuple[int, int]] | None = None,
                       matrices: list | None = None, walk: int = 0,
                       peers: bool = False) -> float:
    """Tokens per step of :class:`SizedChains` (its arguments) proposed at every
    round."""
    return replay_chains(SizedChains(requests, tokens, sizer, matrices, walk, peers), rounds)


def replay_graft_guarded(chains: SizedChains, guard, scout, cost,
                         rounds: list[tuple[int, int]] | None = None,
                         modes: list[str] | None = None) -> float:
    """Tokens per step of budget auto's choice between copy chains and plain
    decoding: each round, ``guard`` (:class:`ThroughputGuard`) picks the mode, and
    ``scout`` (:class:`ChainScout`, or None) may turn a plain round into a chain round,
    as in a chain step's engine; a chain round verifies ``chains``' proposals (built,
    as in the engine, only for chain rounds and the scout's looks), a plain one none.
    The guard measures each round at the milliseconds ``cost`` (a GPU's curves) prices
    its forward at and credits it as the engine does. ``modes`` gets each round's
    mode."""
    from vllm_graft.core.budget.scout import fired_step_gained
    from vllm_graft.core.config import StepMode

    rounds = [] if rounds is None else rounds
    modes = [] if modes is None else modes
    step: dict = {}
    emitted: dict[int, int] = {}

    def on_tokens(i: int, new: list[int]) -> None:
        chains.on_tokens(i, new)
        emitted[i] = len(new)

    def observe() -> None:
        """The last round, measured as the engine measures a step."""
        active, mode = step["active"], step["mode"]
        req_ids, row = [str(i) for i in active], [float(emitted[i]) for i in active]
        batch = rounds[-1][0]
        seconds = projected_ms(cost, rounds[-1:]) / 1e3
        credited = guard.credited_tokens(row, req_ids)
        guard.advance(req_ids, row)
        if scout is not None and mode is StepMode.CHAIN:
            counted = guard.counted_seconds(mode, batch, seconds)
            scout.observe(step["predicted"], step["step_ms"], credited, counted)
            if step["replaced"] is not None:
                scout.fired_step(gained=fired_step_gained(guard, step["replaced"], batch,
                                                          credited, counted))
        guard.observe(mode, batch, credited, seconds)
        modes.append(mode.value)

    def propose_round(active: list[int], contexts, prompt_lengths) -> dict[int, list[int]]:
        if step:
            observe()
        else:  # the batch joins
            guard.requests_joined(len(active), len(active), scouted=scout is not None)
            if scout is not None:
                scout.text_changed(len(active), len(active))
        mode = guard.choose(len(active))
        looks = scout is not None and scout.looks_at(guard, mode)
        step.update(active=active, mode=mode, replaced=None, predicted=None, step_ms=None)
        if mode is not StepMode.CHAIN and not looks:
            return {i: [] for i in active}
        cut, choice = chains.build(active, contexts, prompt_lengths)
        step["predicted"] = guard.credited_tokens(choice.tokens_by_request(len(active)),
                                                  [str(i) for i in active])
        step["step_ms"] = choice.step_ms
        if looks and scout.promising(step["predicted"], choice.step_ms,
                                     guard.rate_of(len(active), mode)):
            step["replaced"], step["mode"] = mode, StepMode.CHAIN
        if step["mode"] is not StepMode.CHAIN:
            return {i: [] for i in active}
        return {i: cut.tokens[t][1:] for t, i in enumerate(active)}

    tokens_per_step = replay(chains.requests, None, on_tokens, rounds, propose_round)
    if step:
        observe()
    return tokens_per_step


def replay_suffix(requests, tokens: int, shared: bool,
                  rounds: list[tuple[int, int]] | None = None) -> float:
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    from vllm.config.speculative import SpeculativeConfig

    depth = SpeculativeConfig.suffix_decoding_max_tree_depth
    factor = SpeculativeConfig.suffix_decoding_max_spec_factor
    min_prob = SpeculativeConfig.suffix_decoding_min_token_prob
    caches = [SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=len(requests))
              for _ in (requests[:1] if shared else requests)]
    started: set[int] = set()

    def cache_of(i: int):
        return caches[0] if shared else caches[i]

    def add(i: int, new: list[int]) -> None:
        if i not in started:  # the prompt, then the first token as the response's start
            started.add(i)
            prompt = requests[i][0]
            cache_of(i).start_request(i, prompt)
            new = new[len(prompt):]
        cache_of(i).add_active_response(i, new)

    def rule(i: int, contexts, _) -> list[int]:
        return list(cache_of(i).speculate(i, contexts[i][-depth:], max_spec_tokens=tokens,
                                          max_spec_factor=factor,
                                          min_token_prob=min_prob).token_ids)

    return replay(requests, rule, add, rounds)


def greedy_outputs(job: dict, datasets: list[str]) -> dict[str, list[list[int]]]:
    """Plain decoding's greedy outputs of the job's prompts (its engine settings)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_graft.offline.engine import cpu_runtime_defaults, engine

    cpu_runtime_defaults()
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    outputs = {}
    with engine(job["target"], None, **job["engine"]) as llm:
        for name in datasets:
            results = llm.generate([TokensPrompt(prompt_token_ids=p)
                                    for p in job["datasets"][name]], params)
            outputs[name] = [list(r.outputs[0].token_ids) for r in results]
    return outputs


def guard_and_scout(cost):
    """Budget auto's throughput guard and chain scout, with their defaults, choosing
    between copy chains and plain decoding (``guard_modes`` chain and plain: trees need
    the drafter, which no replay runs)."""
    from vllm_graft.core.budget.sizer import build_budget_systems
    from vllm_graft.core.config import GraftConfig, StepMode

    config = GraftConfig(guard_modes=(StepMode.CHAIN, StepMode.PLAIN))
    systems = build_budget_systems(config, cost)
    return systems.guard, systems.scout


def chain_sizer(cost, calibration=None):
    """A fresh :class:`TreeSizer` over ``cost``, its chain acceptance odds seeded from
    ``calibration`` (a :class:`Calibration`) where given."""
    from vllm_graft.core.budget.sizer import build_budget_systems
    from vllm_graft.core.config import GraftConfig

    return build_budget_systems(GraftConfig(), cost, calibration).sizer


def main() -> int:
    from vllm_graft.core.config import GraftConfig

    chains = GraftConfig.model_fields  # a chain step's defaults
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", type=Path, help="a benchmark's job file")
    parser.add_argument("--datasets", nargs="+", metavar="NAME")
    parser.add_argument("--outputs", type=Path, help="greedy outputs kept here")
    parser.add_argument("--ngram-min", type=int, default=3)
    parser.add_argument("--ngram-max", type=int, default=5)
    parser.add_argument("--ngram-tokens", type=int, default=10)
    parser.add_argument("--graft-tokens", type=int, default=chains["chain_tokens"].default)
    parser.add_argument("--suffix-tokens", type=int, default=20)
    parser.add_argument("--gpu-costs", type=Path, metavar="GPU_CHECK_JSON",
                        help="project each rule's speed with this GPU check's "
                             "verification cost curves (module doc)")
    parser.add_argument("--context", type=int, default=1024,
                        help="the context length of the curves --gpu-costs uses")
    parser.add_argument("--calibration", type=Path,
                        help="the calibration file whose chain acceptance odds seed "
                             "graft_sized's sizer (default: none, the model's prior)")
    parser.add_argument("--warmup", type=Path,
                        help="the successor matrix file graft_sized's chains walk from "
                             "(default: none, no walk after the copy)")
    parser.add_argument("--chain-walk", type=int, default=chains["chain_walk"].default,
                        help="the most tokens graft_sized's walk adds after a copy")
    args = parser.parse_args()
    cost = calibration = None
    if args.gpu_costs is not None:
        from vllm_graft.core.budget import CostModel
        try:
            cost = CostModel.from_gpu_check(args.gpu_costs, args.context)
        except (OSError, ValueError, KeyError, TypeError) as error:
            parser.error(f"--gpu-costs {args.gpu_costs}: {error!r}")
    for name in ("calibration", "warmup"):
        if getattr(args, name) is not None and cost is None:
            parser.error(f"--{name} serves graft_sized, which needs --gpu-costs")
    warmup = None
    if args.warmup is not None:
        from vllm_graft.core.successor import SuccessorMatrix
        try:
            warmup = SuccessorMatrix.load(args.warmup)
        except (OSError, ValueError) as error:
            parser.error(f"--warmup {args.warmup}: {error}")
    if args.calibration is not None:
        from vllm_graft.core.calibration import load_calibration
        try:
            calibration = load_calibration(args.calibration)
        except ValueError as error:  # CalibrationError: names the file
            parser.error(f"--calibration: {error}")
    job = json.loads(args.job.read_text())
    datasets = args.datasets or list(job["datasets"])
    unknown = [name for name in datasets if name not in job["datasets"]]
    if unknown:
        parser.error(f"--datasets: {', '.join(unknown)} not in {args.job}")
    if args.outputs is not None and args.outputs.exists():
        outputs = json.loads(args.outputs.read_text())
        missing = [name for name in datasets if name not in outputs]
        if missing:
            parser.error(f"{args.outputs} has no outputs of {', '.join(missing)}")
    else:
        outputs = greedy_outputs(job, datasets)
        if args.outputs is not None:
            args.outputs.write_text(json.dumps(outputs))
    rules = {
        "ngram": lambda r, rounds: replay_ngram(r, args.ngram_min, args.ngram_max,
                                                args.ngram_tokens, rounds),
        "graft": lambda r, rounds: replay_graft(r, args.graft_tokens, False, rounds),
        "graft_peers": lambda r, rounds: replay_graft(r, args.graft_tokens, True, rounds),
    }
    guarded_modes: list[list[str]] = []  # graft_guarded's modes, a list a dataset
    if cost is not None:
        def sized_chains(requests, peers=False) -> SizedChains:
            matrices = None
            if warmup is not None:  # a private copy each, or one the requests share
                copies = [type(warmup)(warmup.table.clone())
                          for _ in (requests[:1] if peers else requests)]
                matrices = copies * len(requests) if peers else copies
            return SizedChains(requests, args.graft_tokens, chain_sizer(cost, calibration),
                               matrices, args.chain_walk, peers)

        def sized(requests, rounds, peers=False):
            return replay_chains(sized_chains(requests, peers), rounds)

        def guarded(requests, rounds):
            chains = sized_chains(requests)
            guard, scout = guard_and_scout(cost)
            guarded_modes.append(modes := [])
            return replay_graft_guarded(chains, guard, scout, cost, rounds, modes)

        rules["graft_sized"] = sized
        rules["graft_sized_peers"] = lambda requests, rounds: sized(requests, rounds, True)
        rules["graft_guarded"] = guarded
    if importlib.util.find_spec("arctic_inference") is not None:
        rules["suffix_own"] = lambda r, rounds: replay_suffix(r, args.suffix_tokens,
                                                              False, rounds)
        rules["suffix"] = lambda r, rounds: replay_suffix(r, args.suffix_tokens, True, rounds)
    print("Tokens per step:")
    print("| dataset | " + " | ".join(rules) + " |")
    print("|---|" + "---|" * len(rules))
    speeds = {}
    for name in datasets:
        requests = list(zip(job["datasets"][name], outputs[name]))
        row, speeds[name] = [], []
        for rule in rules.values():
            rounds: list[tuple[int, int]] = []
            row.append(f"{rule(requests, rounds):.3f}")
            if cost is not None:
                speeds[name].append(projected_ms(cost, plain_rounds(requests))
                                    / projected_ms(cost, rounds))
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)
    if cost is not None:
        print(f"\nProjected speed over plain decoding, verification forwards priced by "
              f"{args.gpu_costs.name} ({cost.key.get('model', '')}, "
              f"{cost.key.get('device', '')}, context {args.context}):")
        print("| dataset | " + " | ".join(rules) + " |")
        print("|---|" + "---|" * len(rules))
        for name, row in speeds.items():
            print(f"| {name} | " + " | ".join(f"{speed:.2f}" for speed in row) + " |")
        print("\ngraft_guarded's chain rounds: " + ", ".join(
            f"{name} {modes.count('chain')} of {len(modes)}"
            for name, modes in zip(datasets, guarded_modes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
