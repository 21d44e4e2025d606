"""The ``graft.guard`` section: the throughput guard's tuning
(:class:`vllm_graft.core.budget.ThroughputGuard`, whose defaults these are). Why each
default: docs/design-log.md#throughput-guard."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class GuardConfig(BaseModel):
    """How the throughput guard measures the modes and chooses among them (budget
    ``auto`` with ``auto_guard`` on)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    probe_steps: int = Field(
        1, ge=1, le=64, description="steps of every mode a batch size runs first")
    window: float = Field(
        100.0, gt=1, le=1_000_000, description="steps over which a mode's measurements "
        "fade (one window-th forgotten per step)")
    confidence: float = Field(
        2.0, ge=0, le=100, description="standard errors of a mode's tokens per step added "
        "to its rate: the upper bound the guard chooses by")
    noise_floor: float = Field(
        0.2, ge=0, le=10, description="the least standard error assumed, as a share of a "
        "mode's mean tokens per step (so plain decoding's constant yield is re-checked)")
    plain_refresh: int = Field(
        16, ge=0, le=1_000_000, description="steps after which plain decoding, the rate "
        "to beat, is measured again while another mode runs (0: never forced)")
    probe_share: float | None = Field(
        0.005, gt=0, le=1, description="the most a mode measured slower may lose to the "
        "fastest, as a share of the steps since its last run, before it runs again "
        "(null: whenever its upper bound wins)")
    outlier_steps: float | None = Field(
        3.0, gt=1, le=1000, description="the longest a step counts as, in its mode's mean "
        "steps at the batch size (null: as long as it took)")
    credit: Literal["progress", "median", "sum"] = Field(
        "progress", description="what a step at several requests counts as emitting: "
        "'progress', the requests times one token plus what the step added to the median "
        "request's speculative gain since it joined (gains that stay with a few requests "
        "count little, gains that move among them all count whole); 'median', the "
        "requests times the step's median request's tokens; 'sum', their sum")
    batch_charge: float = Field(
        0.1, ge=0, le=10, description="extra share of its time a speculative step at "
        "several requests counts (requests drifting apart cost the batch outside steps)")
    text_steps: float = Field(
        2.0, ge=1, le=1e12, description="the most steps the records of copy chains "
        "and of plain decoding on other text weigh once a batch of new requests joins")
    scout_new_batches: bool = Field(
        True, description="where the chain scout looks at new batches, a batch at least "
        "half new drops the chains' record instead (and plain decoding is measured on it "
        "again before the scout compares chains with it)")
