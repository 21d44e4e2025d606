"""Successor matrices per tenant or request: partitions of one table, assigned, reused
and evicted without ever letting one owner read another's."""

from __future__ import annotations

import pytest
import torch

from vllm_graft.core.isolation import NO_PARTITION, IsolationMode, MatrixPartitions, Unnamed
from vllm_graft.core.successor import EMPTY, SuccessorMatrix

VOCAB, K = 50, 4


def _seeded() -> SuccessorMatrix:
    matrix = SuccessorMatrix.empty(VOCAB, K, backend="reference")
    matrix.update_(torch.tensor([1, 2]), torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]]))
    return matrix


def _logits_for(next_token: int, rows: int) -> torch.Tensor:
    logits = torch.zeros(rows, VOCAB)
    logits[:, next_token] = 10.0
    return logits


@pytest.mark.parametrize("backend", ["reference", "compiled"])
def test_partitions_read_and_learn_separately(backend):
    matrix = SuccessorMatrix.empty(VOCAB, K, backend=backend)
    matrix.resize_partitions_(3)
    assert matrix.vocab_size == VOCAB and matrix.table.shape == (3 * VOCAB, K)
    tokens = torch.tensor([5, 5, 5, -1])
    matrix.update_from_logits_(tokens, _logits_for(11, 4),
                               partitions=torch.tensor([0, 2, NO_PARTITION, 1]))
    assert matrix.partition(0)[5, 0] == 11 and matrix.partition(2)[5, 0] == 11
    assert (matrix.partition(1) == EMPTY).all()  # a -1 token or partition writes nothing
    view = matrix.for_batch(torch.tensor([0, 1, 2, NO_PARTITION]))
    # [B=4, 2] flattened batch-major: request b reads its own partition
    parents = torch.tensor([[5, 5], [5, 5], [5, 5], [5, 5]]).reshape(-1)
    got = view.gather(parents, torch.zeros(8, dtype=torch.long)).view(4, 2)
    assert got.tolist() == [[11, 11], [EMPTY, EMPTY], [11, 11], [EMPTY, EMPTY]]
    assert matrix.for_batch(None) is matrix
    with pytest.raises(ValueError, match="do not split over a batch of 4"):
        view.gather(torch.tensor([5, 5, 5]), torch.zeros(3, dtype=torch.long))


def test_only_a_single_matrix_is_saved(tmp_path):
    matrix = SuccessorMatrix.empty(VOCAB, K)
    matrix.resize_partitions_(2)
    with pytest.raises(ValueError, match="single"):
        matrix.save(tmp_path / "m.bin")


def test_tenants_get_their_own_seeded_matrix():
    matrix = _seeded()
    iso = MatrixPartitions(IsolationMode.TENANT, matrix, max_matrices=4)
    assert matrix.partitions == 4  # allocated up front
    assert iso.assign("r1", "acme") == 0 and iso.assign("r2", "acme") == 0
    assert iso.assign("r3", "globex") == 1 and iso.assign("r4", None) == 2
    assert iso.assign("r1", "other") == 0  # fixed while the request runs
    for p in range(3):  # each starts as the seed
        assert torch.equal(matrix.partition(p), matrix.partition(0))
    matrix.update_from_logits_(torch.tensor([1]), _logits_for(42, 1),
                               partitions=iso.partitions(["r3"], "cpu"))
    assert matrix.partition(1)[1, 0] == 42 and matrix.partition(0)[1, 0] == 3


def test_least_recently_used_idle_tenant_is_evicted_and_reset():
    matrix = _seeded()
    iso = MatrixPartitions(IsolationMode.TENANT, matrix, max_matrices=2)
    assert iso.assign("a1", "a") == 0 and iso.assign("b1", "b") == 1
    matrix.partition(0)[9] = 33  # tenant a learned something
    assert iso.assign("c1", "c") == NO_PARTITION  # both held by running requests
    assert iso.refusals == 1
    iso.release("a1")
    assert iso.assign("c2", "c") == 0  # a was idle: evicted, its matrix reset
    assert (matrix.partition(0)[9] == EMPTY).all() and iso.evictions == 1
    assert iso.assign("a2", "a") == NO_PARTITION  # a comes back while both are busy
    iso.release("b1")
    iso.release("a2")
    assert iso.assign("a3", "a") == 1


