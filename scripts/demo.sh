#!/usr/bin/env bash
# Quickstart (a): set up, SFT a tiny model on noisy demonstrations, then improve it with GRPO.
# Ends with held-out accuracy before/after RL (500 prompts never trained on, sampled at the
# training temperature). About 2 minutes on 2 CPU cores after set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
echo "== 1/2 SFT base from random init (examples/arith_sft.yaml) =="
regen sft examples/arith_sft.yaml run.overwrite=true
echo "== 2/2 GRPO (examples/arith_grpo.yaml) =="
regen train examples/arith_grpo.yaml run.overwrite=true
echo "Run directories: runs/demo-sft, runs/demo-grpo (metrics.jsonl, tensorboard/, checkpoints/, export/)"
