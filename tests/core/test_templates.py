import pytest
import torch

from vllm_graft.core.config import DEFAULT_RANK_PRIOR
from vllm_graft.core.successor import SuccessorMatrix
from vllm_graft.core.templates import RetrievalTemplate, TemplateExpander
from vllm_graft.testing.op_counter import OpCounter


def _template(size, depth=8, width=8):
    return RetrievalTemplate.best_first(size, DEFAULT_RANK_PRIOR, max_depth=depth, max_width=width)


@pytest.mark.parametrize("size", [1, 20, 36, 52, 60, 200])
def test_best_first_shape(size):
    t = _template(size)
    assert len(t) == size
    assert all(p < j for j, p in enumerate(t.parents))  # parents first
    assert t.depth <= 8 and t.width <= 8 and max(t.ranks) < 8


def test_default_templates_are_asymmetric_and_about_8_by_8():
    t = _template(52)
    assert t.depth == 8 and t.width >= 7
    # the rank-0 child of the root heads the deepest and widest subtree
    def subtree(root):
        out = {root}
        for j, p in enumerate(t.parents):
            if p in out:
                out.add(j)
        return out
    top_children = [j for j, p in enumerate(t.parents) if p == -1]
    sizes = [len(subtree(j)) for j in top_children]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 3 * sizes[-1]


def test_smaller_budgets_are_prefixes():
    big = _template(80)
    for n in (20, 36, 52):
        assert _template(n) == big.prefix(n)


@pytest.mark.parametrize("parents, ranks, msg", [
    ((0,), (0,), "precede"),
    ((-1, -1), (1, 1), "appears twice"),
    ((-1,), (-2,), "negative rank"),
])
def test_malformed_templates(parents, ranks, msg):
    with pytest.raises(ValueError, match=msg):
        RetrievalTemplate(parents, ranks)


def _python_expand(table, template, root, keep):
    tokens = []
    for j, (p, r) in enumerate(zip(template.parents, template.ranks)):
        parent_token = root if p < 0 else tokens[p]
        tok = -1 if parent_token < 0 or j >= keep else int(table[parent_token, r])
        tokens.append(tok)
    return tokens


@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_expansion_matches_a_sequential_walk(backend):
    torch.manual_seed(0)
    vocab, k = 300, 8
    m = SuccessorMatrix.empty(vocab, k, backend=backend)
    rows = torch.randperm(vocab)[:200]  # a third of the rows stay empty
    m.update_(rows, torch.randint(0, vocab, (200, k)))
    t = _template(60)
    expander = TemplateExpander(t)
    roots = torch.randint(0, vocab, (16,))
    keep = torch.randint(0, 61, (16,))
    out = expander.expand(m, roots, keep)
    for b in range(16):
        assert out.tokens[b].tolist() == _python_expand(m.table, t, int(roots[b]), int(keep[b]))
    assert out.parents[0].tolist() == list(t.parents)
    assert out.depths[0].tolist() == list(t.depths)


def test_expansion_launches_three_ops_per_level_whatever_the_batch():
    """On a GPU the expansion is bound by kernel launches: one indexing, one gather and
    one write per level, a few ops around them, and none more for a larger batch (the
    ranks are views of a repetition kept for the largest batch; a batch that outgrows
    it pays one repeat per level once). Before this rule the default template's eight
    levels took 76 ops."""
    vocab = 300
    m = SuccessorMatrix.empty(vocab, 8)
    m.update_(torch.arange(vocab), torch.randint(0, vocab, (vocab, 8)))
    expander = TemplateExpander(_template(60))
    levels = len(expander.levels)
    expander.expand(m, torch.arange(32), torch.full((32,), 40))  # the largest batch
    for batch in (1, 8, 32):
        roots, keep, counter = torch.arange(batch), torch.full((batch,), 40), OpCounter()
        with counter:
            expander.expand(m, roots, keep)
        assert counter.ops <= 3 * levels + 5, (batch, counter.ops, levels)