def test_requests_naming_no_tenant_get_private_seeded_matrices():
    """The default: each request that names no tenant learns into its own copy of the
    seed, freed when it ends; the next owner of that partition gets the seed again."""
    matrix = _seeded()
    seed = matrix.partition(0).clone()
    iso = MatrixPartitions(IsolationMode.TENANT, matrix, max_matrices=3)
    assert iso.assign("u1") == 0 and iso.assign("u2") == 1 and iso.assign("a1", "acme") == 2
    matrix.update_from_logits_(torch.tensor([1, 9]), _logits_for(42, 2),
                               partitions=iso.partitions(["u1", "u1"], "cpu"))
    assert matrix.partition(0)[1, 0] == 42 and matrix.partition(1)[1, 0] == 3
    assert iso.assign("u3") == NO_PARTITION  # every matrix held: no one else's matrix
    iso.release("u1")  # its private matrix dies with it
    assert iso.assign("u3") == 0 and torch.equal(matrix.partition(0), seed)
    iso.release("a1")  # a tenant's matrix outlives its requests
    assert iso.assign("a2", "acme") == 2
    iso.release("u2")
    iso.release("a2")
    matrix.partition(2)[9] = 33  # acme learned something; idle now
    assert iso.assign("t1", "tenant-2") == 1  # a free partition first
    assert iso.assign("u4") == 2 and iso.evictions == 1  # then the idle tenant's, reset
    assert torch.equal(matrix.partition(2), seed)


def test_requests_naming_no_tenant_may_share_one_matrix():
    matrix = _seeded()
    iso = MatrixPartitions(IsolationMode.TENANT, matrix, max_matrices=3)
    assert iso.assign("u1", None, Unnamed.SHARED) == 0
    assert iso.assign("u2", None, "shared") == 0
    matrix.partition(0)[9] = 33
    iso.release("u1")
    iso.release("u2")
    assert iso.assign("u3", None, "shared") == 0 and (matrix.partition(0)[9] == 33).all()
    assert iso.assign("p1") == 1  # a private one beside it
    assert iso.assign("t1", "") == 2  # an empty name is a tenant too, not the unnamed


def test_a_reused_partition_never_shows_its_last_owners_rows():
    """Whatever sequence of owners takes a partition (tenants, private requests), each
    new owner starts from the seed."""
    matrix = _seeded()
    seed = matrix.partition(0).clone()
    iso = MatrixPartitions(IsolationMode.TENANT, matrix, max_matrices=2)
    generator = torch.Generator().manual_seed(0)
    fresh_owners = 0
    for step in range(60):
        pick = int(torch.randint(0, 5, (1,), generator=generator))
        req, tenant = f"r{step}", None if pick == 4 else f"t{pick}"
        owners_before = set(iso.owner_of)
        partition = iso.assign(req, tenant)
        assert partition != NO_PARTITION  # one request at a time: never all held
        if iso._owner(req, tenant, "private") not in owners_before:
            fresh_owners += 1
            assert torch.equal(matrix.partition(partition), seed), step
        matrix.partition(partition)[10 + step % 5] = step  # the owner teaches
        iso.release(req)
    assert iso.evictions > 5 and fresh_owners > 20


def test_request_mode_frees_a_private_matrix_when_the_request_ends():
    matrix = _seeded()
    iso = MatrixPartitions(IsolationMode.REQUEST, matrix, max_matrices=2)
    assert iso.assign("r1", "t") == 0 and iso.assign("r2", "t") == 1
    matrix.partition(1)[9] = 33
    assert iso.assign("r3") == NO_PARTITION
    iso.release("r2")
    assert iso.assign("r3") == 1 and (matrix.partition(1)[9] == EMPTY).all()
    assert set(iso.partition_of) == {"r1", "r3"}  # r3 got none at first, asked again
    assert iso.partitions(["r3", "r1"], "cpu").tolist() == [1, 0]


