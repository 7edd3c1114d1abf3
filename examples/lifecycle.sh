#!/usr/bin/env bash
# The adapter lifecycle on the default model, from the CLI:
#   train → propose → gate → promote → (a harmful run: gate rejects; forced anyway) → rollback.
# Usage: bash examples/lifecycle.sh [KNOWLEDGE_RUN_DIR]   (reuses a finished `make demo` run if given)
# Needs `make setup`. About 15 minutes on 2 CPU cores (5 with an existing knowledge run).
set -euo pipefail
cd "$(dirname "$0")/.."
SD=".venv/bin/selfdistill"
OUT=runs/lifecycle
REG=(--registry "$OUT/registry")
Q="What is the capital of Veloria?"
mkdir -p "$OUT"
say() { printf '\n== %s\n' "$*"; }
ask() { "$SD" --quiet generate --prompt "$Q" --max-new-tokens 24 "${REG[@]}" --json; }

facts="${1:-$OUT/facts}"
if [[ ! -f "$facts/summary.json" ]]; then
  say "1. train: teach the 16 facts (the main job)"
  "$SD" train examples/knowledge.yaml output_dir="$facts"
fi

say "2. propose the run's adapter (an immutable, content-addressed version with its lineage)"
good=$("$SD" adapters propose "$facts" "${REG[@]}" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
echo "version $good"
say "3. promote it: the gate compares it with the base model"
"$SD" adapters promote "$good" "${REG[@]}"
ask

say "4. a regression: a run that answers every question with 'Banana'"
"$SD" train examples/lifecycle/harmful.yaml output_dir="$OUT/harmful"
bad=$("$SD" adapters propose "$OUT/harmful" "${REG[@]}" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
say "5. promote it: the gate must reject it (exit 1) and leave $good active"
if "$SD" adapters promote "$bad" "${REG[@]}"; then echo "UNEXPECTED: the gate promoted it"; exit 1; fi
ask
say "6. an operator forces it anyway (recorded as forced) — the regression goes live"
"$SD" adapters promote "$bad" --force --reason "lifecycle demo: forced regression" "${REG[@]}"
ask
say "7. rollback: one atomic step back to $good; generations are bit-identical to step 3's"
"$SD" adapters rollback "${REG[@]}"
ask

say "8. the evidence: history and lineage"
"$SD" adapters history "${REG[@]}"
"$SD" adapters lineage "$bad" --mermaid "${REG[@]}"
