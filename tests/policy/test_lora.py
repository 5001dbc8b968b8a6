"""LoRA with peft: a fresh adapter leaves the policy unchanged, the frozen base is the KL
reference without a copy, checkpoints hold a merged model and the adapter, a run resumes exactly."""

from __future__ import annotations

import hashlib

import pytest
import torch
from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.app.setup import load_run_config
from turnforge.config import LoraConfig
from turnforge.envs.levels import LevelEnv, Outcome
from turnforge.envs.registry import register
from turnforge.errors import UserError
from turnforge.policy.lora import ADAPTER_DIR, FrozenBase, add_lora, trainable_parameters
from turnforge.policy.model import load_policy
from turnforge.runs import RunDir
from turnforge.train.run_dir.checkpoint import save_model

IDS = torch.tensor([[5, 9, 13, 7, 3, 11, 2, 4]])


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _nudge(model):  # train-like change of the adapter weights only
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))


def test_a_fresh_adapter_leaves_the_policy_unchanged_and_only_adapters_train(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    before = _logits(policy.model)
    add_lora(policy, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), seed=0, stage="rl")
    assert torch.equal(_logits(policy.model), before)  # B starts at zero
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert len(trainable_parameters(policy.model)) == len(names) == 2 * 2 * TINY_TEST_SHAPE["num_hidden_layers"]
    # the same seed and stage give the same adapter; another stage another
    other = load_policy(tiny_model_dir)
    add_lora(other, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), seed=0, stage="rl")
    a = dict(policy.model.named_parameters())
    b = dict(other.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in names)
    third = load_policy(tiny_model_dir)
    add_lora(third, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), seed=0, stage="bc")
    c = dict(third.model.named_parameters())
    assert not all(torch.equal(a[n], c[n]) for n in names)


def test_unknown_target_modules_name_the_ones_the_model_has(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    with pytest.raises(UserError, match=r"\['query_key_value'\] do not exist in the model; its linear modules: .*q_proj"):
        add_lora(policy, LoraConfig(r=4, target_modules=["q_proj", "query_key_value"]), seed=0, stage="rl")


def test_frozen_base_is_the_shared_weights_with_adapters_off(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    base = _logits(policy.model)
    add_lora(policy, LoraConfig(r=4), seed=0, stage="rl")
    _nudge(policy.model)
    assert not torch.equal(_logits(policy.model), base)
    reference = FrozenBase(policy.model)
    assert torch.equal(_logits(reference), base)
    assert not torch.equal(_logits(policy.model), base)  # the adapters are back on after the call
    assert list(reference.named_parameters()) == [] and next(reference.parameters()) is next(policy.model.parameters())


def test_a_lora_checkpoint_holds_a_merged_model_and_the_adapter(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = load_policy(tiny_model_dir)
    add_lora(policy, LoraConfig(r=4), seed=0, stage="rl")
    _nudge(policy.model)
    want = _logits(policy.model)
    ck = save_model(RunDir(tmp_path), policy, RunDir(tmp_path).checkpoint("final"))
    merged = AutoModelForCausalLM.from_pretrained(ck)
    torch.testing.assert_close(_logits(merged), want, atol=1e-5, rtol=1e-5)  # W + s BA folded: float rounding only
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ck / ADAPTER_DIR)
    assert torch.equal(_logits(adapter), want)  # base + adapter: bit for bit
    assert _logits(policy.model).equal(want)  # saving did not merge the live model


class Coin(LevelEnv):
    """Any text is a valid action; its reward (0, 1 or 2) depends on the sampled characters, so
    groups have reward variance and RL updates the adapter from the first iteration."""

    instructions = "Say anything."
    valid_actions_text = "any text"

    def generate_level(self, level_seed):
        return level_seed

    def level_key(self, level):
        return str(level)

    def initial_state(self, level, rng):
        return {"t": 0}

    def render(self):
        return f"turn {self.state['t']}: say anything"

    def parse_action(self, text):
        return text

    def apply(self, action):
        self.state["t"] += 1
        reward = float(sum(map(ord, action)) % 3)
        return Outcome(reward=reward, terminated=self.state["t"] >= 3, success=reward == 2)


register("test-coin", Coin, overwrite=True)

SHAPE = [f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()]
RL_RUN = [
    *SHAPE, *NO_FLYWHEEL, "env.id=test-coin", "env.kwargs={}", "check_env=false", "bc.enabled=false", "model.lora.r=4",
    "rl.iterations=3", "rl.tasks_per_iteration=2", "rl.group_size=4", "rl.minibatch_size=16", "rl.lr=0.01",
    "rl.kl_coef=0.1", "rollout.max_turns=3", "eval.episodes=4", "eval.every=0", "checkpoint_every=1",
]


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_bc_under_lora_is_merged_into_the_bc_checkpoint(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    train(load_config("sokoban-tiny", [*SHAPE, *NO_FLYWHEEL, "model.lora.r=4", "bc.num_demos=6", "bc.epochs=1",
                                       "bc.lr=0.01", "rl.iterations=0", "eval.episodes=2"]), out, live=False)
    bc = out / "checkpoints" / "bc"
    assert not (bc / ADAPTER_DIR).exists()  # a plain HF directory: the adapter is folded in
    base, after_bc = load_file(out / "base_model" / "model.safetensors"), load_file(bc / "model.safetensors")
    assert base.keys() == after_bc.keys() and any(not torch.equal(base[k], after_bc[k]) for k in base)


@pytest.mark.slow
def test_a_lora_run_trains_adapters_only_and_resumes_exactly(tmp_path):
    from safetensors.torch import load_file

    ref = tmp_path / "ref"
    summary = train(load_config("sokoban-tiny", RL_RUN), ref, live=False)
    assert 0 < summary.trainable_parameters < summary.num_parameters / 5
    final, bc = ref / "checkpoints" / "final", ref / "checkpoints" / "bc"
    adapter = load_file(final / ADAPTER_DIR / "adapter_model.safetensors")
    assert adapter and any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)  # RL moved B off zero
    assert _sha(final / "model.safetensors") != _sha(bc / "model.safetensors")
    # interrupted after iteration 1, resumed: the same adapter and merged weights, bit for bit
    out = tmp_path / "run"
    train(load_config("sokoban-tiny", RL_RUN), out, live=False, stop_after=1)
    resumed = train(load_run_config(out), out, resume=True, live=False)
    assert resumed.rl_iterations == 3
    for name in (f"{ADAPTER_DIR}/adapter_model.safetensors", "model.safetensors"):
        assert _sha(out / "checkpoints" / "final" / name) == _sha(final / name), name
    assert resumed.eval_after_rl == summary.eval_after_rl
