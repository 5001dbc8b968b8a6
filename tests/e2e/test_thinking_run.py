"""A model whose chat template drops earlier thinking trains end to end under both history policies,
with a thinking budget: BC clones an expert that thinks before it answers, the stored samples are one
per episode (as sampled) or one per turn (as the template renders), no turn thinks past the budget, and
the metrics (RL iterations and flywheel rounds) count thinking and answer tokens. (Whether the tiny model thinks in its RL rollouts after
so little BC is left to chance; the budget's cut is tested with a scripted actor in
tests/rollout/test_thinking.py.)"""

from __future__ import annotations

import duckdb
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.envs import make
from turnforge.envs.registry import register
from turnforge.policy.model import load_chat_format
from turnforge.train.metrics import read_metrics


class ThinkingEcho(type(make("test-echo"))):  # type: ignore[misc]
    """The echo env whose expert thinks before it answers (more tokens than the budget)."""

    def expert_action(self):
        return "<think>\nsay up now\n</think>\n\nup"


register("test-think-echo", ThinkingEcho, overwrite=True)


@pytest.mark.parametrize("history", ["as_sampled", "as_rendered"])
def test_a_thinking_model_trains_under_each_history_policy(tmp_path, tiny_thinking_dir, history):
    budget = 3
    overrides = [f"model.path={tiny_thinking_dir}", "env.id=test-think-echo", "env.kwargs={episode_len: 3, max_obs_words: 8}",
                 "check_env=false", "rollout.context=full_history", f"rollout.history={history}",
                 f"rollout.thinking_budget={budget}", "bc.num_demos=4", "bc.epochs=6", "bc.batch_size=1", "bc.lr=0.01", "rl.iterations=1",
                 "rl.tasks_per_iteration=2", "rl.group_size=2", "rollout.max_turns=3", "rollout.max_new_tokens=4",
                 "eval.episodes=2", "eval.bc_temperatures=[]", "eval.pass_at_k_samples=0", "flywheel.rounds=1",
                 "flywheel.filters=[infra]", "flywheel.env_steps_per_round=6", "flywheel.eval_episodes=2", "flywheel.mechanisms=[]",
                 "rl.lr=0.001"]
    out = tmp_path / "run"
    summary = train(load_config("sokoban-hf", overrides), out, live=False)
    assert summary.rl_iterations == 1
    before = load_file(str(tiny_thinking_dir / "model.safetensors"))
    after = load_file(str(out / "checkpoints" / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = duckdb.sql(f"SELECT trajectory_id, turn_index, token_ids, loss_mask FROM '{out}/trajectories/rl_00000.parquet'").fetchall()
    per_episode = {}
    for tid, turn, *_ in rows:
        per_episode.setdefault(tid, []).append(turn)
    if history == "as_sampled":
        assert all(turns == [-1] for turns in per_episode.values())
    else:
        assert all(sorted(turns) == list(range(len(turns))) for turns in per_episode.values())
    thinking = load_chat_format(tiny_thinking_dir).thinking
    demos = duckdb.sql(f"SELECT token_ids, loss_mask FROM '{out}/trajectories/bc_demos.parquet'").fetchall()
    for ids, mask in demos:  # the expert's thoughts are cloned: trained tokens, as written
        trained = np.asarray(ids)[np.asarray(mask) == 1].tolist()
        assert trained.count(thinking.open_id) == trained.count(thinking.close_id) >= 1
    for _, turn, ids, mask in rows:  # the thinking of every turn stays within the budget
        ids, mask = np.asarray(ids), np.asarray(mask)
        starts = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)
        for a in starts:
            action = list(ids[a:])
            if thinking.open_id in action[:1]:
                close = action.index(thinking.close_id) if thinking.close_id in action else len(action)
                assert close <= budget
    it = read_metrics(out).iterations[0]
    assert it.rollout.answer_tokens > 0
    assert it.rollout.thinking_tokens + it.rollout.answer_tokens == it.rollout.generated_tokens
    fw = read_metrics(out).flywheel[0]  # the flywheel's round counts them too
    played = duckdb.sql(f"SELECT sum(list_sum(loss_mask)) FROM '{out}/trajectories/flywheel_00000.parquet'")
    assert fw.answer_tokens > 0 and fw.thinking_tokens + fw.answer_tokens == played.fetchall()[0][0]


def test_a_model_without_markers_is_made_to_think_and_its_marker_rows_train_under_lora(tmp_path, tiny_model_dir,
                                                                                       monkeypatch):
    """``model.thinking=true`` on a plain model through LoRA: the run starts from its cached thinking copy,
    BC trains the markers' rows beside the adapter (merged into ``checkpoints/bc``), the flywheel's adapter
    carries them on, and the final checkpoint's adapter holds them."""
    from turnforge.policy.model import load_policy
    from turnforge.policy.tiny import cached_thinking

    monkeypatch.setenv("TURNFORGE_CACHE", str(tmp_path / "cache"))
    overrides = [f"model.path={tiny_model_dir}", "model.thinking=true", "model.lora.r=4", "env.id=test-think-echo",
                 "env.kwargs={episode_len: 3, max_obs_words: 8}", "check_env=false", "rollout.context=full_history",
                 "rollout.thinking_budget=6", "bc.num_demos=4", "bc.epochs=4", "bc.batch_size=1", "bc.lr=0.01",
                 "rl.iterations=0", "rollout.max_turns=3", "rollout.max_new_tokens=4", "eval.episodes=2",
                 "eval.bc_temperatures=[]", "eval.pass_at_k_samples=0", "flywheel.rounds=1", "flywheel.filters=[infra]",
                 "flywheel.env_steps_per_round=6", "flywheel.eval_episodes=2", "flywheel.mechanisms=[]"]
    out = tmp_path / "run"
    train(load_config("sokoban-hf", overrides), out, live=False)
    start = cached_thinking(tiny_model_dir)  # made by the run: the same sealed copy
    policy = load_policy(start)
    rows = [policy.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
    initial = load_file(str(start / "model.safetensors"))["model.embed_tokens.weight"][rows]
    bc = load_file(str(out / "checkpoints" / "bc" / "model.safetensors"))["model.embed_tokens.weight"][rows]
    assert not torch.allclose(bc, initial)  # BC trained the rows the LoRA adapter alone would leave
    adapter = load_file(str(out / "checkpoints" / "final" / "adapter" / "adapter_model.safetensors"))
    assert any("trainable_tokens_delta" in k for k in adapter) and any("lora_A" in k for k in adapter)
