"""The language-model modality and its methods (GRPO / DAPO, PPO, GSPO, DPO), each declared once
(regen/config/registry.py): what it trains, the keys it reads, its defaults. Their code: the loss
registry POLICY_LOSSES (regen/algorithms/losses.py) and regen/modalities/lm.py."""

from __future__ import annotations

from regen.config.reads import QUALITY, arithmetic, torchrun
from regen.config.registry import Method, Modality, always, register_method, register_modality, when

ARITHMETIC = when("with the built-in arithmetic task (builtin:arithmetic data or model.init)", arithmetic,
                  "task.digits", "task.test_size")

register_modality(Modality("lm", "language models", "regen.modalities.lm:LMModality", reads=(
    *ARITHMETIC,
    *always("data.chat_template", "rollout.stop_tokens"),
    *when("with data.chat_template=true", lambda c: c.data.chat_template, "data.system_prompt"),
    *always("rollout.temperature", "rollout.top_p", "rollout.max_new_tokens", "rollout.engine",
            "eval.temperature", "eval.greedy", "eval.batch_size", "algorithm.clip_low", "algorithm.clip_high",
            "algorithm.entropy_coef", "algorithm.kl_coef", "algorithm.overlong", "algorithm.advantage"),
    *when("with rollout.engine=vllm", lambda c: c.rollout.engine == "vllm", "rollout.vllm_memory",
          "rollout.vllm_tensor_parallel"),
    *when("with algorithm.kl_coef > 0", lambda c: c.algorithm.kl_coef > 0, "algorithm.kl_placement"),
    *when("with algorithm.kl_coef > 0 and kl_placement=loss",
          lambda c: c.algorithm.kl_coef > 0 and c.algorithm.kl_placement == "loss", "algorithm.kl_estimator"),
    *when("with algorithm.advantage=grpo", lambda c: c.algorithm.advantage == "grpo", "algorithm.std_normalize"),
    *when("with algorithm.advantage=reinforce_pp", lambda c: c.algorithm.advantage == "reinforce_pp",
          "algorithm.reinforce_baseline"),
    *always("env"),
)))

# clip defaults: PPO's 0.2 (Schulman 2017); GSPO's sequence-level ratio is a geometric mean, so its
# paper uses 3e-4 / 4e-4 (Zheng 2025, sec. 5.1)
register_method(Method(
    "grpo", "lm", "token-level clipped ratio; with clip_high 0.28 and overlong, DAPO", clip=(0.2, 0.2),
    reads=(*always("algorithm.dual_clip", "algorithm.loss_agg"),)))
register_method(Method(
    "ppo", "lm", "the same clipped loss on per-token GAE advantages from a learned critic, see the critic section",
    clip=(0.2, 0.2), reads=(*always("algorithm.dual_clip", "algorithm.loss_agg", "algorithm.gamma", "algorithm.lam",
                                    "algorithm.whiten_advantages", "critic"),)))
register_method(Method(
    "gspo", "lm", "sequence-level length-normalised ratio, Zheng 2025; clip ranges 3e-4 / 4e-4 by default",
    clip=(3e-4, 4e-4),
    # its policy term is one ratio per sequence: the aggregation reaches only its KL and entropy terms
    reads=(*when("with algorithm.kl_coef > 0 or entropy_coef > 0",
                 lambda c: c.algorithm.kl_coef > 0 or c.algorithm.entropy_coef > 0, "algorithm.loss_agg"),)))
register_method(Method(
    "dpo", "lm", "offline, on preference pairs from data.train; train.global_minibatch_size pairs per step",
    online=False, reads=(
        *ARITHMETIC,
        *always("run", "model", "data.train", "data.eval", "data.columns", "data.on_bad_line", "algorithm.name",
                "rollout.stop_tokens", "algorithm.dpo_beta", "algorithm.dpo_label_smoothing", "algorithm.dpo_loss",
                "train.steps", "train.global_minibatch_size", "train.grad_clip", "optim", "eval.every",
                "eval.num_prompts", "eval.samples_per_prompt", "eval.temperature", "eval.greedy", "eval.batch_size",
                "rollout.temperature", "rollout.top_p", "rollout.max_new_tokens", "checkpoint", "log",
                "health.rollback_after_nonfinite", "health.rollback_lr_factor", "health.max_rollbacks",
                "health.stall_alert_s", "health.webhook_url", "distributed.mode", "mirror"),
        *when("under torchrun (distributed.mode torchrun or auto)", torchrun, "distributed.strategy",
              "distributed.backend", "distributed.timeout_s"),
        *always("data.chat_template"),
        *when("with data.chat_template=true", lambda c: c.data.chat_template, "data.system_prompt"),
        *QUALITY)))
