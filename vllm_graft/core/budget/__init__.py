"""Cost-aware tree size: how many of a step's candidate nodes are worth verifying, and
which kind of step to run.

A verification forward costs more as the batch's query tokens grow, and a node is only
worth its tokens if it is likely to be accepted. One module per part, all on the host:

* :mod:`.cost`: step time from the batch size and its query tokens (:class:`CostModel`,
  :class:`StepCosts`), refreshed online from measured steps.
* :mod:`.acceptance_model`: P(node accepted | parent accepted) per source class, depth
  and score bucket (:class:`AcceptanceModel`), and the calibration tally that seeds it.
* :mod:`.choice`: the nodes that maximise expected emitted tokens per ms for the whole
  batch (:func:`choose_nodes`).
* :mod:`.guard`: each step in the mode measured fastest (:class:`ThroughputGuard`).
* :mod:`.scout`: a chain step when the batch's copy chains promise to beat plain
  decoding (:class:`ChainScout`).
* :mod:`.sizer`: the per-step facade over these (:class:`TreeSizer`), and
  :func:`build_budget_systems`, which assembles sizer, guard and scout from the config.

Why each works as it does (measured episodes, tuning reasons): docs/design-log.md.
"""

from vllm_graft.core.budget.acceptance_model import (CALIBRATION_EVIDENCE_TRIALS,
                                                     SOURCE_NAMES, AcceptanceModel,
                                                     AcceptanceTally, SourceAcceptance,
                                                     class_index, context_scores,
                                                     host_array, score_buckets_of,
                                                     source_classes)
from vllm_graft.core.budget.choice import Choice, choose_nodes, path_probability
from vllm_graft.core.budget.cost import (CostModel, StepCosts, batch_bucket,
                                         nearest_buckets, non_decreasing)
from vllm_graft.core.budget.guard import FORGOTTEN, ThroughputGuard, _ModeStats, mostly_new
from vllm_graft.core.budget.scout import ChainScout, copied_prefix
from vllm_graft.core.budget.sizer import BudgetSystems, TreeSizer, build_budget_systems
from vllm_graft.core.hybrid import UNKNOWN_SCORE

__all__ = [
    "CALIBRATION_EVIDENCE_TRIALS", "FORGOTTEN", "SOURCE_NAMES", "UNKNOWN_SCORE",
    "AcceptanceModel", "AcceptanceTally", "BudgetSystems", "ChainScout", "Choice",
    "CostModel", "SourceAcceptance", "StepCosts", "ThroughputGuard", "TreeSizer",
    "_ModeStats", "batch_bucket", "build_budget_systems", "choose_nodes", "class_index",
    "context_scores", "copied_prefix", "host_array", "mostly_new", "nearest_buckets",
    "non_decreasing", "path_probability", "score_buckets_of", "source_classes",
]
