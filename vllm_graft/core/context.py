"""Retrieval from a request's own context: prompt lookup that proposes a small tree.

Each step the last tokens of a request's context (prompt + generated tokens) are
looked up among their earlier occurrences; what followed each occurrence is a guess
at what follows now. Several matches are merged into a trie under the root (the last
context token), so one proposal covers diverging continuations, and each node is
weighted by the share of the matches that pass through it.

The lookup is an n-gram hash kept up to date as tokens arrive (:class:`ContextIndex`),
so a step costs a few dictionary reads however long the context is, where scanning
the whole context for the suffix (vLLM's n-gram proposer) costs time linear in its
length every step. Each key keeps only its most recent ``max_positions`` end
positions, which bounds memory by ``len * (max_ngram - min_ngram + 1)`` entries and
loses only old occurrences of frequent n-grams, which the most-recent-first rule
would not pick anyway. Indexing may lag the context by a bounded amount of work per
step (:meth:`ContextIndex.catch_up`): a long prompt is indexed newest first over
several steps, proposing from the part indexed meanwhile.

:mod:`vllm_graft.core.shared_outputs` holds matches in other requests' outputs
(SuffixDecoding-like): a hash over recent finished outputs within a token budget, and
the outputs of running requests that share the request's successor matrix, read
through their own indexes; a request with too few matches of its own fills up from them, and a copy
chain follows a shared match that is longer than its own best.

Weights. A match of length ``n`` (the n-gram length at which it was found) has weight
``n``, times ``shared_discount`` when it comes from another request's output: longer
matches are more specific, and a request's own text predicts it better than another
one's. A node's weight is the weight of the matches whose continuation passes through
it over the weight of all matches, times ``depth_decay ** (depth - 1)``: even a
continuation every match agrees on drifts away from the text being generated, and the
decay lets a well-supported sibling near the root outrank the tail of a long chain.
A node's matches are a subset of its parent's, so weights never increase along a
path, and the ``max_nodes`` best nodes form a prefix-closed subtree.

Lead chain. Ranked by weight alone, a suffix with many diverging occurrences (common
word pairs) spreads the nodes over short branches, and the tree may hold less of the
best single continuation than prompt lookup would verify. ``lead_nodes`` keeps the
first ``lead_nodes`` tokens of the first match (the longest, most recent one, i.e.
prompt lookup's own chain) before any other node, so the tree contains that chain.

Spans. Occurrences that match the longest n-gram (``max_ngram`` tokens) are ranked by
how far back they really match (up to :data:`SPAN_LOOKBACK` tokens), then by recency.
A span being copied is the occurrence matching as far back as the copy goes, so it
keeps being proposed step after step; ranking by recency alone jumped to the most
recent occurrence of the last ``max_ngram`` tokens, in code and data with repeated
lines often another line than the one being copied. The rule reads the text only, so
a proposal never depends on earlier calls.

Repeats. An occurrence close to the context's end has fewer than ``max_depth`` tokens
after it. Where it overlaps the suffix it matched (the last tokens already repeat with
the period of its distance from the end: text caught in a loop, a model repeating a
line, a closing fence, a table rule), its continuation goes on repeating the period:
the most recent occurrence of a loop is one period back, and proposing only the
period's few tokens left most of suffix decoding's gain on the copy benchmark's agent
transcripts to it. An occurrence that does not overlap is no evidence of a loop and
keeps its cut continuation, as prompt lookup's.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

#: Per-depth factor of node weights (see the module docstring).
DEPTH_DECAY = 0.9
#: Weight factor of a match found in another request's output.
SHARED_DISCOUNT = 0.5
#: Tokens an occurrence of the longest n-gram is followed back to rank it (module
#: docstring, Spans): a bound on the work of a lookup, far past any n-gram length.
SPAN_LOOKBACK = 64
#: Match lengths above the shortest matched that :func:`match_score` tells apart.
MATCH_SCORE_STEPS = 3


class SharedMatches(Protocol):
    """Matches in other requests' outputs (:mod:`vllm_graft.core.shared_outputs`)."""

    max_ngram: int

    def matches(self, suffix: Sequence[int], max_matches: int, max_depth: int,
                longer_than: int = 0) -> list[tuple[int, list[int]]]:
        """``(match length, continuation)`` of up to ``max_matches`` occurrences of the
        end of ``suffix`` longer than ``longer_than`` tokens, longest first."""


