"""Build the tiny random target + EAGLE-3 head used by the demo (idempotent).

    .venv/bin/python scripts/make_tiny_models.py DIR
"""

import json
import sys
from pathlib import Path

from vllm_graft.testing.tiny_models import build_eagle3_head, build_target


def main(root: str) -> None:
    root = Path(root)
    target, head = root / "target", root / "eagle3-head"
    if not (target / "model.safetensors").exists():
        build_target(target, initializer_range=0.1)
    if not (head / "model.safetensors").exists():
        build_eagle3_head(target, head)
    config = root / "graft.json"
    config.write_text(json.dumps({"method": "graft", "model": "eagle3-head",
                                  "graft": {"variant": "graft", "budget": 60}}, indent=2))
    print(target, config)


if __name__ == "__main__":
    main(sys.argv[1])
