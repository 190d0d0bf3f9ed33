"""One typed config tree per verb, read from YAML with dotted command-line overrides.

Every field carries a description (shown by `regen train --help-config`). Batch sizes say
their scope: `global_*` counts samples over all processes. Derived sizes are computed once
here (`prompts_per_step`, `minibatches_per_epoch`) and checked, so the loop never has to.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from regen.config.base import Section
from regen.config.dist import DistributedConfig
from regen.config.env import EnvConfig
from regen.config.eval import EvalConfig
from regen.config.methods import CriticConfig, FlowConfig, OverlongConfig
from regen.config.model import LoraSettings, ModelConfig  # noqa: F401  (re-exported)
from regen.config.ops import (  # noqa: F401  (re-exported: regen.config is the one place to import from)
    CheckpointConfig,
    HealthConfig,
    LogConfig,
    MirrorConfig,
    MlflowSettings,
    OfflineHealthConfig,
    WandbSettings,
)
from regen.config.registry import METHODS, method

# the built-in modalities and methods register, language models first (the order of the listings)
# isort: off
from regen.config import lm_methods, flow_methods  # noqa: F401,E402
# isort: on
from regen.config.tasks import (  # noqa: F401  (RewardTerm, TaskConfig: re-exported)
    RewardTerm,
    TaskConfig,
    TaskMixConfig,
    TaskStream,
    check_task_names,
)
from regen.config.train import OptimConfig, SFTStepsConfig, TrainConfig  # noqa: F401  (re-exported)

# --------------------------------------------------------------------------- sections


class RunConfig(Section):
    dir: str = Field("runs/default", description="Run directory: config, metrics, checkpoints, exported model.")
    seed: int = Field(0, description="Seed of every random stream (data order, sampling, init).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' uses CUDA when available.")
    threads: int = Field(0, ge=0, description="torch intra-op threads; 0 keeps torch's default.")
    overwrite: bool = Field(False, description="Allow writing into a run directory that already holds metrics.")


class DataConfig(Section):
    train: str = Field(
        "builtin:arithmetic:train",
        description="Training data: a JSONL file, a Hugging Face dataset 'hf:NAME_OR_PATH[:SPLIT]' (a save_to_disk "
        "folder, a folder of parquet/JSON files, or a hub id where a network exists; split defaults to train), "
        "or 'builtin:arithmetic:train'. Rows by verb: `regen train` (RL) {\"prompt\": ...} (other fields, e.g. "
        "\"answer\", reach the rewards as Sample.meta); algorithm.name=dpo {\"prompt\", \"chosen\", \"rejected\"}; "
        "`regen sft` {\"prompt\", \"completion\"}.",
    )
    eval: str | None = Field(
        "builtin:arithmetic:test", description="Held-out prompts, same formats as data.train; null disables eval."
    )
    columns: dict[str, str] = Field(
        default_factory=dict, description="Hugging Face datasets: the column holding each field regen reads, "
        "e.g. {prompt: question, chosen: response_j, rejected: response_k}."
    )
    chat_template: bool = Field(
        False, description="Language models: render each prompt with the tokenizer's chat template (a user turn, or "
        "the row's 'messages' list of {role, content}) and add_generation_prompt; the completion is the assistant "
        "turn, ended by EOS or the model's end-of-turn token (generation_config eos ids, rollout.stop_tokens). "
        "`regen sft`: each row a conversation ('messages' ending in an assistant turn, or prompt + completion), "
        "trained on its assistant turns only. DPO: the prompt (or 'messages') rendered so, chosen and rejected as "
        "the assistant's turn.")
    system_prompt: str | None = Field(
        None, description="With data.chat_template: a system turn put first in every prompt that has none.")
    on_bad_line: Literal["error", "skip"] = Field(
        "error", description="A malformed JSONL line: stop with its file and line number, or skip it and count it."
    )


class RolloutConfig(Section):
    global_batch_size: int = Field(32, ge=1, description="Completions sampled per step, over all processes.")
    group_size: int = Field(8, ge=1, description="Completions per prompt (the GRPO group).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold; 1.0 disables it.")
    max_new_tokens: int = Field(8, ge=1, description="Completion length cap in tokens (EOS included).")
    stop_tokens: list[str] = Field(
        default_factory=list, description="Extra tokens that end a completion, besides EOS and the model's "
        "generation_config eos ids (e.g. ['<|im_end|>']); each must be one token of the tokenizer.")
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Language-model sampling engine: 'hf' (regen's KV-cached loop over the transformers "
        "model) or 'vllm' (needs `pip install vllm` and a GPU; weights are pushed to it after every update)."
    )
    vllm_memory: float = Field(
        0.3, gt=0.0, lt=1.0, description="rollout.engine=vllm: share of the GPU's memory vLLM may take (the rest "
        "is for training on the same GPU)."
    )
    vllm_tensor_parallel: int = Field(
        1, ge=1, description="rollout.engine=vllm: GPUs one vLLM engine shards the model over (tensor parallel); "
        "on Ray rollout actors each actor needs that many (distributed.rollout_resources.num_gpus)."
    )


class AlgorithmConfig(Section):
    name: str = Field(
        "grpo", json_schema_extra={"choices": "methods"},
        description="The method, each declared once (regen/config/registry.py):"
    )

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        method(v)  # a ValueError naming the registered methods
        return v

    reward_type: Literal["scalar", "binary", "pairwise"] = Field(
        "scalar", description="nft / dgpo: the form of the total reward. 'scalar': group-normalised advantages. "
        "'binary': good (1) / bad (0) labels used as they are (NFT's optimality r = the label, each group's good and "
        "bad sets weighted alike and groups whose labels agree left without preference; DGPO's positive and "
        "negative sets). 'pairwise': each sample's win rate against its group from pairwise 1 / 0.5 / 0 labels (the "
        "`pairwise` reward) used as r (NFT) or as the preference direction 2 * (w - 0.5) (DGPO); held-out "
        "evaluation then scores the win rate against the starting model's samples on the same prompts and noise."
    )
    dpo_beta: float = Field(0.1, gt=0.0, description="DPO/IPO beta.")
    dpo_label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="DPO conservative label smoothing.")
    dpo_loss: Literal["sigmoid", "ipo"] = Field("sigmoid", description="DPO (sigmoid) or IPO (squared) loss.")
    advantage: Literal["grpo", "rloo", "reinforce_pp", "gae"] | None = Field(
        None, description="Advantage estimator: group-relative (GRPO / Dr.GRPO with std_normalize=false), "
        "leave-one-out (RLOO), batch-whitened REINFORCE++, or 'gae' (PPO's critic). null = 'gae' for name=ppo, "
        "else 'grpo'."
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="PPO: GAE discount over response tokens.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="PPO: GAE lambda (bias/variance trade-off).")
    whiten_advantages: bool = Field(
        True, description="PPO: normalise the token advantages over the batch (mean 0, std 1)."
    )
    kl_placement: Literal["loss", "reward"] = Field(
        "loss", description="'loss': kl_coef * KL (kl_estimator) added to the loss; 'reward': k1 KL folded into "
        "per-token rewards (InstructGPT-style; PPO and REINFORCE++ only)."
    )
    std_normalize: Literal["group", "batch", "none"] = Field(
        "group", description="Group-relative advantages (advantage=grpo, and every flow method): divide the "
        "group-centred rewards by the group's std ('group', GRPO), by the std of the whole batch's rewards "
        "('batch', Flow-GRPO's global std), or not at all ('none', Dr.GRPO). true / false mean group / none."
    )
    reinforce_baseline: bool = Field(False, description="REINFORCE++: subtract the group mean before whitening.")
    clip_low: float | None = Field(
        None, gt=0.0, lt=1.0, description="Ratio clip below: 1 - clip_low. null = the method's default: 0.2 (grpo, "
        "ppo), 3e-4 (gspo: a sequence-level ratio), 1e-3 (flow_grpo: a ratio per SDE step; the paper's 1e-4 "
        "clipped 15-23% of ratios and halved learning speed on the shapes task). dgpo: the "
        "PPO-style clip on exp(l_old - l_theta) against its EMA old policy (the public code's clip_range, "
        "1e-5 .. 1e-2); null = off."
    )
    clip_high: float | None = Field(
        None, gt=0.0, description="Ratio clip above: 1 + clip_high (0.28 = DAPO clip-higher). null = the method's "
        "default: 0.2 (grpo, ppo), 4e-4 (gspo), 1e-3 (flow_grpo); dgpo: clip_low when null."
    )
    dual_clip: float | None = Field(
        None, gt=1.0, description="Dual-clip constant c for negative advantages (Ye 2020; 3.0 is usual); null = off."
    )
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of the entropy bonus (0 = off).")
    kl_coef: float = Field(
        0.0, ge=0.0, description="Weight of the KL term; 0 loads no reference model. Language models: KL to the "
        "starting model (kl_estimator, kl_placement). flow_grpo: the exact Gaussian KL of each SDE step to the "
        "starting model. awm: the velocity-space KL to an EMA of the policy (decay from flow.ema_rate / ema_max; "
        "Flow-Factory recommends 0.1). nft, dgpo: the velocity-space KL to the starting model (dgpo's public "
        "code: 1e-3)."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Language models: Schulman's KL estimator used in the loss (with kl_coef > 0)."
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How per-token losses are reduced ('seq-mean-token-sum-norm' divides by "
        "rollout.max_new_tokens: Dr.GRPO)."
    )
    overlong: OverlongConfig | None = Field(None, description="DAPO soft overlong punishment; null = off.")
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts "
        "until the step is full (metrics dynamic/*)."
    )
    max_sampling_rounds: int = Field(3, ge=0, description="Dynamic sampling: most extra sampling rounds per step.")

    @field_validator("std_normalize", mode="before")
    @classmethod
    def _std_from_bool(cls, v):
        return {True: "group", False: "none"}.get(v, v) if isinstance(v, bool) else v


# --------------------------------------------------------------------------- roots


class RLConfig(Section):
    """`regen train`: online RL of a causal language model."""

    run: RunConfig = Field(default_factory=lambda: RunConfig(dir="runs/grpo"))
    model: ModelConfig | None = Field(None, description="The model to train (required, except in a joint run, where "
                                      "each entry of models: has its own).")
    data: DataConfig = Field(default_factory=DataConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig, description="The value model of algorithm.name=ppo.")
    flow: FlowConfig = Field(default_factory=FlowConfig, description="Sampling and method settings of flow models.")
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    reward: list[RewardTerm] = Field(
        default_factory=lambda: [RewardTerm(name="exact_match")], description="Reward terms, summed with weights."
    )
    env: EnvConfig | None = Field(
        None, description="Language models: multi-turn episodes in an environment (tools, games); null = one "
        "completion per sample. The episode's reward is the `env_reward` reward term.")
    tasks: dict[str, TaskStream] | None = Field(
        None, description="Multi-task run: task streams by name, each with its own train / eval prompts, reward "
        "terms and weight (then data.train, data.eval and reward are not read). Each step's prompts are drawn "
        "from the streams by task_mix; metrics task/NAME/*, reward/NAME/TERM and eval/NAME/* per task.")
    task_mix: TaskMixConfig = Field(default_factory=TaskMixConfig, description="Multi-task runs: the task weights.")
    models: dict[str, dict[str, Any]] | None = Field(
        None, description="Joint run: several trained models and which feeds which (regen/config/joint.py), e.g. "
        "{enhancer: {model: ..., algorithm: {name: grpo}, rollout: {group_size: 4}, feeds: painter}, painter: "
        "{model: ..., algorithm: {name: nft}, rollout: {group_size: 4}}}. Each holds its own model, algorithm, "
        "rollout, flow, optim, train and critic sections, and feeds / frozen / train_at / reward_against (the "
        "painter's advantage judged against the user's prompt or its rewrite); run, data, reward, eval, "
        "checkpoint, health, log, train.steps and the optim schedule are the run's. rollout.global_batch_size "
        "counts the final samples of a step. Metrics NAME/* per model.")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    mirror: MirrorConfig = Field(default_factory=MirrorConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description="Where the work runs: one process, torchrun or Ray."
    )

    _members: dict | None = PrivateAttr(None)

    @field_validator("tasks")
    @classmethod
    def _task_names(cls, v):
        return check_task_names(v)

    @model_validator(mode="after")
    def _sizes(self) -> RLConfig:
        if self.models is not None:
            self._joint()
        elif self.model is None:
            raise ValueError("model: required (model.path, model.init, or a joint run's models:)")
        if self.mirror.url and self.checkpoint.keep_last < 2:
            raise ValueError("checkpoint.keep_last must be at least 2 with mirror.url: the newest local "
                             "checkpoint may still be uploading when the next one is written")
        r, t, a = self.rollout, self.train, self.algorithm
        if a.advantage is None:
            a.advantage = "gae" if a.name == "ppo" else "grpo"
        m = method(a.name)
        low, high = m.clip or (None, None)
        a.clip_low = low if a.clip_low is None else a.clip_low
        a.clip_high = high if a.clip_high is None else a.clip_high
        if a.clip_high is None:  # a method without default clips (dgpo): one range, symmetric
            a.clip_high = a.clip_low
        if (a.name == "ppo") != (a.advantage == "gae"):
            raise ValueError(f"algorithm.name={a.name} with algorithm.advantage={a.advantage}: the critic's GAE "
                             "advantages and algorithm.name=ppo go together")
        if a.kl_placement == "reward" and a.advantage not in ("gae", "reinforce_pp"):
            raise ValueError(f"algorithm.kl_placement=reward needs per-token advantages (algorithm.name=ppo or "
                             f"advantage=reinforce_pp), not advantage={a.advantage}")
        needs_groups = a.advantage in ("grpo", "rloo") or (a.advantage == "reinforce_pp" and a.reinforce_baseline)
        if r.group_size < 2 and needs_groups:
            raise ValueError(f"rollout.group_size={r.group_size}: group-relative advantages need at least 2 per group")
        if r.global_batch_size % r.group_size:
            raise ValueError(
                f"rollout.global_batch_size={r.global_batch_size} is not divisible by "
                f"rollout.group_size={r.group_size}"
            )
        if t.global_minibatch_size is None:
            t.global_minibatch_size = r.global_batch_size
        if self.tasks and not m.online:
            raise ValueError(f"tasks: multi-task runs are for the online methods; algorithm.name={a.name} trains on "
                             "the preference pairs of data.train")
        if not m.online:  # offline: pairs per step is train.global_minibatch_size, no rollout
            return self
        if t.global_minibatch_size > r.global_batch_size or r.global_batch_size % t.global_minibatch_size:
            raise ValueError(
                f"train.global_minibatch_size={t.global_minibatch_size} must divide "
                f"rollout.global_batch_size={r.global_batch_size}"
            )
        if t.micro_batch_size is not None and t.global_minibatch_size % t.micro_batch_size:
            raise ValueError(f"train.micro_batch_size={t.micro_batch_size} must divide "
                             f"train.global_minibatch_size={t.global_minibatch_size}")
        if not self.reward:
            raise ValueError("reward: at least one reward term is needed")
        if self.tasks and self.eval.metrics:
            raise ValueError("eval.metrics with tasks: the quality metrics compare one held-out set with one "
                             "reference, not yet one per task; evaluate each task's export with `regen eval` instead")
        if self.modality == "flow" and self.model is not None and self.model.freeze_vision is not None:
            raise ValueError(f"model.freeze_vision is for vision-language models, not algorithm.name={a.name}")
        f = self.flow
        stochastic = m.stochastic
        if f.sampler is None:
            f.sampler = "sde" if stochastic else "ode"
        elif self.modality == "flow" and stochastic == (f.sampler == "ode"):
            raise ValueError(f"flow.sampler={f.sampler} with algorithm.name={a.name}: " + (
                "it trains on stochastic steps, so flow.sampler must be sde or cps" if stochastic else
                "it trains on clean ODE samples (no stochastic steps), so flow.sampler must be ode"))
        problem = m.check(self) if m.check else None
        if problem:
            raise ValueError(problem)
        if f.sde_window is not None and f.window_start + f.sde_window > f.steps:
            raise ValueError(f"flow.sde_window={f.sde_window} from flow.window_start={f.window_start} does not fit "
                             f"in flow.steps={f.steps}")
        o = self.algorithm.overlong
        # the length it punishes is the model's own tokens: of one completion, or of an episode's turns
        cap, cap_key = (r.max_new_tokens, "rollout.max_new_tokens") if self.env is None else \
            (min(self.env.max_tokens, self.env.max_turns * r.max_new_tokens), "the episode's model tokens (env)")
        if o is not None and (o.cache_len > o.max_len or o.max_len > cap):
            raise ValueError(f"algorithm.overlong: need cache_len ({o.cache_len}) <= max_len ({o.max_len}) <= "
                             f"{cap_key} ({cap})")
        if self.models is not None:
            self._members = None
            _ = self.members  # each model's own config, checked now
        return self

    def _joint(self) -> None:
        """A joint run: the step's rows per prompt are the product of the models' group sizes."""
        from regen.config.joint import group_sizes

        if not self.models:
            raise ValueError("models: give the models of a joint run, or leave models out (null)")
        if self.tasks:
            raise ValueError("models with tasks: a joint run with several task streams is not supported yet")
        size = 1
        for n in group_sizes(self.models):
            size *= n
        self.rollout.group_size = size

    @property
    def members(self) -> dict:
        """A joint run's models: name -> its RLConfig, in dataflow order (regen/config/joint.py)."""
        from regen.config.joint import member_configs

        if self._members is None:
            self._members = member_configs(self)
        return self._members

    def unread(self, given) -> list[str]:
        """Messages for keys the user set (dotted, see config/load.py) that this method does not read."""
        from regen.config.reads import unread

        return unread(self, given)

    def read_tree(self, tree: dict) -> dict:
        from regen.config.reads import prune

        return prune(tree, self)

    @property
    def modality(self) -> str:
        """'lm', 'flow' or another registered modality: the kind of model algorithm.name trains."""
        return METHODS[self.algorithm.name].modality

    @property
    def prompts_per_step(self) -> int:
        return self.rollout.global_batch_size // self.rollout.group_size

    @property
    def minibatches_per_epoch(self) -> int:
        return self.rollout.global_batch_size // self.train.global_minibatch_size


# Loading lives in its own module; re-exported here so `regen.config` is the one place to import from.
from regen.config.load import (  # noqa: E402,F401
    config_hash,
    dump_config,
    incompatible_changes,
    load_config,
    parse_overrides,
    redact,
    resolved_tree,
)
from regen.config.reference import describe, read_by  # noqa: E402,F401  (the --help-config table)
from regen.config.rm import RMConfig, RMEvalConfig, RMStepsConfig  # noqa: E402,F401  (`regen rm`)
from regen.config.sft import SFTConfig  # noqa: E402,F401  (`regen sft`)
