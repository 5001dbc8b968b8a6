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
