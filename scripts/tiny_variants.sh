#!/usr/bin/env bash
# MAT of every Graft variant at budgets 8 and 60 on the tiny random models (the
# end-to-end test models; the head is random, so retrieval does the accepting).
# Greedy, with a check that every output is token-identical to plain decoding.
#   scripts/tiny_variants.sh [OUT_DIR]      # one JSON per run + a table on stdout
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
source scripts/runtime-env.sh
MODELS=.cache/demo-models
OUT=${1:-.cache/tiny-variants}
mkdir -p "$OUT"
.venv/bin/python scripts/make_tiny_models.py "$MODELS" >/dev/null
HEAD=$(pwd)/$MODELS/eagle3-head
for budget in 8 60; do
  for variant in graft dense_tree prune_only retrieval_only; do
    spec="{\"method\": \"graft\", \"model\": \"$HEAD\", \"graft\": {\"variant\": \"$variant\", \"budget\": $budget}}"
    .venv/bin/vllm-graft generate "$MODELS/target" --dtype float32 --compare \
      --max-tokens 128 --ignore-eos --speculative-config "$spec" --json "$OUT/$variant-b$budget.json" \
      >/dev/null 2>"$OUT/$variant-b$budget.log" \
      || echo "$variant budget $budget: exit $? (see $OUT/$variant-b$budget.log)" >&2
  done
done
.venv/bin/python - "$OUT" <<'PY'
import json, pathlib, sys
print("| variant | budget | MAT | verified nodes / step | draft forwards / tree | retrieved share of accepted | greedy identical |")
print("|---|---|---|---|---|---|---|")
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json"), key=lambda p: (int(p.stem.split("-b")[1]), p.stem)):
    r = json.loads(path.read_text()); g = r["graft"]
    variant, budget = path.stem.split("-b")
    print(f"| {variant} | {budget} | {g.get('mean_accepted_tokens')} | {g.get('verified_nodes_per_step')} | "
          f"{g.get('draft_forwards_per_tree')} | {g.get('accepted_share_retrieved')} | {r.get('greedy_identical')} |")
PY
