"""Health monitor: turns per-step signals into skip / rollback / alert decisions.

Pure bookkeeping (no I/O besides the Alerts it is given), so the loop only asks it
questions: was this step healthy, must we roll back now, is it time to warn of a stall.
"""

from __future__ import annotations

import math
import time

HISTORY = 20  # steps of reward history before collapse detection starts


class HealthMonitor:
    def __init__(self, cfg, alerts):
        self.cfg, self.alerts = cfg, alerts
        self.nonfinite_streak = 0
        self.rollbacks = 0
        self.lr_scale = 1.0
        self._n, self._mean, self._m2 = 0, 0.0, 0.0  # Welford running stats of reward/mean
        self._last_checkpoint = time.monotonic()
        self._stall_warned = False
        self.problem = False  # the current state is not one to roll back to

    def observe(self, step: int, metrics: dict) -> bool:
        """Record a finished step; fire alerts; return True when a rollback is due."""
        rollback = False
        if metrics.get("nonfinite_skipped", 0) > 0:
            self.nonfinite_streak += 1
            self.alerts.fire(step, "nonfinite", "non-finite loss or gradient: optimizer step skipped",
                             streak=self.nonfinite_streak)
            rollback |= self.nonfinite_streak >= self.cfg.rollback_after_nonfinite
        else:
            self.nonfinite_streak = 0
        reward = metrics.get("reward/mean")
        collapsed = False
        if reward is not None and math.isfinite(reward):
            if self._n >= HISTORY:
                std = math.sqrt(self._m2 / (self._n - 1))
                if std > 0 and reward < self._mean - self.cfg.reward_collapse_z * std:
                    collapsed = True
                    self.alerts.fire(step, "reward_collapse", f"reward/mean {reward:.4g} is more than "
                                     f"{self.cfg.reward_collapse_z} running std below the running mean {self._mean:.4g}",
                                     reward=reward, running_mean=self._mean, running_std=std)
            if not collapsed:  # a collapsed value would drag the baseline down after it
                self._n += 1
                delta = reward - self._mean
                self._mean += delta / self._n
                self._m2 += delta * (reward - self._mean)
        kl = metrics.get("kl")
        exploded = kl is not None and (not math.isfinite(kl) or kl > self.cfg.kl_alert)
        if exploded:
            self.alerts.fire(step, "kl_explosion", f"KL to the reference {kl:.4g} exceeds {self.cfg.kl_alert}", kl=kl)
        rollback |= (collapsed or exploded) and self.cfg.rollback_on_alert  # offline runs have neither
        self.problem = self.nonfinite_streak > 0 or collapsed or exploded
        if time.monotonic() - self._last_checkpoint > self.cfg.stall_alert_s and not self._stall_warned:
            self._stall_warned = True
            self.alerts.fire(step, "stalled", f"no checkpoint written for more than {self.cfg.stall_alert_s:.0f} s")
        return rollback

    def checkpointed(self) -> None:
        self._last_checkpoint, self._stall_warned = time.monotonic(), False

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.lr_scale *= self.cfg.rollback_lr_factor
        self.nonfinite_streak = 0
        self.problem = False

    def state(self) -> dict:
        """What a checkpoint keeps: a resumed run continues a non-finite streak where it was, so a
        kill in the middle of one does not cancel the rollback it leads to."""
        return {"rollbacks": self.rollbacks, "lr_scale": self.lr_scale, "reward_stats": [self._n, self._mean, self._m2],
                "nonfinite_streak": self.nonfinite_streak}

    def load_state(self, state: dict) -> None:
        self.rollbacks, self.lr_scale = int(state["rollbacks"]), float(state["lr_scale"])
        self._n, self._mean, self._m2 = state["reward_stats"]
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))  # older checkpoints: none recorded
        self.problem = self.nonfinite_streak > 0
