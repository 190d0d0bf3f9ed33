#!/usr/bin/env bash
# Vision-language demo: set up, SFT a tiny vision-language model (random init) on questions about
# drawn shapes from demonstrations of which 40% answer wrongly, then GRPO with an exact-answer
# reward. Ends with held-out accuracy before/after RL (432 questions about 12 shape combinations
# never trained on, in new drawings, 4 answers each sampled at temperature 1).
#   bash scripts/demo_vlm.sh [--plan] [--qwen] [SEED]
#   --qwen: the same task on a tiny Qwen2.5-VL (packed image patches, M-RoPE) instead of a LLaVA
set -euo pipefail
cd "$(dirname "$0")/.."
plan=0 qwen=0 seed=0
for a in "$@"; do
  case "$a" in
    --plan) plan=1 ;;
    --qwen) qwen=1 ;;
    *) seed=$a ;;
  esac
done
if [ "$qwen" = 1 ]; then
  model="a tiny Qwen2.5-VL (packed-patch vision tower + M-RoPE language model)" sft=shapes_vqa_qwen_sft grpo=shapes_vqa_qwen_grpo
  runs="runs/demo-vqa-qwen-sft, runs/demo-vqa-qwen-grpo" took="about 4 min"
else
  model="a 0.1M-parameter LLaVA (CLIP vision tower + Llama)" sft=shapes_vqa_sft grpo=shapes_vqa_grpo
  runs="runs/demo-vqa-sft, runs/demo-vqa-grpo" took="about 2 min"
fi
load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?")
cat <<PLAN
regen VLM demo: 1) set up .venv, 2) SFT $model from random init on shape questions with 40% wrong
answers, 3) GRPO with an exact-answer reward ($took for both on 2 idle cores), then held-out accuracy
before -> after. 1-min load average here now: $load.
PLAN
if [ "$plan" = 1 ]; then exit 0; fi
bash scripts/setup.sh
. .venv/bin/activate
echo "== 1/2 SFT (examples/$sft.yaml, seed $seed) =="
regen sft "examples/$sft.yaml" run.overwrite=true run.seed="$seed"
echo "== 2/2 GRPO (examples/$grpo.yaml, seed $seed) =="
regen train "examples/$grpo.yaml" run.overwrite=true run.seed="$seed"
regen report "${runs#*, }" >/dev/null
echo "Run directories: $runs (report.html shows each image beside its answers)"
