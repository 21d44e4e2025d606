"""Matches in other requests' outputs, for copies across requests (SuffixDecoding-like):
:class:`RecentOutputsIndex`, an n-gram hash over recent finished outputs within a token
budget, and :class:`PeerOutputs`, the outputs of running requests read through their own
:class:`~vllm_graft.core.context.ContextIndex`. Which requests may copy from which is
the adapter's call (``graft.isolation``: those that share a successor matrix)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from vllm_graft.core.context import (ContextIndex, _as_ints, _check_at_least, _NgramIndex,
                                     _NgramTable)


class RecentOutputsIndex(_NgramIndex):
    """Cross-request index of recent finished outputs (SuffixDecoding-like), bounded:
    holds at most ``max_tokens`` tokens, evicting the oldest outputs first.

    An output longer than ``max_tokens`` keeps only its last ``max_tokens`` tokens;
    outputs too short to hold a match with a continuation are not stored.
    """

    def __init__(self, max_tokens: int = 65536, min_ngram: int = 2, max_ngram: int = 8,
                 max_positions: int = 32):
        _check_at_least("max_tokens", max_tokens, 1)
        self._table = _NgramTable(min_ngram, max_ngram, max_positions)
        self.max_tokens = max_tokens
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()
        self._next_id = 0
        self._num_tokens = 0


    @property
    def num_outputs(self) -> int:
        return len(self._outputs)

    def __len__(self) -> int:
        return self._num_tokens

    def add(self, tokens: Sequence[int]) -> None:
        """Index one finished output (whether it includes the prompt is the caller's
        choice), then evict the oldest outputs until at most ``max_tokens`` remain."""
        output = _as_ints(tokens)[-self.max_tokens:]
        if len(output) < self.min_ngram + 1:
            return
        output_id = self._next_id
        self._next_id += 1
        self._outputs[output_id] = output
        self._num_tokens += len(output)
        for end in range(self.min_ngram - 1, len(output)):
            self._table.register(output, end, (output_id, end))
        while self._num_tokens > self.max_tokens:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        output_id, output = self._outputs.popitem(last=False)
        self._num_tokens -= len(output)
        self._table.remove_leading(output, lambda position: position[0] == output_id)

    def matches(self, suffix: Sequence[int], max_matches: int, max_depth: int,
                longer_than: int = 0) -> list[tuple[int, list[int]]]:
        """``(match length, continuation)`` for up to ``max_matches`` occurrences of the
        end of ``suffix`` followed by at least one token: longest match first, most
        recent first within a length; each continuation has at most ``max_depth``
        tokens and stays within its output. Only matches longer than ``longer_than``."""
        _check_at_least("max_matches", max_matches, 0)
        _check_at_least("max_depth", max_depth, 1)
        found: list[tuple[int, list[int]]] = []
        if max_matches == 0:
            return found
        taken: set[tuple[int, int]] = set()
        for n in range(min(self.max_ngram, len(suffix)),
                       max(self.min_ngram, longer_than + 1) - 1, -1):
            for position in reversed(self._table.lookup(suffix, n)):
                output_id, end = position
                output = self._outputs[output_id]
                if end >= len(output) - 1 or position in taken:
                    continue
                taken.add(position)
                found.append((n, output[end + 1:end + 1 + max_depth]))
                if len(found) == max_matches:
                    return found
        return found


class PeerOutputs:
    """The outputs of a request's peers (other running requests that read the same
    successor matrix, :mod:`vllm_graft.core.isolation`) as they grow, and recent
    finished outputs, as one source of cross-request matches: SuffixDecoding's global
    tree, within an isolation owner. A peer's output is read through the peer's own
    :class:`ContextIndex` (no index of its own: no memory, no upkeep); only occurrences
    ending in the peer's output count, not in its prompt, as suffix decoding keeps
    responses only. ``finished``: a :class:`RecentOutputsIndex` (or None), whose
    matches follow the peers' of the same length.

    peers: ``(index, output_start)`` per peer, ``output_start`` its prompt's length.
    """

    def __init__(self, peers: Sequence[tuple[ContextIndex, int]],
                 finished: RecentOutputsIndex | None = None):
        self.peers = list(peers)
        self.finished = finished
        first = self.peers[0][0] if self.peers else finished
        self.min_ngram = first.min_ngram if first is not None else 1
        self.max_ngram = first.max_ngram if first is not None else 0

    def __bool__(self) -> bool:
        return bool(self.peers) or self.finished is not None

    def matches(self, suffix: Sequence[int], max_matches: int, max_depth: int,
                longer_than: int = 0) -> list[tuple[int, list[int]]]:
        """:meth:`RecentOutputsIndex.matches` over the peers' outputs, then the finished
        ones, longest first (within a length the peers' first, in their order, each's
        most recent first); only matches longer than ``longer_than`` tokens (a lookup
        that a longer own match makes moot costs nothing)."""
        _check_at_least("max_matches", max_matches, 0)
        _check_at_least("max_depth", max_depth, 1)
        found: list[tuple[int, list[int]]] = []
        finished = self.finished.matches(suffix, max_matches, max_depth, longer_than) \
            if self.finished is not None else []
        taken: set[tuple[int, int]] = set()  # (peer, end): found at a longer length
        for n in range(min(self.max_ngram, len(suffix)),
                       max(self.min_ngram, longer_than + 1) - 1, -1):
            key = tuple(suffix[len(suffix) - n:])  # one key for every peer's table
            for peer, (index, output_start) in enumerate(self.peers):
                tokens = index.tokens
                for end in reversed(index._table.get(key)):
                    if end < output_start or end >= len(tokens) - 1 or (peer, end) in taken:
                        continue
                    taken.add((peer, end))
                    found.append((n, list(tokens[end + 1:end + 1 + max_depth])))
                    if len(found) == max_matches:
                        return found
            for match in finished:
                if match[0] == n:
                    found.append(match)
                    if len(found) == max_matches:
                        return found
        return found