def test_global_mode_shares_partition_zero():
    matrix = _seeded()
    iso = MatrixPartitions(IsolationMode.GLOBAL, matrix, max_matrices=8)
    assert {iso.assign(f"r{i}", f"t{i}") for i in range(5)} == {0}
    assert iso.partitions(["r0", "r1"], "cpu") is None and matrix.partitions == 1


def test_tree_builder_retrieves_from_each_requests_partition():
    from vllm_graft.core.config import GraftConfig
    from vllm_graft.core.graft import GraftTreeBuilder

    config = GraftConfig.from_dict({"variant": "retrieval_only", "budget": 8,
                                    "retrieval_width": 4, "successor_k": 4})
    matrix = SuccessorMatrix.empty(VOCAB, K, backend="reference")
    matrix.resize_partitions_(2)
    matrix.partition(1)[7] = torch.tensor([20, 21, 22, 23], dtype=torch.int32)
    builder = GraftTreeBuilder(config, matrix)
    roots = torch.tensor([7, 7])
    tree, stats = builder.build(roots, partitions=torch.tensor([0, 1]))
    assert int(tree.num_nodes[0]) == 1  # partition 0 knows nothing after 7
    assert set(tree.tokens[1, 1:5].tolist()) == {20, 21, 22, 23}
    assert stats.retrieval_hits.tolist()[0] == 0


@pytest.mark.parametrize("isolation, message", [
    ({"tenant_source": "usr"}, "graft.isolation.tenant_source: must be one of 'user'"),
    ({"tenant_source": "header:"}, "graft.isolation.tenant_source: .*header name"),
    ({"tenant_source": "header:X Tenant"}, "graft.isolation.tenant_source"),
    ({"tenant_source": "user:x"}, "graft.isolation.tenant_source"),
    ({"tenant_source": "header:" + "x" * 65}, "graft.isolation.tenant_source"),
    ({"unnamed": "public"}, "graft.isolation.unnamed"),
    ({"max_matrices": 0}, "graft.isolation.max_matrices"),
])
def test_isolation_errors_name_the_key(isolation, message):
    from vllm_graft.core.config import GraftConfig, GraftConfigError

    with pytest.raises(GraftConfigError, match=message):
        GraftConfig.from_dict({"isolation": isolation})


def test_isolation_defaults_and_sources():
    from vllm_graft.core.config import GraftConfig

    default = GraftConfig.from_dict({}).isolation
    assert (default.mode, default.tenant_source, default.unnamed) == ("tenant", "user",
                                                                      "private")
    for source in ("user", "cache_salt", "extra", "header:X-Graft-Tenant", "header:x"):
        assert GraftConfig.from_dict({"isolation": {"tenant_source": source}}
                                     ).isolation.tenant_source == source


def test_the_default_count_of_matrices_holds_every_running_request_within_a_gib():
    """Unset, ``max_matrices`` gives every running request a private matrix beside 16
    tenants, but takes no more than 1 GiB on a rank (allocated before vLLM sizes its KV
    cache) and keeps at least 17 matrices."""
    from vllm_graft.core.isolation import default_max_matrices

    qwen = 151_936 * 8 * 4  # a matrix at Qwen's vocabulary: 4.9 MB
    assert default_max_matrices(8, qwen) == 24
    assert default_max_matrices(1024, qwen) == 220  # not 1,040 (5 GB)
    assert default_max_matrices(1024, qwen) * qwen <= 1 << 30
    assert default_max_matrices(256, 49_152 * 8 * 4) == 272  # SmolLM2's: all fit
    assert default_max_matrices(1024, 1 << 29) == 17  # huge matrices: 17 whatever they take
