import pytest

from vllm_graft.core.config import (DEFAULT_THRESHOLDS, GraftConfig, GraftConfigError, Variant,
                                    num_draft_candidates)


def test_defaults_follow_the_paper():
    cfg = GraftConfig()
    assert cfg.variant is Variant.GRAFT
    assert (cfg.budget, cfg.top_k, cfg.max_depth, cfg.successor_k) == (60, 10, 7, 8)
    assert cfg.checkpoints == (0, 1, 5) and cfg.draft_keep == (8, 24, 40)
    assert cfg.effective_thresholds() == DEFAULT_THRESHOLDS


def test_threshold_precedence():
    cfg = GraftConfig(thresholds=(0.5, 0.4, 0.3))
    assert cfg.effective_thresholds(calibrated=(0.1, 0.1, 0.1)) == (0.5, 0.4, 0.3)
    assert GraftConfig().effective_thresholds(calibrated=(0.1, 0.2, 0.3)) == (0.1, 0.2, 0.3)


def test_candidate_counts():
    assert num_draft_candidates(10, 0) == 0
    assert num_draft_candidates(10, 1) == 10
    assert num_draft_candidates(10, 2) == 110
    assert GraftConfig().draft_candidates == 610


@pytest.mark.parametrize("data, key", [
    ({"budget": 0}, "graft.budget"),
    ({"variant": "beam"}, "graft.variant"),
    ({"bogus": 1}, "graft.bogus: unknown key"),
    ({"checkpoints": [1, 0], "draft_keep": [8, 24]}, "strictly increasing"),
    ({"checkpoints": [0, 1, 9], "draft_keep": [8, 24, 40]}, "max_depth"),
    ({"checkpoints": [0, 2]}, "draft_keep is required"),
    ({"draft_keep": [8, 24]}, "draft_keep needs one entry per checkpoint"),
    ({"draft_keep": [11, 24, 40]}, "draft_keep 11 at checkpoint 0"),
    ({"thresholds": [0.3, 0.2]}, "thresholds needs one entry"),
    ({"thresholds": [1.5, 0.2, 0.1]}, "thresholds must lie in"),
    ({"retrieval_width": 9}, "cannot exceed successor_k"),
    ({"rank_prior": [0.5, 1.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]}, "rank_prior entries"),
    ({"top_k": "ten"}, "graft.top_k"),
    ({"ops_backend": "gpu"}, "graft.ops_backend"),
    ({"heap_trim_s": -1}, "graft.heap_trim_s"),
])
def test_bad_values_name_the_key(data, key):
    with pytest.raises(GraftConfigError, match=key.replace(".", r"\.")):
        GraftConfig.from_dict(data)


def test_config_is_frozen():
    cfg = GraftConfig()
    with pytest.raises(Exception):
        cfg.budget = 8


@pytest.mark.parametrize("budget, keep", [(60, (8, 24, 40)), (8, (1, 3, 5)), (20, (3, 8, 13))])
def test_default_draft_keep_scales_with_the_budget(budget, keep):
    assert GraftConfig(budget=budget).draft_keep == keep


def test_wider_templates_get_a_widened_default_prior():
    cfg = GraftConfig(retrieval_width=16, successor_k=16)
    assert len(cfg.rank_prior) == 16
    assert cfg.rank_prior[:8] == GraftConfig().rank_prior
    assert all(a > b > 0 for a, b in zip(cfg.rank_prior, cfg.rank_prior[1:]))
    with pytest.raises(ValueError, match="rank_prior needs at least"):
        GraftConfig(retrieval_width=16, successor_k=16, rank_prior=[0.5] * 8)


