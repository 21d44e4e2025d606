"""Graft's start-up overhead: seconds until ``vllm-graft serve`` answers ``/health``, with
Graft (the committed EAGLE-3 head, default options: budget "auto", whose cost profile
is measured at the first start) and without, each from a cold Graft cache (no cached
cost profile), taking turns.

    .venv/bin/python scripts/startup_overhead.py                      # SmolLM2-135M, 2 rounds
    .venv/bin/python scripts/startup_overhead.py --dtype float32 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seconds_to_ready(model: str, spec: dict | None, dtype: str | None, timeout: float) -> float:
    """One server start from a cold Graft cache: seconds until /health answers 200."""
    port = _free_port()
    args = [sys.executable, "-m", "vllm_graft.cli.main", "serve", model, "--host",
            "127.0.0.1", "--port", str(port)]
    if dtype:
        args += ["--dtype", dtype]
    with tempfile.TemporaryDirectory() as cache:
        if spec is not None:
            config = Path(cache) / "graft.json"
            config.write_text(json.dumps(spec))
            args += ["--speculative-config", str(config)]
        env = {**os.environ, "VLLM_GRAFT_CACHE": cache, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        start = time.perf_counter()
        server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env=env, start_new_session=True)
        try:
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited ({server.returncode}): {args}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                                timeout=2) as response:
                        if response.status == 200:
                            return time.perf_counter() - start
                except OSError:
                    pass
                if time.perf_counter() - start > timeout:
                    raise TimeoutError(f"not ready in {timeout} s: {args}")
                time.sleep(0.25)
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help="a prepared model name or a model directory")
    parser.add_argument("--head", default=str(ROOT / "assets" / "heads" / "smollm2-135m-eagle3"))
    parser.add_argument("--dtype", default=None, help="--dtype of both servers (default: "
                        "the model's)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", help="also write the timings to this file")
    args = parser.parse_args()
    from vllm_graft.assets.models import prepare_model
    from vllm_graft.assets.pypi import default_cache_dir

    model = args.model if Path(args.model).is_dir() \
        else str(prepare_model(args.model, default_cache_dir()))
    spec = {"method": "graft", "model": args.head}
    times: dict[str, list[float]] = {"plain": [], "graft": []}
    for _ in range(args.rounds):
        for name, config in (("plain", None), ("graft", spec)):
            times[name].append(seconds_to_ready(model, config, args.dtype, args.timeout))
            print(f"{name}: ready in {times[name][-1]:.1f} s", flush=True)
    plain, graft = (statistics.median(times[name]) for name in ("plain", "graft"))
    print(f"median seconds to /health: plain {plain:.1f}, graft {graft:.1f}, "
          f"overhead {graft - plain:+.1f} s ({args.rounds} rounds, dtype "
          f"{args.dtype or 'the model default'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "seconds": times}, indent=2))


if __name__ == "__main__":
    main()
