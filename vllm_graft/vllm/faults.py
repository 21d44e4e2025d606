"""A fault in Graft never takes the engine down: the step decodes plainly.

Every Graft hook of a runner step runs inside :class:`FaultContainment`. An exception
there makes the step decode plainly for the whole batch, which gives exactly plain
decoding's output:

* preparing the tree verification (before the forward): no tree is verified; every
  request's drafts are rejected and its first row, the root, is sampled by vLLM's
  sampler (the root's logits see only the prefix, whatever positions the failed
  preparation left on the rows after it);
* the target forward with a tree plan (tree attention): the forward runs again without
  the plan, causally, and the step is sampled as above;
* acceptance: the random streams of seeded requests are put back as they were before
  it, and the roots are sampled as above;
* drafting: no request gets drafts this step (the next one decodes plainly).

Outside the steps, a failed CUDA graph capture at start-up (hook ``capture``) leaves the
engine eager (:func:`vllm_graft.vllm.graph_check.run_eagerly_after_failed_capture`).

The first failure of each hook is logged with its traceback; every one counts in
``vllm:graft_errors_total``. After ``graft.max_consecutive_errors`` steps in a row with
a failure, Graft turns itself off for the engine with one error line, and every step
after is plain decoding. Under tensor parallelism a fault on one rank between the
ranks' collectives is not contained (the ranks' steps would part ways).

A test-only switch injects faults into the hooks: the environment variable
``VLLM_GRAFT_INJECT_FAULTS`` set to ``rate=0.2,hooks=prepare+forward+sample+propose,seed=0``
(each hook call fails with probability ``rate``; ``hooks`` default: all).
"""

from __future__ import annotations

import logging
import os
import random

logger = logging.getLogger(__name__)

HOOKS = ("prepare", "forward", "sample", "propose", "forget", "after", "capture")
INJECT_ENV = "VLLM_GRAFT_INJECT_FAULTS"


class InjectedFault(RuntimeError):
    """A fault :data:`INJECT_ENV` injected into a Graft hook (tests only)."""


def _injection_from_env() -> tuple[float, frozenset[str], random.Random] | None:
    setting = os.environ.get(INJECT_ENV)
    if not setting:
        return None
    fields = dict(item.split("=", 1) for item in setting.split(",") if "=" in item)
    hooks = frozenset(fields.get("hooks", "+".join(HOOKS)).split("+"))
    unknown = hooks - set(HOOKS)
    if unknown:
        raise ValueError(f"{INJECT_ENV}: unknown hooks {sorted(unknown)} (known: {HOOKS})")
    return float(fields.get("rate", "0")), hooks, random.Random(int(fields.get("seed", "0")))


class FaultContainment:
    """One runner's fault record (see the module docstring). ``limit``: steps in a row
    with a failure after which Graft turns itself off."""

    def __init__(self, limit: int):
        self.limit = limit
        self.consecutive = 0
        self.total = 0
        self.off = False
        self.logged: set[str] = set()
        self.step_failed = False
        self.injection = _injection_from_env()

    def inject(self, hook: str) -> None:
        """Raise :class:`InjectedFault` in ``hook`` at the test switch's rate."""
        if self.injection is None:
            return
        rate, hooks, rng = self.injection
        if hook in hooks and rng.random() < rate:
            raise InjectedFault(f"injected fault in Graft's {hook} hook")

    def failed(self, hook: str, error: BaseException, stats=None) -> None:
        """Record a failure of ``hook``; the step it happened in decodes plainly."""
        self.total += 1
        self.step_failed = True
        if stats is not None:
            stats.counts["errors"] += 1
        if hook not in self.logged:
            self.logged.add(hook)
            logger.error("Graft: the %s hook failed; this step decodes plainly (later "
                         "failures of this hook are counted in vllm:graft_errors_total, "
                         "not logged)", hook, exc_info=error)

    def end_step(self) -> None:
        """Close a runner step: count it among the failing ones in a row, or reset the
        count; turn Graft off after ``limit`` in a row."""
        if not self.step_failed:
            self.consecutive = 0
            return
        self.step_failed = False
        self.consecutive += 1
        if self.consecutive >= self.limit and not self.off:
            self.off = True
            logger.error("Graft: %d steps in a row failed in Graft's hooks (%d failures in "
                         "all): Graft is off for this engine, every step decodes plainly "
                         "from now on", self.consecutive, self.total)
