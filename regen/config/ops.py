"""Config sections about running a job rather than what it computes: checkpoints, the S3
mirror, health checks and alerts, and logging (TensorBoard, W&B, MLflow)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from regen.config.base import Section


class CheckpointConfig(Section):
    every: int = Field(50, ge=0, description="Checkpoint every N steps (and always at the end); 0 = only at the end.")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept; older ones are deleted after a new one is complete.")


class MirrorConfig(Section):
    url: str | None = Field(
        None, description="Mirror checkpoints to S3-compatible storage, 's3://bucket/prefix' (uploaded in the "
        "background, verified by checksum); a run without local checkpoints resumes from there. Credentials "
        "come from the standard AWS chain (environment, profile), never from this file."
    )
    endpoint_url: str | None = Field(None, description="Endpoint of an S3-compatible server (MinIO...); null = AWS.")
    keep_last: int = Field(3, ge=1, description="Complete checkpoints kept in the bucket.")


class HealthConfig(Section):
    missing_alert_frac: float = Field(
        0.2, ge=0.0, le=1.0, description="Alert when more than this fraction of a step's rewards is missing."
    )
    stop_after_unscored_steps: int = Field(
        3, ge=1, description="Stop with a checkpoint after this many consecutive steps without a single score."
    )
    rollback_after_nonfinite: int = Field(
        3, ge=1, description="Roll back to the last healthy checkpoint after this many consecutive steps whose "
        "loss or gradient was not finite (a single one is just skipped)."
    )
    rollback_lr_factor: float = Field(0.5, gt=0.0, le=1.0, description="Multiply the learning rate by this at each rollback.")
    max_rollbacks: int = Field(3, ge=0, description="Stop the run instead of rolling back more often than this.")
    reward_collapse_z: float = Field(
        4.0, gt=0.0, description="Alert when reward/mean falls this many running standard deviations below its "
        "running mean (after 20 steps of history)."
    )
    kl_alert: float = Field(1.0, gt=0.0, description="Alert when the KL to the reference exceeds this.")
    rollback_on_alert: bool = Field(
        False, description="Also roll back on a reward collapse or KL explosion, not only on non-finite values; "
        "with health.hacking_metric also on reward_hacking and heldout_fall, to the newest healthy checkpoint at or "
        "before the evaluation where the metric peaked (kept for this)."
    )
    stall_alert_s: float = Field(
        3600.0, gt=0.0, description="Alert when no checkpoint has been written for this many seconds."
    )
    hacking_metric: str | None = Field(
        None, description="A held-out metric that measures what the reward stands for (e.g. accuracy with a learned "
        "reward model, adherence_accuracy for images): at each evaluation where it fell by more than hacking_drop "
        "below its peak, a reward_hacking alert when eval/reward is above its value at the peak, else heldout_fall.")
    hacking_drop: float = Field(0.05, gt=0.0, description="Fall of health.hacking_metric from its peak (absolute) "
                                "that raises reward_hacking (eval/reward higher) or heldout_fall (lower).")
    webhook_url: str | None = Field(None, description="POST every alert as JSON to this URL (in the background).")
    reward_patience_s: float = Field(
        600.0, gt=0.0, description="While a reward service is down (its client's circuit breaker open), the loop "
        "waits before the next step, probing the service, instead of spending steps without scores; after this "
        "many seconds it stops with a checkpoint."
    )


class WandbSettings(Section):
    project: str = Field(description="W&B project the run is logged into.")
    entity: str | None = Field(None, description="W&B team or user; null = the default entity of the API key.")
    name: str | None = Field(None, description="Run name shown in W&B; null = the run directory's name.")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="'online' needs WANDB_API_KEY in the environment; 'offline' writes RUN_DIR/wandb/ only "
        "(`wandb sync`); null = $WANDB_MODE when it is set, else online."
    )
    tags: list[str] = Field(default_factory=list, description="Tags of the W&B run.")


class MlflowSettings(Section):
    tracking_uri: str | None = Field(
        None, description="Tracking server or store ('http://host:5000', 'databricks', 'file:///abs/mlruns'); null = "
        "$MLFLOW_TRACKING_URI or MLflow's default. Credentials: MLFLOW_TRACKING_TOKEN or _USERNAME/_PASSWORD only."
    )
    experiment: str = Field("regen", description="MLflow experiment (created when missing).")
    run_name: str | None = Field(None, description="Run name; null = the run directory's name.")

    @model_validator(mode="after")
    def _no_credentials(self) -> MlflowSettings:
        from regen.config.load import holds_credentials

        if self.tracking_uri and holds_credentials(self.tracking_uri):  # the message never repeats the secret
            raise ValueError("tracking_uri must not hold credentials: set MLFLOW_TRACKING_TOKEN or "
                             "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD in the environment instead")
        return self


class OfflineHealthConfig(Section):
    """health of `regen sft` and `regen rm`: the non-finite rules of RL runs (regen/offline/books.py)."""

    rollback_after_nonfinite: int = Field(
        3, ge=1, description="Roll back to the last healthy checkpoint (or the starting model) after this many "
        "consecutive steps whose loss or gradient was not finite (each one is skipped, with an alert)."
    )
    rollback_lr_factor: float = Field(0.5, gt=0.0, le=1.0, description="Multiply the learning rate by this at each rollback.")
    max_rollbacks: int = Field(3, ge=0, description="Stop the run (nothing exported) instead of rolling back more "
                               "often than this.")
    stall_alert_s: float = Field(
        3600.0, gt=0.0, description="Alert when no checkpoint has been written for this many seconds."
    )
    webhook_url: str | None = Field(None, description="POST every alert as JSON to this URL (in the background).")


class LogConfig(Section):
    tensorboard: bool = Field(True, description="Write TensorBoard event files into the run directory.")
    progress: Literal["auto", "bar", "lines", "none"] = Field(
        "auto", description="'auto': a live bar on a terminal, a line every log.every steps otherwise."
    )
    every: int = Field(10, ge=1, description="Steps between printed lines when the bar is off.")
    every_s: float = Field(
        30.0, gt=0.0, description="Without a terminal (CI, nohup, a captured log): also print a line when this many "
        "seconds have passed since the last one, so a slow stretch is never silent."
    )
    wandb: WandbSettings | None = Field(None, description="Also log to Weights & Biases (pip install 'regen[wandb]'): "
                                        "{project, entity, name, mode: online|offline, tags}: the config (secrets "
                                        "redacted), every metrics row; a resume continues the W&B run. null = off.")
    mlflow: MlflowSettings | None = Field(None, description="Also log to MLflow (pip install 'regen[mlflow]'): "
                                          "{tracking_uri, experiment, run_name}: the config (secrets redacted) as "
                                          "params, every metrics row; a resume continues the MLflow run. null = off.")
