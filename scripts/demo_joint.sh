#!/usr/bin/env bash
# Joint-training demo: the shapes painter (a flow model) and a prompt-enhancer language model
# trained together by one image reward, on user prompts written in synonyms the painter does not
# know ("draw a crimson disc on the west side"). Ends with held-out prompt adherence before -> after
# (48 held-out user prompts: the training combinations in phrasings training never uses).
#   bash scripts/demo_joint.sh [--plan] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?")
cat <<PLAN
regen joint demo: 1) set up .venv, 2) flow-matching SFT of the 16x16 shapes painter, stopped at 300
of its 1000 steps so that it has something to learn (about 2-3 min on 2 idle cores; skipped when
runs/demo-joint-painter/export exists), 3) SFT of the word-level enhancer (about 30 s), 4) joint
GRPO (enhancer) + DiffusionNFT (painter), 200 steps (about 6-7 min).
1-min load average here now: $load.
PLAN
if [ "${1:-}" = "--plan" ]; then exit 0; fi
seed=${1:-0}
bash scripts/setup.sh
. .venv/bin/activate
if [ ! -d runs/demo-joint-painter/export ]; then
  echo "== 1/3 painter SFT (examples/shapes_sft.yaml, 300 steps) =="
  regen sft examples/shapes_sft.yaml sft.steps=300 run.dir=runs/demo-joint-painter run.overwrite=true
fi
echo "== 2/3 enhancer SFT (examples/shapes_enhancer_sft.yaml) =="
regen sft examples/shapes_enhancer_sft.yaml run.overwrite=true
echo "== 3/3 joint RL (examples/shapes_joint.yaml, seed $seed) =="
regen train examples/shapes_joint.yaml run.overwrite=true run.seed="$seed"
regen report runs/demo-joint >/dev/null
echo "Run directory: runs/demo-joint (report.html shows each rewrite above its image); export/enhancer, export/painter"
