"""The start-up cost profile behind ``budget: "auto"``: the target's forward time as a
function of the batch's query tokens, measured on this engine with vLLM's own dummy
forward up to the most tokens a step of full trees can verify, cached per (model,
device, dtype, quantization, parallel layout) so a restart is fast, and refreshed
online from real steps (:meth:`CostModel.observe`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os

import torch

from vllm_graft.assets.pypi import default_cache_dir
from vllm_graft.core.budget import CostModel
from vllm_graft.machine import cpu_model
from vllm_graft.vllm.timing import device_clock
from vllm_graft.vllm.tp_agreement import agree, is_first_rank

logger = logging.getLogger(__name__)

#: query-token counts measured at start-up: those within the engine's token budget, up
#: to the first that covers a step of full trees (:func:`profiled_tokens`)
PROFILE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                  32768, 65536)


def profiled_tokens(max_batched_tokens: int, max_requests: int, budget: int) -> list[int]:
    """The counts of :data:`PROFILE_TOKENS` the engine can schedule, up to the first at
    or past ``max_requests`` drafts of ``budget`` nodes and their roots: the sizer prices
    steps up to there, and past a curve's last point it can only extrapolate (on a GPU
    the cost per token grows several times past a few hundred tokens, where compute,
    not memory, bounds the forward)."""
    reach = max_requests * (budget + 1)
    counts = []
    for count in PROFILE_TOKENS:
        if count > max_batched_tokens:
            break
        counts.append(count)
        if count >= reach:
            break
    return counts


def device_name(device: torch.device) -> str:
    """The device as a profile's key names it: a GPU by its model, a CPU by its model
    and cores (a cache directory shared by machines must not mix them)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {cpu_model() or 'unknown'}, {os.cpu_count()} cores"


def profile_key(runner) -> dict[str, str]:
    config = runner.vllm_config
    model_config, parallel = config.model_config, config.parallel_config
    layout = f"tp{parallel.tensor_parallel_size}"
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        layout += f"pp{parallel.pipeline_parallel_size}"
    key = {"model": str(model_config.model), "device": device_name(torch.device(runner.device)),
           "dtype": str(model_config.dtype).removeprefix("torch."), "layout": layout}
    for name in ("quantization", "revision"):  # named only where set
        if getattr(model_config, name, None):
            key[name] = str(getattr(model_config, name))
    return key


def profile_path(key: dict[str, str]):
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return default_cache_dir() / "cost-profiles" / f"{digest}.json"


#: seconds the start-up measurement may take (a restart is an outage): counts whose
#: forwards would not fit are left to the curve's extrapolation and to the refresh from
#: real steps
PROFILE_SECONDS = 20.0


def measure(runner, tokens: list[int], repeats: int = 5,
            seconds: float = PROFILE_SECONDS, timed=None) -> CostModel:
    """Fastest of up to ``repeats`` timings of vLLM's dummy forward at each of
    ``tokens``, within ``seconds``. ``timed(n)``: one forward of ``n`` tokens, its
    milliseconds (default: the runner's dummy forward).

    Counts are measured in increasing order, each warmed up first (its shape's one-off
    costs stay out of the times) and timed once, while the next count's two forwards,
    as the last two points predict them, fit in 60 % of ``seconds``: the first counts
    always (a curve needs two points), the largest only on a device fast enough. Then
    whole rounds over the measured counts repeat the timings while the rest of the time
    lasts, up to ``repeats`` in all.

    The fastest timing, not the median: the profile is cached for every later start,
    and a forward is only ever slowed by what else runs on the device, never sped up.
    A profile measured beside another job (4 query tokens at 100 ms against 57 for 1
    on this repository's CPU, where an idle machine measures 64) kept every later
    engine from verifying more than a token or two. The repeat rounds take turns over
    the counts, so a burst of other work slows one timing of every count, not every
    timing of the counts measured during it."""
    if timed is None:
        def timed(n: int) -> float:
            start = device_clock(runner.device)
            runner._dummy_run(n)
            return (device_clock(runner.device) - start) * 1e3
    clock = device_clock(runner.device)
    measured: list[int] = []
    times: list[float] = []
    for n in tokens:
        if len(measured) >= 2:
            (t0, m0), (t1, m1) = zip(measured[-2:], times[-2:])
            predicted = m1 + (n - t1) * max(m1 - m0, 0.0) / (t1 - t0)
            spent = (device_clock(runner.device) - clock) * 1e3
            # the first rank's clock decides for every rank: the forwards' collectives
            # hang unless all run the same counts
            if agree(spent + 2 * predicted > 0.6 * seconds * 1e3):
                break
        timed(n)  # warm-up
        measured.append(n)
        times.append(timed(n))
    for _ in range(repeats - 1):
        spent = (device_clock(runner.device) - clock) * 1e3
        if agree(spent + sum(times) > seconds * 1e3):
            break
        times = [min(ms, timed(n)) for n, ms in zip(measured, times)]
    if len(measured) < len(tokens):
        logger.info("Graft: cost profile measured up to %d query tokens within %.0f s; "
                    "past that it extrapolates and learns from real steps", measured[-1],
                    seconds)
    # the dummy batch spreads tokens over requests; one curve over total tokens
    return CostModel(curves={1: ([float(n) for n in measured], times)},
                     key=profile_key(runner), requested_tokens=tokens[-1])


def _cached(key: dict[str, str], tokens: list[int]) -> CostModel | None:
    path = profile_path(key)
    if not path.is_file():
        return None
    try:
        model = CostModel.load(path, expected_key=key)
    except ValueError as error:
        logger.warning("Graft: ignoring the cached cost profile (%s); measuring again", error)
        return None
    reach = min(curve[0][-1] for curve in model.curves.values())
    if reach < tokens[-1] and not model.frozen and model.requested_tokens < tokens[-1]:
        logger.info("Graft: the cached cost profile %s reaches %d query tokens, this engine "
                    "schedules up to %d; measuring again", path, reach, tokens[-1])
        return None
    logger.info("Graft: cost profile from %s", path)
    return model


def load_or_measure(runner) -> CostModel:
    """The first tensor-parallel rank's cached profile, or one measured now by every
    rank together: measuring runs dummy forwards, whose collectives hang unless every
    rank runs them, so no rank decides from its own cache alone."""
    key = profile_key(runner)
    config = runner.drafter.settings.config
    tokens = profiled_tokens(runner.scheduler_config.max_num_batched_tokens,
                             runner.scheduler_config.max_num_seqs,
                             max(config.budget, config.chain_tokens + config.chain_walk))
    model = agree(_cached(key, tokens) if is_first_rank() else None)
    if model is not None:
        return model
    model = measure(runner, tokens)
    if not is_first_rank():
        return model  # its sizer's choices are the first rank's anyway
    path = profile_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        model.save(path)
    except OSError as error:  # a read-only cache only costs the next start-up
        logger.warning("Graft: cost profile not cached (%s)", error)
    tokens, ms = model.curves[1]
    logger.info("Graft: measured cost profile (query tokens -> ms): %s",
                ", ".join(f"{int(t)}: {m:.2f}" for t, m in zip(tokens, ms)))
    return model