def test_context_copies_default_by_variant_and_survive_a_round_trip():
    """On for the product variant, off for the ablations unless named; the adapter
    ships the config to workers as a dump, which must not change that."""
    from vllm_graft.core.config import GraftConfig

    cases = [({}, True), ({"variant": "prune_only"}, False), ({"context": False}, False),
             ({"variant": "retrieval_only", "context": True}, True),
             ({"variant": "dense_tree", "context": {"max_nodes": 4}}, True)]
    for data, expected in cases:
        config = GraftConfig.from_dict(data)
        shipped = GraftConfig.from_dict(config.model_dump(mode="json", exclude_none=True))
        assert config.uses_context is shipped.uses_context is expected, data
    assert GraftConfig.from_dict({"context": {"max_nodes": 4}}).context_settings.max_nodes == 4
    with pytest.raises(GraftConfigError, match="graft.context.max_ngram"):
        GraftConfig.from_dict({"context": {"max_ngram": 0}})


def test_guard_modes_need_the_guard_and_survive_a_round_trip():
    from vllm_graft.core.config import StepMode

    config = GraftConfig.from_dict({})  # budget "auto" is the default
    assert config.auto_size and config.auto_guard and config.budget == 60
    assert not GraftConfig.from_dict({"budget": 60}).auto_size  # a number is fixed
    assert not GraftConfig.from_dict({"auto_size": False}).auto_size
    assert config.guard_modes == (StepMode.TREE, StepMode.CHAIN, StepMode.PLAIN)
    chains = GraftConfig.from_dict({"budget": "auto", "guard_modes": ["chain"],
                                    "chain_tokens": 6})
    assert chains.guard_modes == (StepMode.CHAIN,)
    assert GraftConfig.from_dict({"budget": "auto", "chain_scout_every": 0}).chain_scout_every == 0
    again = GraftConfig.from_dict(chains.model_dump(mode="json"))
    assert again == chains
    # a dumped config (every key set) reads back the same, fixed or auto
    for dumped in (GraftConfig(), GraftConfig(budget=60)):
        assert GraftConfig.from_dict(dumped.model_dump(mode="json")) == dumped
    for data, message in [
            ({"budget": 60, "guard_modes": ["chain"]}, "budget \"auto\""),
            ({"budget": "auto", "auto_guard": False, "chain_walk": 1}, "chain_walk"),
            ({"budget": "auto", "guard_modes": []}, "graft.guard_modes"),
            ({"budget": "auto", "guard_modes": ["tree", "tree"]}, "at most once"),
            ({"budget": "auto", "guard_modes": ["fast"]}, "graft.guard_modes.0"),
            ({"budget": "auto", "chain_tokens": 0}, "graft.chain_tokens"),
            ({"budget": 60, "chain_scout_every": 4}, "chain_scout_every"),
            ({"budget": "auto", "chain_scout_every": -1}, "graft.chain_scout_every")]:
        with pytest.raises(GraftConfigError, match=message):
            GraftConfig.from_dict(data)


def test_the_guard_section_tunes_the_throughput_guard_and_names_a_bad_key():
    """graft.guard holds the throughput guard's tuning: its defaults are the guard's,
    a bad value is refused naming its key, and it needs the guard running."""
    from vllm_graft.core.budget import ThroughputGuard

    config = GraftConfig.from_dict({"guard": {"window": 50, "probe_share": None}})
    assert config.guard.window == 50.0 and config.guard.probe_share is None
    defaults = GraftConfig().guard.model_dump()
    assert defaults == {name: getattr(ThroughputGuard(), name) for name in defaults}
    assert len(defaults) == 11
    assert GraftConfig.from_dict(config.model_dump(mode="json")) == config
    for data, message in [
            ({"guard": {"window": 0.5}}, "graft.guard.window"),
            ({"guard": {"probe_share": 0}}, "graft.guard.probe_share"),
            ({"guard": {"outlier_steps": 1}}, "graft.guard.outlier_steps"),
            ({"guard": {"batch_charge": -1}}, "graft.guard.batch_charge"),
            ({"guard": {"text_steps": 0.5}}, "graft.guard.text_steps"),
            ({"guard": {"confidence": "high"}}, "graft.guard.confidence"),
            ({"guard": {"windows": 50}}, "graft.guard.windows: unknown key"),
            ({"budget": 60, "guard": {"window": 50}}, "guard configure the throughput"),
            ({"auto_guard": False, "guard": {"window": 50}}, "auto_guard on")]:
        with pytest.raises(GraftConfigError, match=message):
            GraftConfig.from_dict(data)
