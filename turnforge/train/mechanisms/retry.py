"""``retry`` (pass@k-style search): more plain attempts on each task no rollout of its wave solved."""

from __future__ import annotations

from turnforge.train.mechanisms.base import Mechanism


class Retry(Mechanism):
    """``retry_rollouts`` more plain attempts on each of a wave's unsolved tasks, at
    ``retry_temperature`` (one random stream per round); a task one of them solves leaves the
    list the mechanisms after it get, and its success, on a task the policy mostly fails, goes to
    RFT and the replay buffer."""

    name, source, label = "retry", "retry", "retried"
    help = "more plain attempts on the tasks no rollout of their wave solved"

    def begin(self, col):
        fw = self.cfg.flywheel
        self.actor = col.policy_actor(fw.retry_temperature or fw.temperature, "flywheel-retry")

    def after_wave(self, col, failed):
        if not failed:
            return failed
        got = col.play(col.requests(failed, self.cfg.flywheel.retry_rollouts, "r"), self.source, self.actor)
        solved = {t.task.task_id for t in got if t.success and t.infra_failure is None}
        return [t for t in failed if t.task_id not in solved]
