"""The data flywheel through a tiny ``train()``: every mechanism runs, is recorded, and the
trajectory store reads its episodes by source; guided samples are trained without their hints."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from helpers import TINY_TEST_SHAPE

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.data.query import TrajectoryStore
from turnforge.envs.base import HINT_PREFIX, strip_guidance
from turnforge.policy.model import load_policy
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.context import rerender
from turnforge.rollout.engine import EpisodeRequest, make_engine
from turnforge.seeding import generator
from turnforge.train.mechanisms import MECHANISMS, Mechanism
from turnforge.train.mechanisms.guidance import guided_config
from turnforge.train.metrics import read_metrics

FLY = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()],
    "bc.num_demos=30", "bc.epochs=2", "bc.batch_size=16", "rollout.max_turns=8", "eval.episodes=10",
    "eval.bc_temperatures=[1.0,0.5]", "rl.iterations=1", "rl.tasks_per_iteration=2", "rl.group_size=2",
    "flywheel.rounds=2", "flywheel.env_steps_per_round=150", "flywheel.tasks_per_wave=8", "flywheel.eval_episodes=10",
    "flywheel.mechanisms=[retry,guidance,curriculum,anchor,evolve,replay]", "flywheel.stages=[rft,rl]", "flywheel.guidance_level=2",
    "flywheel.group_size=3", "flywheel.replay_max_success=1.0", "flywheel.allocation=adaptive",
    "eval.pass_at_k_samples=4", "eval.pass_at_k_tasks=3",  # pass@k at the start and the end (and after each round: flywheel.pass_at_k), cheap
]
# a model this small solves nothing: the smoke run trains on every episode the machinery played
EVERYTHING = ["flywheel.filters=[infra,loops,dedup]", "flywheel.entropy_floor=0.9"]  # and the entropy guard


def episodes(r, mechanism: str) -> tuple[int, int]:
    """A round's (scored episodes, successes) of a mechanism's source."""
    return r.mechanisms[mechanism].episodes


@pytest.mark.slow
def test_flywheel_run_records_every_mechanism(tmp_path):
    out = tmp_path / "run"
    summary = train(load_config("sokoban-tiny", FLY + EVERYTHING + ["flywheel.pass_at_k=true"]), out, live=False)
    rounds = read_metrics(out).flywheel
    assert [r.round for r in rounds] == [1, 2] and summary.flywheel_rounds == 2
    for r in rounds:
        assert r.round_env_steps >= 150  # the budget is spent before a round stops admitting tasks
        assert r.plain[0] + episodes(r, "evolve")[0] > 0 and [f.name for f in r.filters] == ["infra", "loops", "dedup"]
        assert list(r.mechanisms) == ["retry", "guidance", "curriculum", "anchor", "evolve", "replay"]  # registry order
        assert r.eval.episodes == 10 and r.entropy is not None and r.entropy > 0
        assert r.boundary is not None and r.boundary.tag == f"flywheel-{r.round}" and r.boundary.episodes == 3 * 4
    assert episodes(rounds[0], "guidance")[0] > 0  # a tiny BC policy leaves tasks unsolved
    for r in rounds:  # each task no plain rollout solved is retried twice (retry_rollouts) before guidance sees it
        retried = episodes(r, "retry")
        assert retried[0] >= 2 * r.unsolved_tasks > 0 and (retried[1] > 0 or retried[0] == 2 * r.unsolved_tasks)
    # level 2 hints need the solver: each is counted, and the summary adds the demonstrations' expert moves
    assert summary.expert_queries.hints == rounds[-1].expert_queries > 0
    assert summary.expert_queries.demonstration_actions == summary.bc.demo_env_steps - summary.bc.demo_random_actions
    # round 1's unsolved tasks went to the expert (each move counted) and were played from anchor states in round 2
    anchor = [r.mechanisms["anchor"] for r in rounds]
    assert anchor[0].episodes == (0, 0) and anchor[1].episodes[0] > 0 and rounds[1].anchor_expert_moves > 0
    assert anchor[1].live + anchor[1].graduated + anchor[1].dropped > 0
    assert summary.expert_queries.anchor_moves == rounds[-1].anchor_expert_moves
    q = summary.expert_queries
    assert q.total == q.hints + q.demonstration_actions + q.anchor_moves
    best = summary.eval_bc_best_temperature
    assert [e.temperature for e in best.all] == [1.0, 0.5] and best.all[0].result == summary.eval_before_rl
    assert best.eval.success_rate == max(e.result.success_rate for e in best.all)
    assert summary.gain_over_bc_best_points == round(100 * (summary.eval_after_rl.success_rate - best.eval.success_rate), 2)
    report = (out / "flywheel_report.md").read_text()
    assert report.count("\n| ") == (2 + 1) + (2 + 1) and (out / "flywheel.png").stat().st_size > 0  # rounds; pass@k
    assert "| after BC | " in report and "| final | " in report and "pass@1 | pass@N | never solved@8 |" in report

    with TrajectoryStore(out) as store:
        by_source = {row["source"]: row for row in store.sql("SELECT * FROM success_by_source").to_pylist()}
        assert {"demo", "plain", "retry", "guided", "anchor"} <= set(by_source)
        played = store.sql("SELECT count(*) AS n FROM trajectories WHERE stage = 'flywheel' AND source != 'demo'").to_pylist()[0]["n"]
        assert played == sum(r.plain[0] + sum(x.episodes[0] for x in r.mechanisms.values() if x.episodes) for r in rounds)
        expert = store.sql("SELECT sum(num_turns) AS n FROM trajectories WHERE stage = 'flywheel' AND source = 'demo'")
        assert expert.to_pylist()[0]["n"] == rounds[1].anchor_expert_moves  # the expert's anchor-finding episodes are stored


@pytest.mark.slow
def test_a_round_with_nothing_to_train_on_stops_the_run(tmp_path):
    from turnforge.errors import RunStopped

    with pytest.raises(RunStopped, match=r"flywheel round 1: no episode passed the filters \(\d+ episodes -> infra \d+ -> "
                                         r"success 0 .*\); nothing to train on"):
        train(load_config("sokoban-tiny", FLY + ["flywheel.rounds=1"]), tmp_path / "run", live=False)
    assert not (tmp_path / "run" / "summary.json").exists()


def test_guided_samples_rerendered_without_hints_keep_their_action_tokens(tmp_path):
    cfg = load_config("sokoban-tiny", FLY + ["rollout.max_context_tokens=256"])
    from turnforge.policy.tiny import build_tiny_model

    build_tiny_model(tmp_path / "m", cfg.model.tiny)
    policy = load_policy(tmp_path / "m", "float32")
    guided = make_engine(guided_config(cfg), policy, num_envs=4)
    plain = make_engine(cfg, policy, num_envs=1)
    try:
        actor = PolicyActor(policy, cfg.rollout.max_new_tokens, 1.0, generator(0, "t"))
        reqs = [EpisodeRequest(guided.env.task("train", i), i, f"g{i}", f"g{i}") for i in range(4)]
        trajs, _ = guided.play(reqs, actor)
        hinted = 0
        for t in trajs:
            obs = [strip_guidance(turn.observation) for turn in t.turns]
            hinted += sum(HINT_PREFIX in turn.observation for turn in t.turns)
            new = rerender(t, obs, policy.chat, cfg.rollout, plain.prompt, plain.marker)
            assert new is not None and len(new) == len(t.samples)
            for old, x, o in zip(t.samples, new, obs):
                act = old.loss_mask == 1
                assert np.array_equal(x.token_ids[x.loss_mask == 1], old.token_ids[act])
                assert np.array_equal(x.logprobs[x.loss_mask == 1], old.logprobs[act])
                text = policy.tokenizer.decode(x.token_ids[x.loss_mask == 0])
                assert HINT_PREFIX.strip() not in text and o.splitlines()[0] in text
                # the context is exactly what the unguided engine writes for the stripped observation
                from turnforge.rollout.context import EpisodeContext

                ctx = EpisodeContext(policy.chat, cfg.rollout, plain.prompt, plain.marker, "x")
                ctx.observe(o)
                assert ctx.prompt() == tuple(x.token_ids[x.loss_mask == 0].tolist())
        assert hinted > 0  # level 2 shows the next push on every observation
    finally:
        guided.close(), plain.close()


class Interrupt(Mechanism):
    """A mechanism of this test only: notes each round it begins, and raises SIGINT in the
    round ``stop_in`` names (once)."""

    name, help = "interrupt", "SIGINT at the start of a round"
    begun: list[int] = []
    stop_in: list[int] = []

    def begin(self, col):
        import signal

        self.begun.append(col.r)
        if col.r in self.stop_in:
            self.stop_in.remove(col.r)
            signal.raise_signal(signal.SIGINT)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [[], ["model.lora.r=4"]], ids=["full", "lora"])
def test_a_run_interrupted_in_the_flywheel_resumes_to_the_same_result(tmp_path, monkeypatch, lora):
    """SIGINT in round 2 (after the curriculum's and the anchors' episodes) stops the run at once;
    ``--resume`` goes on from round 1's checkpoint (its weights, optimizer and carried state:
    replay buffer, curriculum starts, derived tasks, anchors; under LoRA the BC base plus the
    round's adapter) with round 2 only, and ends with the weights and figures of a run never stopped."""
    import torch

    from turnforge.errors import Interrupted
    from turnforge.train.metrics import read_summary

    monkeypatch.setitem(MECHANISMS, Interrupt.name, Interrupt)
    monkeypatch.setattr(Interrupt, "begun", [])
    monkeypatch.setattr(Interrupt, "stop_in", [])
    cfg = FLY + EVERYTHING + lora + ["flywheel.mechanisms=[retry,guidance,curriculum,anchor,evolve,replay,interrupt]"]
    straight = train(load_config("sokoban-tiny", cfg), tmp_path / "straight", live=False)
    Interrupt.begun.clear()
    Interrupt.stop_in.append(1)
    with pytest.raises(Interrupted, match=r"during flywheel round 2; resume with: .* \(continues with round 2\)"):
        train(load_config("sokoban-tiny", cfg), tmp_path / "stopped", live=False)
    resumed = train(load_config("sokoban-tiny", cfg), tmp_path / "stopped", resume=True, live=False)
    assert Interrupt.begun == [0, 1, 1]  # round 1 was not played again
    assert resumed.eval_after_rl == straight.eval_after_rl and resumed.env_steps == straight.env_steps
    assert read_summary(tmp_path / "stopped").expert_queries == straight.expert_queries
    untimed = [[replace(r, seconds=0.0, time=0.0) for r in read_metrics(tmp_path / run).flywheel] for run in ("stopped", "straight")]
    assert untimed[0] == untimed[1] and [r.round for r in untimed[0]] == [1, 2]  # each round once, as if never stopped
    a = load_policy(tmp_path / "straight" / "checkpoints" / "final", "float32").model.state_dict()
    b = load_policy(tmp_path / "stopped" / "checkpoints" / "final", "float32").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
