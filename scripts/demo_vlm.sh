#!/usr/bin/env bash
# Vision-language demo: set up, SFT a tiny LLaVA (random init) on questions about drawn shapes
# from demonstrations of which 40% answer wrongly, then GRPO with an exact-answer reward. Ends
# with held-out accuracy before/after RL (432 questions about 12 shape combinations never
# trained on, in new drawings, 4 answers each sampled at temperature 1).
#   bash scripts/demo_vlm.sh [--plan] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?")
cat <<PLAN
regen VLM demo: 1) set up .venv, 2) SFT a 0.1M-parameter LLaVA (CLIP vision tower + Llama) from random
init on shape questions with 40% wrong answers, 3) GRPO with an exact-answer reward
(about 80 s for both on 2 idle cores), then held-out accuracy before -> after. 1-min load average here now: $load.
PLAN
if [ "${1:-}" = "--plan" ]; then exit 0; fi
seed=${1:-0}
bash scripts/setup.sh
. .venv/bin/activate
echo "== 1/2 SFT (examples/shapes_vqa_sft.yaml, seed $seed) =="
regen sft examples/shapes_vqa_sft.yaml run.overwrite=true run.seed="$seed"
echo "== 2/2 GRPO (examples/shapes_vqa_grpo.yaml, seed $seed) =="
regen train examples/shapes_vqa_grpo.yaml run.overwrite=true run.seed="$seed"
regen report runs/demo-vqa-grpo >/dev/null
echo "Run directories: runs/demo-vqa-sft, runs/demo-vqa-grpo (report.html shows each image beside its answers)"
