"""Ops and host reads of Graft's own hooks in a real engine step, by call site.

Runs a vLLM engine in this process (tiny random target and EAGLE-3 head, built here;
trees of budget 60, greedy) and counts, with :class:`OpCounter`, what Graft's three
step hooks dispatch: the tree verification's preparation, acceptance and the next
round's proposal (the drafter's forwards included). Each read of a tensor by the host
(``.tolist()``, ``.cpu()``, ``.numpy()``, ``.item()``, ...) is listed with the line
that made it, per hook call.

On this CPU every tensor is a host tensor, so the counter cannot tell a read of the
device from a list made of a host tensor: the listing names the lines, and the code
at each line says which they are (on a GPU, a read of a tensor the device computed is
a wait for the device; a host tensor's list is not).

    .venv/bin/python scripts/engine_step_reads.py --batch 1 8
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_graft.testing.op_counter import OpCounter  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the nth Fibonacci number.\"\"\"\n",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n",
           "The quick brown fox jumps over the lazy dog. The quick brown",
           "import os\nimport sys\nimport json\n"]
HOOKS = {"prepare_tree_verification": "prepare", "sample_contained": "accept",
         "propose_with_trees": "propose"}


class SiteCounter(OpCounter):
    """An :class:`OpCounter` that also notes the line of every host-method read."""

    def __init__(self, sites: collections.Counter):
        super().__init__()
        self.sites = sites

    def __enter__(self):
        entered = super().__enter__()
        for name in self.HOST_METHODS:
            counted = getattr(torch.Tensor, name)

            def method(tensor, *args, _counted=counted, **kwargs):
                frame = traceback.extract_stack(limit=2)[0]  # the caller
                self.sites[f"{Path(frame.filename).name}:{frame.lineno} "
                           f"{frame.name}"] += 1
                return _counted(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, method)
        return entered


class HookCounts:
    """Graft's step hooks, wrapped once, counting while :attr:`on`."""

    def __init__(self):
        import vllm_graft.vllm.runner as graft_runner

        self.on = False
        self.reset()
        for name, hook in HOOKS.items():
            setattr(graft_runner, name, self._counted(getattr(graft_runner, name), hook))

    def reset(self) -> None:
        self.totals = {hook: collections.Counter() for hook in HOOKS.values()}
        self.sites = {hook: collections.Counter() for hook in HOOKS.values()}

    def _counted(self, hooked, hook: str):
        def counted(*args, **kwargs):
            if not self.on:
                return hooked(*args, **kwargs)
            with SiteCounter(self.sites[hook]) as counter:
                out = hooked(*args, **kwargs)
            self.totals[hook].update(calls=1, ops=counter.ops, reads=counter.host_waits)
            return out
        return counted


def count_hooks(counts: HookCounts, batch: int, max_tokens: int, models: Path) -> None:
    from vllm import SamplingParams

    from vllm_graft.offline.engine import engine
    from vllm_graft.testing.tiny_models import build_eagle3_head, build_target

    target = build_target(models / "target", initializer_range=0.1, seed=0)
    head = build_eagle3_head(target, models / "head")
    spec = {"method": "graft", "model": str(head),
            "graft": {"budget": 60, "isolation": "global"}}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = (PROMPTS * batch)[:batch]
    counts.reset()
    with engine(str(target), spec, max_model_len=1024, max_num_seqs=batch) as llm:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        counts.on = True
        llm.generate(prompts, params, use_tqdm=False)
        counts.on = False


def report(batch: int, counts: HookCounts) -> str:
    lines = [f"## batch {batch}", ""]
    for hook, total in counts.totals.items():
        calls = max(total["calls"], 1)
        lines.append(f"{hook}: {total['calls']} calls, {total['ops'] / calls:.1f} ops and "
                     f"{total['reads'] / calls:.2f} host reads per call")
        for site, count in counts.sites[hook].most_common():
            lines.append(f"    {count / calls:5.2f}  {site}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    counts = HookCounts()
    for batch in args.batch:
        with tempfile.TemporaryDirectory() as models:
            count_hooks(counts, batch, args.max_tokens, Path(models))
        print(report(batch, counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
