import pytest
import torch

from tests.core.stats import chi_square_pvalue
from vllm_graft.core.acceptance import SamplingBatch, accept_tree, sampling_probs
from vllm_graft.core.hybrid import SOURCE_DRAFT, SOURCE_RETRIEVED, merge_and_flatten

VOCAB = 6
SAMPLES = 120_000  # a 1 % shift of probability mass gives chi-square p < 1e-10 at this size


def _fixed_tree(batch):
    """root 0 -> {2 (draft), 3 (draft + retrieved: merged), 5 (retrieved)};
    2 -> {1, 4}; 3 -> {2}; 1 -> {0}. Rows: 0 root, 1:'2', 2:'3', 3:'1', 4:'4', 5:'2'', 6:'0', 7:'5'."""
    draft_tokens = torch.tensor([2, 3, 1, 4, 2, 0])
    draft_parents = torch.tensor([-1, -1, 0, 0, 1, 2])
    draft_depths = torch.tensor([1, 1, 2, 2, 2, 3])
    retrieved_tokens = torch.tensor([3, 5])
    retrieved_parents = torch.tensor([-1, -1])
    retrieved_depths = torch.tensor([1, 1])
    rep = lambda t: t.unsqueeze(0).expand(batch, -1)
    return merge_and_flatten(
        torch.zeros(batch, dtype=torch.long),
        [(rep(draft_tokens), rep(draft_parents), rep(draft_depths), SOURCE_DRAFT),
         (rep(retrieved_tokens), rep(retrieved_parents), rep(retrieved_depths), SOURCE_RETRIEVED)],
        budget=9)


