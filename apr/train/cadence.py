"""When the run loop logs, validates and saves: one object decides, from ``training.*`` intervals."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cadence:
    total_steps: int
    log_interval: int
    eval_interval: int  # 0: never validate
    save_interval: int
    validates: bool  # a validation set is configured

    @classmethod
    def from_plan(cls, plan, validates: bool) -> Cadence:
        """The resolved plan's intervals over its total steps (``plan``: apr.steps.resolved.Resolved)."""
        training = plan.config.training
        return cls(total_steps=plan.steps.total_steps, log_interval=training.log_interval,
                   eval_interval=training.eval_interval, save_interval=training.save_interval, validates=validates)

    def log(self, step: int, stopping: bool) -> bool:
        """A log step reads the loss and norm to the host; a stopping run logs its last step."""
        return step % self.log_interval == 0 or step == self.total_steps or stopping

    def reads_device(self, step: int, stopping: bool) -> bool:
        """Steps after which the loop reads the device anyway (log, validation, checkpoint): where the
        engine's non-finite flags are read too."""
        return self.log(step, stopping) or self.validate(step) or self.save(step, False, stopping)

    def validate(self, step: int) -> bool:
        return (self.validates and self.eval_interval > 0
                and (step % self.eval_interval == 0 or step == self.total_steps))

    def save(self, step: int, is_best: bool, stopping: bool) -> bool:
        return step % self.save_interval == 0 or step == self.total_steps or is_best or stopping
