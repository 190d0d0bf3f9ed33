#!/usr/bin/env bash
# PPO with a learned reward model, end to end on CPU: pairs from the SFT model's own mistakes, a
# reward model trained on them (held-out pair accuracy before/after), PPO against it (held-out
# exact-match accuracy before/after), and the same PPO with almost no KL, where the policy
# over-optimises the reward model and health.hacking_metric raises reward_hacking.
# `bash scripts/demo_rm.sh --plan` prints what it does and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?")
cat <<PLAN
regen reward-model demo: 1) set up .venv, 2) the SFT base of scripts/demo.sh if runs/demo-sft/export is
missing (about 90 s), 3) sample it on train and held-out prompts and pair each wrong answer with the true
one (about 15 s), 4) train a reward model on those pairs (about 30 s), 5) PPO against it, KL 0.2 (about
60 s), 6) the same with KL 0.001, which over-optimises (about 60 s). Measured on an idle 2-core machine;
the 1-min load average here is now $load.
PLAN
if [ "${1:-}" = "--plan" ]; then exit 0; fi
bash scripts/setup.sh
. .venv/bin/activate
if [ ! -f runs/demo-sft/export/config.json ]; then
  echo "== SFT base (examples/arith_sft.yaml) =="
  regen sft examples/arith_sft.yaml run.overwrite=true
fi
echo "== 1/4 preference pairs from the SFT model's own samples =="
mkdir -p runs/demo-rm-data
regen eval runs/demo-sft/export --data builtin:arithmetic:train --num-prompts 4000 --samples-per-prompt 4 \
  --out runs/demo-rm-data/train_samples.json > /dev/null
regen eval runs/demo-sft/export --data builtin:arithmetic:test --num-prompts 500 --samples-per-prompt 4 \
  --seed 1 --out runs/demo-rm-data/test_samples.json > /dev/null
python scripts/pairs_from_samples.py runs/demo-rm-data/train_samples.json runs/demo-rm-data/train_pairs.jsonl
python scripts/pairs_from_samples.py runs/demo-rm-data/test_samples.json runs/demo-rm-data/test_pairs.jsonl
echo "== 2/4 reward model (examples/arith_rm.yaml) =="
regen rm examples/arith_rm.yaml run.overwrite=true
echo "== 3/4 PPO against the reward model (examples/arith_ppo_rm.yaml) =="
regen train examples/arith_ppo_rm.yaml run.overwrite=true
echo "== 4/4 the same with KL 0.001: over-optimisation, caught by health.hacking_metric =="
regen train examples/arith_ppo_rm.yaml run.dir=runs/demo-ppo-rm-lowkl algorithm.kl_coef=0.001 run.overwrite=true \
  log.progress=none 2>&1 | grep -E "ALERT \[reward_hacking\]|held-out" || true
echo "Run directories: runs/demo-rm (reward model), runs/demo-ppo-rm, runs/demo-ppo-rm-lowkl (alerts.jsonl)"
