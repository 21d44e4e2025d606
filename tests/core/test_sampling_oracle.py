"""An oracle for temperature, top-k and top-p that does not share code with the
implementations it checks.

Each implementation under test is a callable ``(logits [B, V] float32, temperature [B],
top_k [B] int64 or None, top_p [B] float32 or None) -> probs [B, V]``, listed in
:data:`IMPLEMENTATIONS`; a new one (a fused kernel, say) is one more line there. Its
output is checked against kept sets written out by hand for tiny vocabularies, and
against :func:`expected_kept`, a plain Python loop over sorted values, for seeded random
logits. vLLM's own processing runs through the same oracle (so the oracle is known to
describe vLLM) and is compared with every implementation on random logits without ties.

The semantics are vLLM 0.32's ``Sampler`` followed by ``apply_top_k_top_p``
(``vllm/v1/sample/ops/topk_topp_sampler.py``; its PyTorch version, which the CPU
backend runs and which GPUs fall back to without Triton):

* temperature first: ``logits / temperature``;
* top-k: the k-th largest value is found and every token *below* it is masked, so every
  token tied with the k-th value is kept (more than k tokens may survive). vLLM itself
  only sees ``1 <= k <= V``: its input batch stores ``V`` for a request whose top_k is 0
  or -1 (disabled) or at least V. Here k <= 0 and k >= V mean "no top-k", as in
  ``SamplingBatch``;
* top-p, after top-k and on the renormalised survivors: the logits are sorted ascending
  (``torch.sort``, not stable), the softmax of the sorted row is summed cumulatively,
  and the tokens whose cumulative sum is ``<= 1 - p`` are masked, but never the last
  (largest) one. In descending order: a token is kept exactly when the mass of the
  tokens before it is below p. That is the smallest high-probability set whose mass
  reaches p (``>= p``), at least one token.
* ties on the top-p boundary: when the boundary falls inside a group of tokens with
  equal logits, the number of that group's tokens kept is fixed (the cumulative sums
  are the same whatever order the tied tokens sit in), but *which* of them are kept is
  the order in which the unstable sort left them, so it is not defined by the values.
  The tests here check, for such a group, only what is defined: tokens above the group
  are kept, tokens below it are masked, and the group keeps the right number of tokens.
  (Ties at the top-k boundary are fully defined: all kept.)

The GPU paths of vLLM (a Triton kernel for the masks, or FlashInfer's sampling, which
never builds them) are not this reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from vllm_graft.core.acceptance import sampling_probs

Implementation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None,
                           torch.Tensor | None], torch.Tensor]

#: The implementations under test: ``(name, callable)``.
IMPLEMENTATIONS: list[tuple[str, Implementation]] = [
    ("sampling_probs", sampling_probs),
]


def vllm_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
               top_p: torch.Tensor | None) -> torch.Tensor:
    """vLLM 0.32's own processing: its sampler's temperature, then ``apply_top_k_top_p``
    (top_k translated as vLLM's input batch does: "no top-k" is the vocabulary size)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    vocab = logits.shape[1]
    logits = Sampler.apply_temperature(logits.clone().float(), temperature.float(),
                                       all_random=True)
    k = None if top_k is None else \
        torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).long()
    p = None if top_p is None else top_p.float()
    return apply_top_k_top_p(logits, k, p).softmax(dim=-1, dtype=torch.float32)


#: what the oracle itself is run against: the implementations and vLLM
SUBJECTS = IMPLEMENTATIONS + [("vllm", vllm_probs)]


# ---- the oracle -----------------------------------------------------------------------
@dataclass
class Kept:
    """The kept set of one row: every token of ``sure`` is kept; of ``tied``, exactly
    ``tied_count`` are (which ones is not defined); every other token is masked.
    ``margin``: how far from p the mass before any token came (float32 sums are only
    trusted when it is not tiny)."""

    sure: set[int]
    tied: set[int] = field(default_factory=set)
    tied_count: int = 0
    margin: float = math.inf