def _row_logits(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 1.5


def _emitted_given_prefix(result, prefix):
    out = result.output_tokens
    mask = torch.ones(out.shape[0], dtype=torch.bool)
    for i, tok in enumerate(prefix):
        mask &= out[:, i] == tok
    nxt = out[mask, len(prefix)]
    return torch.bincount(nxt[nxt >= 0], minlength=VOCAB), int(mask.sum())


SETTINGS = {
    "t=1": dict(temperature=1.0),
    "t=0.7,top_k=3": dict(temperature=0.7, top_k=3),
    "t=1.3,top_p=0.8": dict(temperature=1.3, top_p=0.8),
    "t=0.9,top_k=4,top_p=0.9": dict(temperature=0.9, top_k=4, top_p=0.9),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_sampling_is_lossless_on_a_hybrid_tree(setting):
    s = SETTINGS[setting]
    tree = _fixed_tree(SAMPLES)
    rows = tree.tokens.shape[1]
    row_logits = _row_logits(rows, seed=len(setting))
    logits = row_logits.unsqueeze(0).expand(SAMPLES, -1, -1)
    params = SamplingBatch(
        temperature=torch.full((SAMPLES,), s["temperature"]),
        top_k=torch.full((SAMPLES,), s["top_k"]) if "top_k" in s else None,
        top_p=torch.full((SAMPLES,), s["top_p"]) if "top_p" in s else None)
    torch.manual_seed(1234)
    result = accept_tree(tree, logits, params)
    one = lambda v: torch.full((rows,), v)
    target = sampling_probs(row_logits, one(s["temperature"]),
                            one(s["top_k"]) if "top_k" in s else None,
                            one(s["top_p"]) if "top_p" in s else None)
    tokens = tree.tokens[0].tolist()
    row_of = {(): 0, (2,): tokens.index(2), (3,): 2, (5,): tokens.index(5),
              (2, 1): tokens.index(1), (3, 2): 5}
    # the emitted token at every node on the path must follow that node's distribution,
    # and every path prefix must occur as often as the product of those distributions says
    for prefix, row in row_of.items():
        counts, n = _emitted_given_prefix(result, prefix)
        expected = SAMPLES * float(torch.tensor(
            [target[row_of[prefix[:i]], tok] for i, tok in enumerate(prefix)]).prod())
        assert abs(n - expected) < 6 * (expected + 1) ** 0.5, (prefix, n, expected)
        if n >= 2000:
            p = chi_square_pvalue(counts, target[row])
            assert p > 1e-5, (prefix, counts.tolist(), (target[row] * n).tolist())
    # a token that is no child ends the walk
    non_child = [t for t in range(VOCAB) if t not in (2, 3, 5)]
    stop = torch.isin(result.output_tokens[:, 0], torch.tensor(non_child))
    assert (result.output_tokens[stop, 1] == -1).all() and (result.num_accepted[stop] == 0).all()


def test_the_statistical_test_catches_a_one_percent_error():
    probs = torch.tensor([0.30, 0.20, 0.25, 0.15, 0.10])
    torch.manual_seed(0)
    good = torch.bincount(torch.multinomial(probs, SAMPLES, replacement=True), minlength=5)
    assert chi_square_pvalue(good, probs) > 1e-4
    shifted = probs + torch.tensor([0.01, -0.01, 0, 0, 0])
    bad = torch.bincount(torch.multinomial(shifted, SAMPLES, replacement=True), minlength=5)
    assert chi_square_pvalue(bad, probs) < 1e-6
    # the bias a wrong speculative rule gives (draft over-represented, p + (1-p) p)
    biased = probs.clone()
    biased[1] = probs[1] + (1 - probs[1]) * probs[1]
    biased[[0, 2, 3, 4]] *= (1 - biased[1]) / biased[[0, 2, 3, 4]].sum()
    wrong = torch.bincount(torch.multinomial(biased, SAMPLES, replacement=True), minlength=5)
    assert chi_square_pvalue(wrong, probs) < 1e-6


def test_a_wrong_acceptance_rule_is_detected(monkeypatch):
    """Negative control: accepting a child with probability r(x) (no renormalisation over
    the remaining mass) is a classic bug; the losslessness check must flag it."""
    import vllm_graft.core.acceptance as acc

    original = acc._sample_level

    def broken(probs, children, child_tokens, rows, params):
        chosen, sample = original(probs, children, child_tokens, rows, params)
        r = probs.double().gather(1, child_tokens) * children
        u = torch.rand_like(r)
        accepted = (u < r) & children  # wrong: should be r / remaining mass
        chosen = torch.where(accepted.any(1), accepted.to(torch.uint8).argmax(1), -1)
        return chosen, sample

    monkeypatch.setattr(acc, "_sample_level", broken)
    tree = _fixed_tree(SAMPLES)
    row_logits = _row_logits(tree.tokens.shape[1])
    result = accept_tree(tree, row_logits.unsqueeze(0).expand(SAMPLES, -1, -1),
                         SamplingBatch(temperature=torch.ones(SAMPLES)))
    target = row_logits[0].softmax(0)
    counts, _ = _emitted_given_prefix(result, ())
    assert chi_square_pvalue(counts, target) < 1e-6


def _python_greedy_walk(tree, logits, b):
    row, out, accepted = 0, [], []
    while True:
        t = int(logits[b, row].argmax())
        out.append(t)
        nxt = [i for i in range(tree.tokens.shape[1])
               if tree.valid[b, i] and int(tree.parents[b, i]) == row and int(tree.tokens[b, i]) == t]
        if not nxt:
            return accepted, out
        row = nxt[0]
        accepted.append(row)


@pytest.mark.parametrize("seed", range(5))
def test_greedy_equals_the_argmax_walk(seed):
    from tests.core.helpers import TableDrafter
    from vllm_graft.core.config import GraftConfig
    from vllm_graft.core.graft import GraftTreeBuilder
    from vllm_graft.core.successor import SuccessorMatrix

    vocab, batch = 30, 8
    torch.manual_seed(seed)
    m = SuccessorMatrix.empty(vocab, 8)
    m.update_(torch.arange(vocab), torch.stack([torch.randperm(vocab)[:8] for _ in range(vocab)]))
    builder = GraftTreeBuilder(GraftConfig(budget=20, top_k=4, max_depth=4, checkpoints=(0, 1),
                                           draft_keep=(3, 8)), m)
    tree, _ = builder.build(torch.randint(0, vocab, (batch,)), TableDrafter(vocab, 4, seed=seed))
    # logits that follow a random child with probability 0.7 so paths get long
    logits = torch.randn(batch, tree.tokens.shape[1], vocab)
    for b in range(batch):
        for r in range(tree.tokens.shape[1]):
            kids = [i for i in range(tree.tokens.shape[1])
                    if tree.valid[b, i] and int(tree.parents[b, i]) == r]
            if kids and torch.rand(()) < 0.7:
                logits[b, r, int(tree.tokens[b, kids[torch.randint(len(kids), ())]])] += 10
    result = accept_tree(tree, logits, SamplingBatch.greedy(batch))
    lengths = []
    for b in range(batch):
        accepted, out = _python_greedy_walk(tree, logits, b)
        lengths.append(len(accepted))
        assert result.num_accepted[b] == len(accepted)
        assert result.accepted_rows[b, :len(accepted)].tolist() == accepted
        assert result.output_tokens[b, :len(out)].tolist() == out
        assert (result.output_tokens[b, len(out):] == -1).all()
    assert max(lengths) >= 2  # the test exercised multi-token acceptance


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_one_pass_greedy_walk_equals_the_level_by_level_walk(seed, backend):
    """The batched greedy walk over one top-k pass (what verification runs) emits what
    the level-by-level walk with an argmax at every level emits, ties included: the
    logits take few distinct values, so most argmaxes are decided by the lower id."""
    from tests.core.helpers import TableDrafter
    from vllm_graft.core.config import GraftConfig
    from vllm_graft.core.graft import GraftTreeBuilder
    from vllm_graft.core.successor import SuccessorMatrix

    vocab, batch = 12, 16
    torch.manual_seed(100 + seed)
    m = SuccessorMatrix.empty(vocab, 4, backend=backend)
    m.update_(torch.arange(vocab), torch.stack([torch.randperm(vocab)[:4] for _ in range(vocab)]))
    builder = GraftTreeBuilder(GraftConfig(budget=24, top_k=4, max_depth=5, checkpoints=(0, 1),
                                           draft_keep=(3, 8), retrieval_width=4), m)
    tree, _ = builder.build(torch.randint(0, vocab, (batch,)), TableDrafter(vocab, 4, seed=seed))
    # logits in {0, 1}; at most rows one child's token is lifted to 2, and often a
    # second random token too, so the argmax there is a tie the lower id decides
    logits = torch.randint(0, 2, (batch, tree.tokens.shape[1], vocab)).float()
    for b in range(batch):
        for r in range(tree.tokens.shape[1]):
            kids = [int(tree.tokens[b, i]) for i in range(tree.tokens.shape[1])
                    if tree.valid[b, i] and int(tree.parents[b, i]) == r]
            if kids and torch.rand(()) < 0.8:
                logits[b, r, kids[torch.randint(len(kids), ())]] = 2.0
                if torch.rand(()) < 0.5:
                    logits[b, r, torch.randint(vocab, ())] = 2.0
    level_by_level = accept_tree(tree, logits, SamplingBatch.greedy(batch),
                                 argmax_fn=lambda rows: rows.argmax(dim=1))
    row_topk = builder.target_topk(tree, logits)
    one_pass = accept_tree(tree, logits, SamplingBatch.greedy(batch),
                           row_tokens=row_topk[..., 0])
    for field in ("accepted_rows", "output_tokens", "num_accepted"):
        assert torch.equal(getattr(one_pass, field), getattr(level_by_level, field)), field
    assert int(one_pass.num_accepted.max()) >= 2
    # the same pass teaches the matrix exactly what a separate top-k would
    separate = SuccessorMatrix(m.table.clone(), backend=backend)
    builder.observe(tree, logits, row_topk=row_topk)
    GraftTreeBuilder(builder.config, separate).observe(tree, logits)
    assert torch.equal(m.table, separate.table)


def test_mixed_greedy_and_sampled_batch_and_seeded_generators():
    tree = _fixed_tree(4)
    logits = _row_logits(tree.tokens.shape[1]).unsqueeze(0).expand(4, -1, -1)
    temps = torch.tensor([0.0, 1.0, 1.0, 0.0])

    def run(seed_a, seed_b, companion_temp):
        gens = {1: torch.Generator().manual_seed(seed_a), 2: torch.Generator().manual_seed(seed_b)}
        t = temps.clone()
        t[3] = companion_temp
        return accept_tree(tree, logits, SamplingBatch(temperature=t, generators=gens))

    a, b = run(7, 8, 0.0), run(7, 8, 1.0)
    assert torch.equal(a.output_tokens[1:3], b.output_tokens[1:3])  # independent of companions
    greedy = accept_tree(_fixed_tree(1), logits[:1], SamplingBatch.greedy(1))
    assert torch.equal(a.output_tokens[0], greedy.output_tokens[0])
    outs = {tuple(run(s, s + 1, 0.0).output_tokens[1].tolist()) for s in range(40)}
    assert len(outs) > 1  # different seeds give different samples


def test_shape_mismatch_is_refused():
    tree = _fixed_tree(2)
    with pytest.raises(ValueError, match="tree has shape"):
        accept_tree(tree, torch.zeros(2, 3, VOCAB), SamplingBatch.greedy(2))


@pytest.mark.parametrize("seed", range(3))
def test_greedy_chain_walk_equals_the_tree_walk_on_chains(seed):
    """Chains (copy chains, Graft-TAIL, bare roots) are accepted with a running
    product over their rows; it must give exactly what the general walk gives."""
    from vllm_graft.core.acceptance import (greedy_chain_walk, greedy_chain_walk_lists,
                                            greedy_walk)
    from tests.core.helpers import copied_to_tensor
    from vllm_graft.core.chain import build_chains
    from vllm_graft.core.successor import SuccessorMatrix

    vocab, batch, length = 10, 64, 7
    g = torch.Generator().manual_seed(seed)
    table = torch.stack([torch.randperm(vocab, generator=g)[:2] for _ in range(vocab)])
    table[torch.randint(vocab, (3,), generator=g), 0] = -1  # misses end some walks
    matrix = SuccessorMatrix(table.to(torch.int32).contiguous())
    copied = [torch.randint(vocab, (int(torch.randint(0, 5, (), generator=g)),),
                            generator=g).tolist() for _ in range(batch)]
    copied[0] = []  # a chain that is a bare root
    chains = build_chains(torch.randint(vocab, (batch,), generator=g),
                          copied_to_tensor(copied, length), matrix, length, max_walk=2)
    chains.tokens[0, 1:], chains.valid[0, 1:] = -1, False
    # the target follows the chain with probability 0.75 at each row, else a random token
    follow = torch.rand(batch, length + 1, generator=g) < 0.75
    next_in_chain = torch.cat([chains.tokens[:, 1:], torch.full((batch, 1), -1)], dim=1)
    row_tokens = torch.where(follow & (next_in_chain >= 0), next_in_chain,
                             torch.randint(vocab, (batch, length + 1), generator=g))
    want = greedy_walk(chains, row_tokens)
    got = greedy_chain_walk(chains, row_tokens)
    for field in ("accepted_rows", "output_tokens", "num_accepted"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    # the host walk of a copy-chain step: each request's rows one after another
    lengths = chains.num_nodes.tolist()
    drafts = [chains.tokens[b, 1:n].tolist() for b, n in enumerate(lengths)]
    flat_rows = [t for b, n in enumerate(lengths) for t in row_tokens[b, :n].tolist()]
    assert greedy_chain_walk_lists(drafts, flat_rows) == want.num_accepted.tolist()
    accepted = want.num_accepted.tolist()
    assert accepted[0] == 0 and max(accepted) >= 3 and min(accepted[1:]) == 0