def match_score(match_length: int, min_ngram: int) -> float:
    """What a context-copied node's match says of its odds, as the acceptance model's
    score in [0, 1] (:class:`vllm_graft.core.budget.AcceptanceModel`): how many tokens
    longer than the shortest matched suffix the match was, saturating at
    ``MATCH_SCORE_STEPS`` more. A continuation that followed eight matching tokens is
    copied far more often than one that followed two, and prompt lookup's gain rests on
    telling them apart; one score per bucket of four keeps the counts few enough to
    learn online. 0 without a match."""
    if match_length <= 0:
        return 0.0
    return min(max(match_length - min_ngram, 0), MATCH_SCORE_STEPS) / MATCH_SCORE_STEPS


@dataclass(frozen=True)
class ContextProposal:
    """One request's context-retrieved subtree under the root, parents first.

    tokens:  token ids of the nodes
    parents: index into this proposal's nodes, -1 = child of the root
    depths:  1 for children of the root
    weights: estimated probability that the node is on the accepted path, in (0, 1];
             non-increasing along every path
    match_length: length of the longest suffix match used (0 = no match)
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    weights: list[float]
    match_length: int

    @staticmethod
    def empty() -> ContextProposal:
        return ContextProposal(tokens=[], parents=[], depths=[], weights=[], match_length=0)

    def __len__(self) -> int:
        return len(self.tokens)


# (weight, continuation) of one match, in priority order
_Match = tuple[float, Sequence[int]]


def _as_ints(tokens: Iterable[int]) -> list[int]:
    """Plain ints: numpy or torch scalars would hash by identity or compare slowly."""
    tolist = getattr(tokens, "tolist", None)
    if tolist is not None:  # one conversion for a whole tensor or array
        dtype = getattr(tokens, "dtype", None)
        tokens = tolist()
        if _is_integer(dtype) and type(tokens) is list:
            return tokens  # already plain ints (a 128K-token prompt: 5 ms less)
    return [int(t) for t in tokens]


def _is_integer(dtype: Any) -> bool:
    """Whether a numpy or torch dtype holds integers (their ``tolist`` gives ints)."""
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    return getattr(dtype, "kind", None) in ("i", "u")


def _check_ngram_args(min_ngram: int, max_ngram: int, max_positions: int) -> None:
    if min_ngram < 1:
        raise ValueError(f"min_ngram must be >= 1, got {min_ngram}")
    if max_ngram < min_ngram:
        raise ValueError(f"max_ngram must be >= min_ngram ({min_ngram}), got {max_ngram}")
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")


def _check_at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")


class _NgramTable:
    """n-gram tuple -> most recent end positions (oldest first), at most ``max_positions``.

    Positions are opaque to the table (ints for one context, (output, end) pairs across
    outputs), never lists; they only need to be appended in increasing time order. A
    key seen once (most keys) holds its position bare rather than in a one-item list:
    a quarter less memory, and far fewer objects for the garbage collector to walk.
    """

    def __init__(self, min_ngram: int, max_ngram: int, max_positions: int):
        _check_ngram_args(min_ngram, max_ngram, max_positions)
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_positions = max_positions
        self.positions: dict[tuple[int, ...], Any] = {}
        self.num_entries = 0

    def register(self, tokens: list[int], end: int, position: object) -> None:
        """Record ``position`` under every n-gram of ``tokens`` that ends at ``end``."""
        table, cap = self.positions, self.max_positions
        for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
            key = tuple(tokens[end - n + 1:end + 1])
            found = table.get(key)
            if found is None:
                table[key] = position
                self.num_entries += 1
            elif type(found) is list:
                found.append(position)
                if len(found) > cap:
                    del found[0]
                else:
                    self.num_entries += 1
            elif cap == 1:
                table[key] = position
            else:
                table[key] = [found, position]
                self.num_entries += 1

    def register_older(self, tokens: list[int], end: int, position: object) -> None:
        """:meth:`register` for a position older than every one the table holds: it is
        kept only under keys holding fewer than ``max_positions``, at their front, so
        positions registered newest first end as registering them oldest first would."""
        table, cap = self.positions, self.max_positions
        for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
            key = tuple(tokens[end - n + 1:end + 1])
            found = table.get(key)
            if found is None:
                table[key] = position
            elif type(found) is list:
                if len(found) >= cap:
                    continue
                found.insert(0, position)
            elif cap == 1:
                continue
            else:
                table[key] = [position, found]
            self.num_entries += 1

    def unregister_newest(self, tokens: list[int], end: int, position: object) -> None:
        """Undo :meth:`register` of ``position``, the newest position under every key
        that still holds it (one that dropped it for newer ones, since removed, keeps
        what it has). A key left with one position holds it bare, and an empty key goes,
        as if ``position`` had never been registered."""
        table = self.positions
        for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
            key = tuple(tokens[end - n + 1:end + 1])
            found = table.get(key)
            if found is None:
                continue
            if type(found) is list:
                if found[-1] != position:
                    continue
                found.pop()
                if len(found) == 1:
                    table[key] = found[0]
            elif found == position:
                del table[key]
            else:
                continue
            self.num_entries -= 1

    def lookup(self, suffix: Sequence[int], n: int) -> Sequence[Any]:
        """End positions of the last ``n`` tokens of ``suffix``, oldest first."""
        return self.get(tuple(suffix[len(suffix) - n:]))

    def get(self, key: tuple[int, ...]) -> Sequence[Any]:
        found = self.positions.get(key)
        if found is None:
            return ()
        return found if type(found) is list else (found,)

    def remove_leading(self, tokens: list[int], is_gone: Callable[[Any], bool]) -> None:
        """Drop the entries of ``tokens``' n-grams that satisfy ``is_gone``, which must
        be the oldest entries of each key (true of the oldest output when evicting)."""
        table = self.positions
        for end in range(self.min_ngram - 1, len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                key = tuple(tokens[end - n + 1:end + 1])
                found = self.get(key)
                cut = 0
                while cut < len(found) and is_gone(found[cut]):
                    cut += 1
                if not cut:
                    continue  # newer entries only, or an earlier end emptied the key
                if cut == len(found):
                    del table[key]  # empty keys would leak memory across evictions
                else:
                    del found[:cut]  # a list: a bare position is all or nothing
                self.num_entries -= cut


class _NgramIndex:
    """What both indexes share: an :class:`_NgramTable` and its settings."""

    _table: _NgramTable

    @property
    def min_ngram(self) -> int:
        return self._table.min_ngram

    @property
    def max_ngram(self) -> int:
        return self._table.max_ngram

    @property
    def max_positions(self) -> int:
        return self._table.max_positions

    def num_entries(self) -> int:
        """Stored end positions over all n-gram keys."""
        return self._table.num_entries


class ContextIndex(_NgramIndex):
    """n-gram hash over one request's tokens, updated incrementally.

    Every n-gram with ``min_ngram <= n <= max_ngram`` maps to its most recent
    ``max_positions`` end positions; :meth:`extend` registers the n-grams that end at
    each new token, so any chunking of the same tokens builds the same index.

    Indexing can lag the context (:meth:`append`, then :meth:`catch_up` with a limit,
    a few thousand positions per engine step): the indexed end positions are always one
    contiguous range, which grows up over the positions appended since and then down
    over the older ones, so a long prompt is indexed newest first over several steps.
    Lookups read the whole context's suffix and continuations but find only indexed
    occurrences; once nothing is pending the table is the one :meth:`extend` builds,
    whatever the order.
    """

    def __init__(self, min_ngram: int = 2, max_ngram: int = 8, max_positions: int = 32):
        self._table = _NgramTable(min_ngram, max_ngram, max_positions)
        self._tokens: list[int] = []
        # indexed end positions: [_low, _high); ends below min_ngram - 1 hold no n-gram
        self._low = self._high = min_ngram - 1


    @property
    def tokens(self) -> Sequence[int]:
        """The context held (the index's own list: read, do not modify)."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def indexed(self) -> range:
        """The end positions whose n-grams are indexed (a contiguous range)."""
        return range(self._low, self._high)

    @property
    def pending(self) -> int:
        """End positions holding an n-gram that are not indexed yet."""
        floor = self.min_ngram - 1
        return max(len(self._tokens) - floor, 0) - (self._high - self._low)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the context and index the n-grams ending at each (and
        at every position still pending)."""
        self.append(tokens)
        self.catch_up()

    def append(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the context without indexing them (:meth:`catch_up`)."""
        self._tokens.extend(_as_ints(tokens))

    def catch_up(self, limit: int | None = None) -> int:
        """Index up to ``limit`` pending end positions (all: ``None``): first
        those appended since the indexed range, oldest first, then those below it,
        newest first; with nothing indexed yet, from the newest down. Returns how many
        it indexed: the work is that many positions' n-grams, however long the context."""
        if limit is not None:
            _check_at_least("limit", limit, 0)
        length, floor = len(self._tokens), self.min_ngram - 1
        budget = self.pending if limit is None else min(limit, self.pending)
        if budget == 0:
            return 0
        if self._low == self._high:  # nothing indexed: start from the newest position
            self._low = self._high = max(length, floor)
        context, table = self._tokens, self._table
        top = min(length, self._high + budget)
        for end in range(self._high, top):
            table.register(context, end, end)
        done, self._high = top - self._high, top
        bottom = max(floor, self._low - (budget - done))
        for end in range(self._low - 1, bottom - 1, -1):
            table.register_older(context, end, end)
        done, self._low = done + self._low - bottom, bottom
        return done

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (a rewound history), unindexing the rest:
        the work is the dropped positions', not a rebuild. The table is then the one
        of indexing those tokens, except that a key which had dropped positions for
        newer ones now gone keeps fewer than ``max_positions`` (which costs matches,
        never correctness)."""
        _check_at_least("length", length, 0)
        if length >= len(self._tokens):
            return
        context, table = self._tokens, self._table
        cut = max(length, self._low)
        for end in range(self._high - 1, cut - 1, -1):
            table.unregister_newest(context, end, end)
        del context[length:]
        floor = self.min_ngram - 1
        self._high = max(min(self._high, length), floor)
        if self._low >= self._high:  # nothing indexed is left
            self._low = self._high

    def _own_matches(self, max_matches: int, max_depth: int) -> tuple[list[_Match], int]:
        """Earlier occurrences of the suffix, longest first, then most recent first
        (those of ``max_ngram`` tokens by how far back they match: module docstring)."""
        context, length = self._tokens, len(self._tokens)
        matches: list[_Match] = []
        taken: set[int] = set()
        longest = 0
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            found = self._table.lookup(context, n)  # oldest first
            ends = sorted(reversed(found), key=lambda end: -run_length(context, end, n)) \
                if n == self.max_ngram and len(found) > 1 else reversed(found)  # stable
            for end in ends:
                # end == length - 1 is the suffix itself: nothing follows it yet
                if end >= length - 1 or end in taken:
                    continue
                taken.add(end)
                matches.append((float(n), continuation(context, end, max_depth, n)))
                longest = max(longest, n)
                if len(matches) == max_matches:
                    return matches, longest
        return matches, longest

    def best_match(self, max_depth: int,
                   shared: SharedMatches | None = None
                   ) -> tuple[int, list[int]]:
        """``(match length, continuation)``: what followed the longest, most recent
        earlier occurrence of the suffix, at most ``max_depth`` tokens; ``(0, [])``
        without a match. Prompt lookup's proposal, for copy chains. An occurrence in
        ``shared`` (other requests' outputs) is taken only when it matches longer than
        the best one of this context: the request's own text predicts it better at
        equal length, and a longer match is more specific (on the copy benchmark's
        agent transcripts, taking the shared match only without an own one left a
        quarter of the gain to suffix decoding)."""
        _check_at_least("max_depth", max_depth, 0)
        if max_depth == 0 or not self._tokens:
            return 0, []
        matches, _ = self._own_matches(1, max_depth)
        best = (int(matches[0][0]), list(matches[0][1])) if matches else (0, [])
        if shared is not None and best[0] < shared.max_ngram:
            suffix = self._tokens[-shared.max_ngram:]
            found = shared.matches(suffix, 1, max_depth, longer_than=best[0])
            if found and found[0][0] > best[0]:
                return found[0][0], list(found[0][1])
        return best

    def propose(self, max_nodes: int, max_depth: int, max_matches: int,
                shared: SharedMatches | None = None, *,
                depth_decay: float = DEPTH_DECAY,
                shared_discount: float = SHARED_DISCOUNT,
                lead_nodes: int = 0) -> ContextProposal:
        """The best ``max_nodes`` nodes of the trie of up to ``max_matches`` suffix
        matches' continuations (``max_depth`` tokens each) under the last token.

        Own matches come first; ``shared`` fills the remaining matches with occurrences
        of the suffix in recent outputs of other requests. Node weights: see the
        module docstring. Ties rank shallower nodes first, then earlier ones (from a
        longer or more recent match). The first ``lead_nodes`` nodes of the first
        match's continuation rank before all others (module docstring).
        """
        _check_at_least("lead_nodes", lead_nodes, 0)
        _check_at_least("max_nodes", max_nodes, 0)
        _check_at_least("max_depth", max_depth, 0)
        _check_at_least("max_matches", max_matches, 0)
        _check_fraction("depth_decay", depth_decay)
        _check_fraction("shared_discount", shared_discount)
        if max_nodes == 0 or max_depth == 0 or max_matches == 0 or not self._tokens:
            return ContextProposal.empty()
        matches, longest = self._own_matches(max_matches, max_depth)
        if shared is not None and len(matches) < max_matches:
            suffix = self._tokens[-shared.max_ngram:]
            for n, continuation in shared.matches(suffix, max_matches - len(matches),
                                                  max_depth):
                matches.append((n * shared_discount, continuation))
                longest = max(longest, n)
        if not matches:
            return ContextProposal.empty()
        return _best_subtree(matches, max_nodes, depth_decay, longest, lead_nodes)


def continuation(context: Sequence[int], end: int, max_depth: int, matched: int
                 ) -> list[int]:
    """What followed the occurrence of the last ``matched`` tokens that ends at ``end``,
    at most ``max_depth`` tokens. Where the context ends first and the occurrence
    overlaps the suffix (it matches at least as far back as its distance from the end,
    the period), the text already repeats with that period: the continuation goes on
    repeating it (module docstring, Repeats)."""
    tokens = list(context[end + 1:end + 1 + max_depth])
    period = len(context) - 1 - end
    if 0 < period < max_depth and (matched >= period
                                   or run_length(context, end, matched) >= period):
        tokens.extend(tokens[k % period] for k in range(period, max_depth))
    return tokens


def run_length(context: Sequence[int], end: int, known: int = 0) -> int:
    """How many tokens up to position ``end`` equal the last ones of ``context`` (at
    most :data:`SPAN_LOOKBACK`), ``known`` of them known to already."""
    last, n = len(context) - 1, known
    while n < SPAN_LOOKBACK and end - n >= 0 and context[end - n] == context[last - n]:
        n += 1
    return n


def _best_subtree(matches: list[_Match], max_nodes: int, depth_decay: float,
                  match_length: int, lead_nodes: int = 0) -> ContextProposal:
    """Trie-merge the continuations and keep the ``max_nodes`` heaviest nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    mass: list[float] = []
    child: dict[tuple[int, int], int] = {}
    total = 0.0
    for weight, continuation in matches:
        total += weight
        parent = -1
        for token in continuation:
            node = child.get((parent, token))
            if node is None:
                node = child[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
                depths.append(1 if parent < 0 else depths[parent] + 1)
                mass.append(0.0)
            mass[node] += weight
            parent = node

    # Nodes are numbered parents first, so a parent's weight is known before its
    # children's; the min() only guards the invariant against rounding.
    weights: list[float] = []
    for node, parent in enumerate(parents):
        weight = mass[node] / total * depth_decay ** (depths[node] - 1)
        weights.append(weight if parent < 0 else min(weight, weights[parent]))

    # A parent outranks its children (weight >=, shallower), so the best nodes are
    # prefix-closed and, in rank order, parents first. The lead chain is the first
    # match's path (nodes 0, 1, ... in insertion order), ranked ahead as a whole.
    lead = set(range(min(lead_nodes, len(matches[0][1]) if matches else 0)))
    kept = heapq.nsmallest(max_nodes, range(len(tokens)),
                           key=lambda i: (i not in lead, -weights[i], depths[i], i))
    row = {node: i for i, node in enumerate(kept)}
    return ContextProposal(
        tokens=[tokens[i] for i in kept],
        parents=[-1 if parents[i] < 0 else row[parents[i]] for i in kept],
        depths=[depths[i] for i in kept],
        weights=[weights[i] for i in kept],
        match_length=match_length,
    )


def proposals_to_tensors(proposals: Sequence[ContextProposal], width: int,
                         device: torch.device | str = "cpu"
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, width] tokens (int64, -1 padding), parents (int64, -1 = root and for
    padding), depths (int64, 0 for padding), weights (float32, 0 for padding).

    Proposals longer than ``width`` are cut to their first ``width`` nodes, still
    prefix-closed because nodes are parents first. Built on the host and moved once.
    """
    _check_at_least("width", width, 0)
    tokens, parents, depths, weights = [], [], [], []
    for proposal in proposals:
        n = min(len(proposal.tokens), width)
        pad = width - n
        tokens.append(proposal.tokens[:n] + [-1] * pad)
        parents.append(proposal.parents[:n] + [-1] * pad)
        depths.append(proposal.depths[:n] + [0] * pad)
        weights.append(proposal.weights[:n] + [0.0] * pad)
    shape = (len(proposals), width)

    def make(rows: list[list], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(rows, dtype=dtype).reshape(shape).to(device)

    return (make(tokens, torch.int64), make(parents, torch.int64),
            make(depths, torch.int64), make(weights, torch.float32))
