"""The tiny tokenizer's corpus is a fixed list of built-in envs: registering another env
(a plugin, a variant) must not change the tiny model, hence every result of the default job."""

from __future__ import annotations

from turnforge.envs import register, registry
from turnforge.policy.tiny import CORPUS_ENVS, default_corpus


def test_registering_an_env_does_not_change_the_corpus():
    before = default_corpus(samples_per_env=2)
    register("sokoban-corpus-probe", "turnforge.envs.sokoban:SokobanEnv", overwrite=True, dim=7)
    try:
        assert default_corpus(samples_per_env=2) == before
    finally:
        registry._REGISTRY.pop("sokoban-corpus-probe")
    assert len(before) == len(CORPUS_ENVS) * 3


def test_a_two_method_env_can_be_a_corpus_env():
    """model.tiny.corpus_envs with an env of the two-method contract (reset(task, seed), step):
    its first observations, and its expert's open-text actions with what they lead to."""
    from turnforge import Env, StepResult
    from turnforge.envs.tasks import TaskGenerator

    class Echo(Env):
        instructions = "Repeat the word."
        tasks = TaskGenerator(lambda rng: {"word": rng.choice(["zebra", "quokka", "axolotl"]) + str(rng.randrange(99))})

        def reset(self, task, seed):
            self.word = task.data["word"]
            return f"say {self.word}"

        def expert_action(self):
            return f"<answer>{self.word}</answer>"

        def step(self, action):
            ok = action == self.expert_action()
            return StepResult("right" if ok else "wrong", float(ok), True, False, success=ok)

    register("corpus-two-method", Echo, overwrite=True)
    try:
        texts = default_corpus(samples_per_env=3, env_ids=("corpus-two-method",))
    finally:
        registry._REGISTRY.pop("corpus-two-method")
    assert texts[0] == "Repeat the word."
    played = texts[1:]
    assert len(played) == 9 and all(played[i].startswith("say ") for i in (0, 3, 6))
    assert played[1] == f"<answer>{played[0][4:]}</answer>" and played[2] == "right"