def expected_kept(logits: list[float], temperature: float, top_k: int | None,
                  top_p: float | None) -> Kept:
    """The oracle: a loop over the tokens sorted by value, in float64."""
    vocab = len(logits)
    scaled = [x / temperature for x in logits]
    order = sorted(range(vocab), key=lambda i: scaled[i], reverse=True)
    if top_k is not None and 0 < top_k < vocab:
        kth = scaled[order[top_k - 1]]
        order = [i for i in order if scaled[i] >= kth]
    if top_p is None or top_p >= 1:
        return Kept(sure=set(order))
    top = scaled[order[0]]
    weight = {i: math.exp(scaled[i] - top) for i in order}
    total = sum(weight.values())
    kept = Kept(sure=set())
    before = 0.0  # mass of the tokens before the current one, descending
    start = 0
    while start < len(order):
        end = start
        while end < len(order) and scaled[order[end]] == scaled[order[start]]:
            end += 1
        group = order[start:end]
        share = weight[group[0]] / total
        count = 0
        for j in range(len(group)):
            mass = before + j * share
            kept.margin = min(kept.margin, abs(mass - top_p))
            count += mass < top_p
        if count == len(group):
            kept.sure.update(group)
        elif count:
            kept.tied, kept.tied_count = set(group), count
        before += len(group) * share
        start = end
    return kept


def row_mismatch(probs: torch.Tensor, logits: list[float], temperature: float,
                 kept: Kept) -> str | None:
    """Why the probabilities ``probs`` [V] of one row do not match ``kept`` (None when
    they do): the support, then the values (the softmax of ``logits / temperature``
    over the support, in float64)."""
    probs = probs.double()
    support = set(torch.nonzero(probs > 0).flatten().tolist())
    if not kept.sure <= support:
        return f"masked {sorted(kept.sure - support)}, which must be kept"
    extra = support - kept.sure - kept.tied
    if extra:
        return f"kept {sorted(extra)}, which must be masked"
    if len(support & kept.tied) != kept.tied_count:
        return (f"kept {sorted(support & kept.tied)} of the tied {sorted(kept.tied)}, "
                f"want {kept.tied_count} of them")
    scaled = {i: logits[i] / temperature for i in support}
    top = max(scaled.values())
    total = sum(math.exp(v - top) for v in scaled.values())
    want = torch.zeros_like(probs)
    for i, v in scaled.items():
        want[i] = math.exp(v - top) / total
    if not torch.allclose(probs, want, rtol=2e-5, atol=1e-7):
        worst = int((probs - want).abs().argmax())
        return f"token {worst}: probability {float(probs[worst])}, want {float(want[worst])}"
    return None


