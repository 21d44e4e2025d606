"""Where each generated token came from, from the trees the worker recorded.

A tree step emits the accepted nodes of the verified tree, then one token the target
chose itself (the bonus token); a step without a tree emits one target token. The
worker records, per verified tree, the request's internal id, the root's position in
prompt + output and the accepted rows' tokens and sources (:mod:`vllm_graft.vllm.rpc`).
Positions, not record order, place the tokens: every output token no accepted node
covers was produced by the target. Nothing here imports vLLM, so the labelling can be
checked on a recorded trace without an engine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

DRAFT, RETRIEVED, BOTH, PADDING, TARGET = "draft", "retrieved", "both", "padding", "target"
CONTEXT = "context"
#: SOURCE_* flags of vllm_graft.core.hybrid -> label (every other value: target); a node
#: copied from the context is labelled so whatever else proposed it too
FLAG_LABELS = {1: DRAFT, 2: RETRIEVED, 3: BOTH, 4: PADDING,
               **{8 | other: CONTEXT for other in (0, 1, 2, 3)}}
LABELS = (DRAFT, RETRIEVED, BOTH, CONTEXT, PADDING, TARGET)


@dataclass
class LabelledOutput:
    """One request's output tokens and the source of each.

    ``cut`` counts accepted nodes that fall past the output's end (vLLM drops tokens
    after max_tokens or a stop): the engine's acceptance counters include them."""

    tokens: list[int]
    sources: list[str]
    cut: Counter = field(default_factory=Counter)

    def counts(self) -> Counter:
        return Counter(self.sources)


def external_id(internal_req_id: str) -> str:
    """vLLM makes request ids unique inside the engine by appending ``-`` and eight
    hex characters to the caller's id; the outputs carry the caller's id."""
    head, _, tail = internal_req_id.rpartition("-")
    return head if head and len(tail) == 8 else internal_req_id


def records_by_request(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for record in records:
        out.setdefault(external_id(record["req_id"]), []).append(record)
    return out


def label_output(records: list[dict], prompt_len: int, tokens: list[int]) -> LabelledOutput:
    """Sources of ``tokens`` (one request's output) from that request's tree records.

    The root of a tree sits at ``position``, so its k-th accepted node is output token
    ``position + k - prompt_len`` (k from 1). A later record at the same position wins
    (a recomputed request verifies again)."""
    sources = [TARGET] * len(tokens)
    cut: Counter = Counter()
    for record in sorted(records, key=lambda r: r["position"]):
        first = record["position"] + 1 - prompt_len
        flags = [record["source"][row] for row in record["accepted_rows"]]
        for offset, flag in enumerate(flags):
            label = FLAG_LABELS.get(flag, TARGET)
            index = first + offset
            if 0 <= index < len(tokens):
                sources[index] = label
            elif index >= len(tokens):
                cut[label] += 1
    return LabelledOutput(tokens=list(tokens), sources=sources, cut=cut)


def mismatches(records: list[dict], prompt_len: int, tokens: list[int]) -> list[int]:
    """Output indices where a recorded accepted token differs from the output token:
    empty when records and output agree (a check for tests and debugging)."""
    bad = []
    for record in records:
        first = record["position"] + 1 - prompt_len
        for offset, token in enumerate(record.get("accepted_tokens", [])):
            index = first + offset
            if 0 <= index < len(tokens) and tokens[index] != token:
                bad.append(index)
    return bad


def text_pieces(tokenizer, tokens: list[int]) -> list[str]:
    """The text each token adds, decoded in context (a token alone can be half a
    character or lose its leading space), so the pieces join to the decoded text."""
    pieces, previous = [], ""
    for end in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:end], skip_special_tokens=True)
        if text.endswith("\ufffd") and end < len(tokens):
            pieces.append("")  # an unfinished character: its bytes show with the next token
            continue
        pieces.append(text[len(previous):] if text.startswith(previous) else text)
        previous = text
    return pieces
