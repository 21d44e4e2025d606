"""The start-up cost profile behind ``budget: "auto"``: the target's forward time as a
function of the batch's query tokens, measured on this engine with vLLM's own dummy
forward, cached per (model, device, dtype, parallel layout) so a restart is fast, and
refreshed online from real steps (:meth:`CostModel.observe`)."""

from __future__ import annotations

import hashlib
import json
import logging

import torch

from vllm_graft.assets.pypi import default_cache_dir
from vllm_graft.core.budget import CostModel
from vllm_graft.vllm.timing import device_clock
from vllm_graft.vllm.tp_agreement import agree, is_first_rank

logger = logging.getLogger(__name__)

#: query-token counts measured at start-up (those within the engine's token budget)
PROFILE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def profile_key(runner) -> dict[str, str]:
    config = runner.vllm_config
    device = torch.device(runner.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    parallel = config.parallel_config
    return {"model": str(config.model_config.model), "device": name,
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "layout": f"tp{parallel.tensor_parallel_size}"}


def profile_path(key: dict[str, str]):
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return default_cache_dir() / "cost-profiles" / f"{digest}.json"


def measure(runner, repeats: int = 5) -> CostModel:
    """Fastest of ``repeats`` timings of vLLM's dummy forward at each profiled token
    count. The fastest, not the median: the profile is cached for every later start,
    and a forward is only ever slowed by what else runs on the device, never sped up.
    A profile measured beside another job (4 query tokens at 100 ms against 57 for 1
    on this repository's CPU, where an idle machine measures 64) kept every later
    engine from verifying more than a token or two.

    The repeats take turns over the token counts (every count once, then again), so
    each count's timings are spread over the whole measurement: a burst of other work
    slows one turn of every count, not every timing of the counts measured during it.
    Timed one count after another, a burst that started after the smallest counts had
    been measured made 8 tokens cost 10 times one token, and no tree was ever verified."""
    limit = runner.scheduler_config.max_num_batched_tokens
    tokens = [n for n in PROFILE_TOKENS if n <= limit]
    for n in tokens:
        runner._dummy_run(n)  # warm-up: each shape's one-off costs stay out of the times
    times = [float("inf")] * len(tokens)
    for _ in range(repeats):
        for i, n in enumerate(tokens):
            start = device_clock(runner.device)
            runner._dummy_run(n)
            times[i] = min(times[i], (device_clock(runner.device) - start) * 1e3)
    # the dummy batch spreads tokens over requests; one curve over total tokens
    return CostModel(curves={1: ([float(n) for n in tokens], times)}, key=profile_key(runner))


def _cached(key: dict[str, str]) -> CostModel | None:
    path = profile_path(key)
    if not path.is_file():
        return None
    try:
        model = CostModel.load(path, expected_key=key)
    except ValueError as error:
        logger.warning("Graft: ignoring the cached cost profile (%s); measuring again", error)
        return None
    logger.info("Graft: cost profile from %s", path)
    return model


def load_or_measure(runner) -> CostModel:
    """The first tensor-parallel rank's cached profile, or one measured now by every
    rank together: measuring runs dummy forwards, whose collectives hang unless every
    rank runs them, so no rank decides from its own cache alone."""
    key = profile_key(runner)
    model = agree(_cached(key) if is_first_rank() else None)
    if model is not None:
        return model
    model = measure(runner)
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
