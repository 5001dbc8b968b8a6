"""``anchor`` (BREAD / R3): the policy plays on from states along the expert's solutions of tasks
no plain rollout solved (the pool and its reverse curriculum: ``turnforge.train.anchors``)."""

from __future__ import annotations

from dataclasses import dataclass

from turnforge.train.mechanisms.base import ExpertUse, Mechanism, MechanismRecord


@dataclass(frozen=True)
class AnchorRecord(MechanismRecord):
    live: int = 0  # tasks in the anchor pool after the round
    graduated: int = 0  # anchored tasks solved from their real start at anchor_advance, so far
    dropped: int = 0  # anchored tasks given up (no success at the most help), so far
    expert_share: float | None = None  # mean share of the expert's moves played before the policy's, over the pool


class Anchoring(Mechanism):
    """Before the waves: the tasks waiting for the expert are solved by it once (each move an
    expert query, counted; source ``demo``, not trained on), the pool's next tasks are played
    from their anchor states, and each anchor moves by its success. After collection the round's
    unsolved tasks queue for the expert."""

    name, source, label = "anchor", "anchor", "anchored"
    help = "the policy plays on from states along the expert's solutions of unsolved tasks"
    Record = AnchorRecord

    @classmethod
    def requirements(cls, cfg):
        return [cls.needs(cap, "solver-anchored rollouts") for cap in ("snapshot", "expert")]

    def initial_state(self):
        from turnforge.train.anchors import AnchorPool

        return AnchorPool()

    def begin(self, col):
        from turnforge.rollout.actors import ExpertActor
        from turnforge.train import anchors

        pool, cfg = self.state, self.cfg
        anchors.admit(pool, cfg, lambda reqs: col.play(reqs, "demo", ExpertActor(), snapshots=True), col.r)
        got = col.play(anchors.requests(pool, cfg, col.r, col.engine.caps.reseed), self.source)
        anchors.update(pool, got, cfg)

    def after_collection(self, col, plain, unsolved):
        from turnforge.train import anchors

        anchors.wait(self.state, unsolved, self.cfg)

    def record(self, episodes):
        pool = self.state
        return AnchorRecord(episodes, len(pool.anchors), pool.graduated, pool.dropped, pool.expert_share())

    def expert_use(self):
        return ExpertUse(moves=self.state.expert_moves)

    @classmethod
    def summary(cls, record):
        return f"{super().summary(record)} ({record.live} tasks in the pool, {record.graduated} graduated)"

    @classmethod
    def report_lines(cls, rounds):
        records = [x.mechanisms[cls.name] for x in rounds]
        if not any(x.episodes[0] for x in records):
            return []
        last = records[-1]
        share = "" if last.expert_share is None else f", the expert's share of their solutions {last.expert_share:.2f}"
        return ["", f"Anchored tasks (never solved by plain rollouts; the policy plays on from a state along the expert's "
                f"solution): {sum(x.episodes[1] for x in records)}/{sum(x.episodes[0] for x in records)} anchored episodes "
                f"succeeded; {last.graduated} tasks graduated (solved from their real start), {last.live} "
                f"left in the pool{share}, {last.dropped} dropped; {rounds[-1].anchor_expert_moves} expert moves."]
