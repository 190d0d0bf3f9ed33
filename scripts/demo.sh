#!/usr/bin/env bash
# Quickstart (a): set up, SFT a tiny model on noisy demonstrations, then improve it with GRPO.
# Ends with held-out accuracy before/after RL (500 prompts never trained on, sampled at the
# training temperature). `bash scripts/demo.sh --plan` prints what it does and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?")
cat <<PLAN
regen demo: 1) set up .venv (about a minute the first time, seconds after), 2) SFT a 0.4M-parameter
GPT-2 from random init on arithmetic with 40% wrong demonstrations (about 90 s), 3) GRPO with an
exact-answer reward (about 30 s), then held-out accuracy before -> after. Times measured on an
otherwise idle 2-core machine; the 1-min load average here is now $load (on a busy machine it
takes proportionally longer). Progress lines follow at least every 30 s.
PLAN
if [ "${1:-}" = "--plan" ]; then exit 0; fi
bash scripts/setup.sh
. .venv/bin/activate
echo "== 1/2 SFT base from random init (examples/arith_sft.yaml) =="
regen sft examples/arith_sft.yaml run.overwrite=true
echo "== 2/2 GRPO (examples/arith_grpo.yaml) =="
regen train examples/arith_grpo.yaml run.overwrite=true
echo "Run directories: runs/demo-sft, runs/demo-grpo (metrics.jsonl, tensorboard/, checkpoints/, export/)"
