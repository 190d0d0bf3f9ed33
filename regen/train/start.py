"""Starting an RL run: everything checked or read before the loop's first step, for Run.start
(regen/train/run.py): the user's inputs before the run directory is touched, the run
directory on torchrun's rank 0, the checkpoint to resume and whether its settings still
hold, the books it restores, the S3 mirror."""

from __future__ import annotations

from pathlib import Path

from regen.config import RLConfig, incompatible_changes, redact
from regen.data import EpochSampler, PromptItem, load_prompts
from regen.data.tasks import Task, TaskMix, TaskWeights, tag
from regen.errors import UserError
from regen.rewards.tasks import build_reward
from regen.runtime import checkpoint as ckpt
from regen.runtime.alerts import Alerts
from regen.runtime.health import HealthMonitor
from regen.runtime.loggers import require as require_loggers
from regen.runtime.metrics import SilentLog  # noqa: F401  (re-exported)
from regen.runtime.mirror import open_mirror  # noqa: F401  (re-exported)
from regen.runtime.rundir import prepare_on_rank0  # noqa: F401  (re-exported)


def run_inputs(cfg: RLConfig) -> tuple[object, list[PromptItem], list[PromptItem], list[Task] | None]:
    """Loggers' packages, rewards and prompts: everything the user gave that can be wrong,
    checked before the run directory is touched. A multi-task run (cfg.tasks) returns its task
    streams too, and the concatenation of their prompts (each tagged with meta['task'])."""
    require_loggers(cfg.log)  # W&B / MLflow installed when turned on
    reward = build_reward(cfg)
    skip = cfg.data.on_bad_line == "skip"
    chat = cfg.data.chat_template and cfg.modality == "lm"
    tok, tools = None, None
    if cfg.env is not None:  # the environment's class and arguments, checked before anything is touched
        from regen.envs import make_env

        tools = getattr(make_env(cfg.env)(), "tools", None)
    if chat:  # prompts rendered with the model's own template before anything else is touched
        from regen.policies.lm_load import load_tokenizer

        tok = load_tokenizer(cfg.model, cfg.task)

    def read(spec: str | None, task, where: str) -> list[PromptItem]:
        if not spec:
            return []
        items = load_prompts(spec, task, where, skip, cfg.data.columns, chat)
        if chat:
            from regen.data.chat import render

            items = render(items, tok, cfg.data.system_prompt, where, tools)
        return items

    if cfg.tasks:
        tasks = [Task(name, tag(read(s.train, s.task or cfg.task, f"tasks.{name}.train"), name, f"tasks.{name}.train"),
                      tag(read(s.eval, s.task or cfg.task, f"tasks.{name}.eval"), name, f"tasks.{name}.eval"), s.weight)
                 for name, s in cfg.tasks.items()]
        return reward, [p for t in tasks for p in t.prompts], [e for t in tasks for e in t.eval_items], tasks
    prompts = read(cfg.data.train, cfg.task, "data.train")
    eval_items = read(cfg.data.eval, cfg.task, "data.eval")
    if len(prompts) < cfg.prompts_per_step:
        raise UserError(f"data.train: {len(prompts)} prompts, fewer than the {cfg.prompts_per_step} per step")
    return reward, prompts, eval_items, None


def data_sampler(cfg: RLConfig, n_prompts: int, tasks: list[Task] | None) -> EpochSampler | TaskMix:
    """The run's prompt order: one shuffled stream, or the task streams mixed by task_mix."""
    if not tasks:
        return EpochSampler(n_prompts, cfg.run.seed)
    weights = TaskWeights([t.name for t in tasks], [t.weight for t in tasks], cfg.task_mix)
    return TaskMix([len(t.prompts) for t in tasks], weights, cfg.run.seed)


def resume_state(cfg: RLConfig, run_dir: Path, alerts: Alerts, force: bool) -> dict:
    """The newest valid checkpoint, refused when settings that change the computation differ
    from the ones it was trained with (unless force)."""
    state = ckpt.load_latest(run_dir, warn=lambda m: alerts.fire(-1, "checkpoint_skipped", m))
    ckpt.check_trainer(state, "rl", run_dir)  # an SFT, DPO or reward-model run's directory
    saved = state["state"].get("config")
    diff = changed_settings(cfg, saved) if saved else []
    if diff and not force:
        raise UserError("cannot resume: the config differs from the checkpoint's in "
                        + "; ".join(diff) + " (pass --force to resume anyway, or use another run.dir)")
    print(f"resuming from {state['folder']}")
    return state


def changed_settings(cfg: RLConfig, saved: dict) -> list[str]:
    """What differs between a checkpoint's config and this run's, among the keys the method reads
    (only those change the computation); a checkpoint of an older regen is read in today's keys."""
    from regen.config.methods import migrate

    now = redact(cfg.model_dump(mode="json"))
    return incompatible_changes(cfg.read_tree(migrate(saved)), cfg.read_tree(now))


def restore_books(state: dict | None, run_dir: Path, opt, data, gen, health: HealthMonitor,
                  load_optimizer=None) -> int:
    """The step to continue from (0 for a new run): optimizer, data position, RNG streams and
    health monitor back as the checkpoint `state` left them. load_optimizer(state_dict): how the
    optimizer takes its state (FSDP2 shards it), default opt.load_state_dict."""
    if state is None:
        return 0
    step = ckpt.restore(state, run_dir, opt, data, gen, load_optimizer)
    if "health" in state["state"]:
        health.load_state(state["state"]["health"])
    if isinstance(data, TaskMix) and "task_weights" in state["state"]:
        data.weights.load_state(state["state"]["task_weights"])
    return step