def run(impl: Implementation, logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """Call ``impl`` on a batch; scalars or per-row lists, None = the option off."""
    batch = logits.shape[0]

    def column(values, dtype):
        if values is None:
            return None
        values = values if isinstance(values, list) else [values] * batch
        return torch.tensor(values, dtype=dtype)

    probs = impl(logits.clone(), column(temperature, torch.float32),
                 column(top_k, torch.int64), column(top_p, torch.float32))
    assert probs.shape == logits.shape
    return probs


# ---- hand-written cases ---------------------------------------------------------------
def _log(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


@dataclass
class Case:
    name: str
    logits: list[float]
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    kept: set[int] = field(default_factory=set)  # the tokens always kept
    tied: set[int] = field(default_factory=set)  # the boundary's tied group, if any
    tied_count: int = 0

    def expectation(self) -> Kept:
        return Kept(set(self.kept), set(self.tied), self.tied_count)


TIES = [3.0, 1.0, 2.0, 2.0, 0.0, 2.0]  # values 3 > 2 = 2 = 2 > 1 > 0
# probabilities 0.5, 0.25, 0.15, 0.1 at tokens 1, 3, 0, 2
QUARTERS = _log([0.15, 0.5, 0.1, 0.25])
# 0.35 at token 1, three tokens tied at 0.2 (0, 2, 4), 0.05 at token 3
TIED_MIDDLE = _log([0.2, 0.35, 0.2, 0.05, 0.2])
# 0.4, 0.3, 0.2, 0.1 at tokens 1, 2, 3, 0
FALLING = _log([0.1, 0.4, 0.3, 0.2])
# temperature 1: 0.644, 0.237, 0.087, 0.032; 0.5: 0.867, ...; 4: 0.350, 0.272, 0.212, 0.165
STEPS = [2.0, 1.0, 0.0, -1.0]

CASES = [
    # top-k keeps every token tied with the k-th value
    Case("top-k 1", TIES, top_k=1, kept={0}),
    Case("top-k 2: all ties of the 2nd value", TIES, top_k=2, kept={0, 2, 3, 5}),
    Case("top-k 3: all ties of the 3rd value", TIES, top_k=3, kept={0, 2, 3, 5}),
    Case("top-k 4", TIES, top_k=4, kept={0, 2, 3, 5}),
    Case("top-k 5", TIES, top_k=5, kept={0, 1, 2, 3, 5}),
    Case("top-k 1, tied maximum", [5.0, 1.0, 5.0, 0.0], top_k=1, kept={0, 2}),
    Case("top-k = vocab", TIES, top_k=6, kept=set(range(6))),
    Case("top-k 0 disables it", TIES, top_k=0, kept=set(range(6))),
    Case("top-k -1 disables it", TIES, top_k=-1, kept=set(range(6))),
    Case("top-k > vocab disables it", TIES, top_k=7, kept=set(range(6))),
    Case("top-k >> vocab disables it", TIES, top_k=1000, kept=set(range(6))),
    Case("top-k is the same at any temperature", TIES, temperature=0.3, top_k=2,
         kept={0, 2, 3, 5}),
    # top-p: the smallest high-probability set whose mass reaches p
    Case("top-p 0.01: at least one token", QUARTERS, top_p=0.01, kept={1}),
    Case("top-p 0.3", QUARTERS, top_p=0.3, kept={1}),
    Case("top-p 0.45", QUARTERS, top_p=0.45, kept={1}),
    Case("top-p 0.55", QUARTERS, top_p=0.55, kept={1, 3}),
    Case("top-p 0.74", QUARTERS, top_p=0.74, kept={1, 3}),
    Case("top-p 0.76", QUARTERS, top_p=0.76, kept={1, 3, 0}),
    Case("top-p 0.88", QUARTERS, top_p=0.88, kept={1, 3, 0}),
    Case("top-p 0.95", QUARTERS, top_p=0.95, kept={0, 1, 2, 3}),
    Case("top-p 1 keeps all", QUARTERS, top_p=1.0, kept={0, 1, 2, 3}),
    # mass exactly p (exact in float32: 0.25 + 0.25): p is reached, the next is masked
    Case("top-p reached exactly", [0.0, 0.0, 0.0, 0.0], top_p=0.5, tied={0, 1, 2, 3},
         tied_count=2),
    # top-p boundary inside a tied group: how many of the group, not which
    Case("top-p 0.6 among 4 ties", [0.0, 0.0, 0.0, 0.0], top_p=0.6, tied={0, 1, 2, 3},
         tied_count=3),
    Case("top-p 0.3 above a tied group", TIED_MIDDLE, top_p=0.3, kept={1}),
    Case("top-p 0.5 in a tied group", TIED_MIDDLE, top_p=0.5, kept={1}, tied={0, 2, 4},
         tied_count=1),
    Case("top-p 0.7 in a tied group", TIED_MIDDLE, top_p=0.7, kept={1}, tied={0, 2, 4},
         tied_count=2),
    Case("top-p 0.9 past a tied group", TIED_MIDDLE, top_p=0.9, kept={0, 1, 2, 4}),
    Case("top-p 0.97", TIED_MIDDLE, top_p=0.97, kept={0, 1, 2, 3, 4}),
    # top-k first, then top-p on the renormalised survivors (top-p alone, or top-p
    # before top-k, would keep {1, 2} and {1, 2, 3})
    Case("top-k 2 then top-p 0.5", FALLING, top_k=2, top_p=0.5, kept={1}),
    Case("top-p 0.5 alone", FALLING, top_p=0.5, kept={1, 2}),
    Case("top-k 3 then top-p 0.75", FALLING, top_k=3, top_p=0.75, kept={1, 2}),
    Case("top-p 0.75 alone", FALLING, top_p=0.75, kept={1, 2, 3}),
    Case("top-k ties then top-p", [2.0, 2.0, 1.0, 1.0, 0.0], top_k=3, top_p=0.99,
         kept={0, 1, 2, 3}),
    Case("top-k 0 with top-p", FALLING, top_k=0, top_p=0.5, kept={1, 2}),
    # temperature scales the logits before top-p
    Case("temperature 1, top-p 0.7", STEPS, top_p=0.7, kept={0, 1}),
    Case("temperature 0.5, top-p 0.7", STEPS, temperature=0.5, top_p=0.7, kept={0}),
    Case("temperature 4, top-p 0.7", STEPS, temperature=4.0, top_p=0.7, kept={0, 1, 2}),
    Case("temperature 4, no filter", STEPS, temperature=4.0, kept={0, 1, 2, 3}),
    Case("temperature 0.25, top-k 3", STEPS, temperature=0.25, top_k=3, kept={0, 1, 2}),
]


def case_mismatch(impl: Implementation, case: Case) -> str | None:
    probs = run(impl, torch.tensor([case.logits]), case.temperature, case.top_k, case.top_p)
    return row_mismatch(probs[0], case.logits, case.temperature, case.expectation())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_python_oracle_agrees_with_the_hand_written_sets(case):
    got = expected_kept(case.logits, case.temperature, case.top_k, case.top_p)
    want = case.expectation()
    assert (got.sure, got.tied, got.tied_count) == (want.sure, want.tied, want.tied_count)
    assert got.margin > 1e-3 or case.name == "top-p reached exactly"


@pytest.mark.parametrize("name,impl", SUBJECTS, ids=[n for n, _ in SUBJECTS])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hand_written_cases(name, impl, case):
    assert case_mismatch(impl, case) is None, case_mismatch(impl, case)


@pytest.mark.parametrize("name,impl", SUBJECTS, ids=[n for n, _ in SUBJECTS])
def test_per_request_settings_in_one_batch(name, impl):
    """Every hand-written case as one row of a single batch (top-k and top-p tensors
    mixing active and disabled rows), and each row equal to the row computed alone."""
    vocab = max(len(c.logits) for c in CASES)
    # pad with a very low logit: a token that every filter here masks or that carries
    # no mass; padded rows are compared on their own vocabulary
    pad = -1000.0
    logits = torch.tensor([c.logits + [pad] * (vocab - len(c.logits)) for c in CASES])
    top_k = [c.top_k if c.top_k is not None else 0 for c in CASES]
    top_k = [k if k < len(c.logits) else vocab for k, c in zip(top_k, CASES)]
    top_p = [c.top_p if c.top_p is not None else 1.0 for c in CASES]
    probs = run(impl, logits, [c.temperature for c in CASES], top_k, top_p)
    for row, case in enumerate(CASES):
        real = len(case.logits)
        assert float(probs[row, real:].sum()) < 1e-20, case.name
        mismatch = row_mismatch(probs[row, :real], case.logits, case.temperature,
                                case.expectation())
        assert mismatch is None, (case.name, mismatch)
        alone = run(impl, logits[row:row + 1], case.temperature, top_k[row], top_p[row])
        torch.testing.assert_close(probs[row], alone[0], rtol=1e-6, atol=1e-9)


# ---- seeded random cases --------------------------------------------------------------
def _random_batch(seed: int, batch: int, vocab: int, ties: bool):
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: ties everywhere, also at top-k and top-p boundaries
        logits = torch.randint(-4, 4, (batch, vocab), generator=g).float() * 0.75
    else:  # distinct values at least 1e-3 apart
        logits = torch.stack([torch.randperm(vocab * 4, generator=g)[:vocab]
                              for _ in range(batch)]).float() * (6.0 / (vocab * 4))
        logits += torch.rand(batch, vocab, generator=g) * 1e-4
    temperature = (0.5 + 1.5 * torch.rand(batch, generator=g)).tolist()
    top_k = torch.randint(-1, vocab + 3, (batch,), generator=g).tolist()
    top_p = (0.05 + 0.95 * torch.rand(batch, generator=g)).tolist()
    for i in range(0, batch, 7):
        top_p[i] = 1.0
    return logits, temperature, top_k, top_p


@pytest.mark.parametrize("name,impl", SUBJECTS, ids=[n for n, _ in SUBJECTS])
@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
@pytest.mark.parametrize("filters", ["top-k", "top-p", "both"])
def test_random_rows_against_the_python_oracle(name, impl, ties, filters):
    vocab, batch = 24, 400
    logits, temperature, top_k, top_p = _random_batch(
        {"top-k": 1, "top-p": 2, "both": 3}[filters] + 10 * ties, batch, vocab, ties)
    use_k, use_p = filters in ("top-k", "both"), filters in ("top-p", "both")
    probs = run(impl, logits, temperature, top_k if use_k else None, top_p if use_p else None)
    checked = partial = 0
    for row in range(batch):
        values = logits[row].tolist()
        kept = expected_kept(values, temperature[row], top_k[row] if use_k else None,
                             top_p[row] if use_p else None)
        if kept.margin < 1e-4:  # float32 sums cannot settle a boundary this close
            continue
        mismatch = row_mismatch(probs[row], values, temperature[row], kept)
        assert mismatch is None, (row, mismatch)
        checked += 1
        partial += bool(kept.tied)
    assert checked > batch * 0.9
    if ties and use_p:
        assert partial > batch // 10  # the top-p boundary fell inside tied groups


@pytest.mark.parametrize("name,impl", IMPLEMENTATIONS, ids=[n for n, _ in IMPLEMENTATIONS])
@pytest.mark.parametrize("filters", ["none", "top-k", "top-p", "both"])
def test_equal_to_vllm_on_random_logits_without_ties(name, impl, filters):
    """A second reference: vLLM's own sampler processing, on random logits (no ties, so
    both are fully defined), per-row settings in one batch."""
    vocab, batch = 300, 256
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(batch, vocab, generator=g) * 3
    assert all(row.unique().numel() == vocab for row in logits)
    temperature = 0.3 + 2 * torch.rand(batch, generator=g)
    top_k = torch.randint(1, vocab + 1, (batch,), generator=g)
    top_k[::5] = vocab
    top_p = 0.05 + 0.95 * torch.rand(batch, generator=g)
    top_p[::6] = 1.0
    k = top_k if filters in ("top-k", "both") else None
    p = top_p if filters in ("top-p", "both") else None
    got = impl(logits.clone(), temperature, k, p)
    want = vllm_probs(logits, temperature, k, p)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


# ---- the oracle catches wrong implementations -----------------------------------------
def _top_k_without_ties(logits, temperature, top_k, top_p):
    logits = logits / temperature.unsqueeze(1)
    if top_k is not None:
        vocab = logits.shape[1]
        for row, k in enumerate(top_k.tolist()):
            if 0 < k < vocab:
                drop = torch.ones(vocab, dtype=torch.bool)
                drop[logits[row].topk(k).indices] = False
                logits[row, drop] = float("-inf")
    return sampling_probs(logits, torch.ones_like(temperature), None, top_p)


def _top_p_before_top_k(logits, temperature, top_k, top_p):
    masked = sampling_probs(logits, temperature, None, top_p).log()
    return sampling_probs(masked, torch.ones_like(temperature), top_k, None)


def _temperature_after_top_p(logits, temperature, top_k, top_p):
    keep = sampling_probs(logits, torch.ones_like(temperature), top_k, top_p) > 0
    return (logits / temperature.unsqueeze(1)).masked_fill(~keep, float("-inf")).softmax(1)


def _top_p_past_the_mass(logits, temperature, top_k, top_p):
    """Keeps tokens while the mass *including* them is below p, plus one: off by one
    where the mass reaches p exactly."""
    if top_p is None:
        return sampling_probs(logits, temperature, top_k, None)
    bumped = torch.nextafter(top_p, torch.ones_like(top_p))
    return sampling_probs(logits, temperature, top_k, bumped)


def _no_renormalisation_before_top_p(logits, temperature, top_k, top_p):
    """top-p measured on the full distribution, then intersected with top-k."""
    by_p = sampling_probs(logits, temperature, None, top_p) > 0
    by_k = sampling_probs(logits, temperature, top_k, None) > 0
    scaled = logits / temperature.unsqueeze(1)
    return scaled.masked_fill(~(by_p & by_k), float("-inf")).softmax(1)


BROKEN = [_top_k_without_ties, _top_p_before_top_k, _temperature_after_top_p,
          _top_p_past_the_mass, _no_renormalisation_before_top_p]


@pytest.mark.parametrize("broken", BROKEN, ids=[f.__name__.strip("_") for f in BROKEN])
def test_a_wrong_implementation_fails_the_hand_written_cases(broken):
    failed = [c.name for c in CASES if case_mismatch(broken, c) is not None]
    assert failed
