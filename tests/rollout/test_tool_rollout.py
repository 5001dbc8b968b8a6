"""Tool envs in rollouts: tool schemas in the system prompt, results as tool messages in the
context (loss mask 0), token-exact actions; sandbox faults are infrastructure failures."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

from helpers import inline_engine
from turnforge.config import RolloutConfig
from turnforge.envs import make_batch
from turnforge.errors import UserError
from turnforge.policy.model import ChatFormat
from turnforge.rollout.actors import ExpertActor, PolicyActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.sandbox import SandboxError


def _requests(env, n):
    return [EpisodeRequest(env.task("train", i), i, f"g{i}", f"t{i}") for i in range(n)]


def _runs(sample):
    """The maximal runs of equal loss-mask value, as (mask, ids)."""
    out, ids, mask = [], sample.token_ids.tolist(), sample.loss_mask.tolist()
    for tid, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(tid)
        else:
            out.append((m, [tid]))
    return out


@pytest.mark.parametrize("include_instructions", [True, False])
def test_full_history_tool_episode_is_pieces_of_the_template(tiny_policy, include_instructions):
    cfg = RolloutConfig(context="full_history", max_turns=4, max_new_tokens=64, max_context_tokens=2048,
                        include_instructions=include_instructions)
    envs = make_batch("calculator", 3, max_tool_calls=1)
    trajs, _ = inline_engine(tiny_policy, envs, cfg).play(_requests(envs[0], 3), ExpertActor())
    chat = tiny_policy.chat
    system = envs[0].instructions if include_instructions else None
    tools = json.dumps(list(envs[0].tools)) if include_instructions else ""
    head, tail = chat.start(system, tools)
    tool_head, tool_tail = chat.turn("tool")
    for t in trajs:
        assert t.success and t.num_turns == 2 and t.turns[0].info["n_tool_calls"] == 1
        (s,) = t.samples
        want = list(head) + list(chat.encode(t.turns[0].observation)) + list(tail)
        for i, turn in enumerate(t.turns):
            want += list(chat.encode(turn.action_text)) + [tiny_policy.stop_ids[0]] + list(chat.close_after("<|im_end|>"))
            if i + 1 < t.num_turns:
                want += list(tool_head) + list(chat.encode(t.turns[i + 1].observation)) + list(tool_tail)
        assert s.token_ids.tolist() == want
        runs = _runs(s)
        actions = [tiny_policy.tokenizer.decode(ids, skip_special_tokens=True) for m, ids in runs if m == 1]
        assert actions == [turn.action_text for turn in t.turns]  # only the actions are trained on
        text = tiny_policy.tokenizer.decode(s.token_ids.tolist())
        assert ("<tools>" in text) == include_instructions and "<|im_start|>tool\n" in text


def test_window_context_puts_tool_results_in_tool_messages(tiny_policy):
    cfg = RolloutConfig(context="window", history_window=1, max_turns=4, max_new_tokens=64, max_context_tokens=2048,
                        include_instructions=False)
    envs = make_batch("calculator", 2)
    trajs, _ = inline_engine(tiny_policy, envs, cfg).play(_requests(envs[0], 2), ExpertActor())
    chat = tiny_policy.chat
    head, tail = chat.start(None, "")
    tool_head, tool_tail = chat.turn("tool")
    for t in trajs:
        first, second = t.samples
        a1 = list(chat.encode(t.turns[0].action_text)) + [tiny_policy.stop_ids[0]]
        assert first.token_ids.tolist() == list(head) + list(chat.encode(t.turns[0].observation)) + list(tail) + a1
        prompt = (list(head) + list(chat.encode(t.turns[0].observation)) + list(tail) + a1
                  + list(chat.close_after("<|im_end|>")) + list(tool_head) + list(chat.encode(t.turns[1].observation))
                  + list(tool_tail))
        assert second.token_ids.tolist()[: len(prompt)] == prompt and second.loss_mask[: len(prompt)].sum() == 0


def test_sampled_tool_turns_are_token_exact(tiny_policy):
    cfg = RolloutConfig(context="full_history", max_turns=3, max_new_tokens=12, max_context_tokens=1024)
    envs = make_batch("calculator", 4)
    actor = PolicyActor(tiny_policy, 12, 1.0, torch.Generator().manual_seed(0))
    trajs, stats = inline_engine(tiny_policy, envs, cfg).play(_requests(envs[0], 4), actor)
    assert stats.infra_failures == 0
    for t in trajs:
        (s,) = t.samples
        assert int(s.loss_mask.sum()) == sum(len(ids) for m, ids in _runs(s) if m == 1)
        assert np.isfinite(s.logprobs[s.loss_mask == 1]).all() and np.isnan(s.logprobs[s.loss_mask == 0]).all()
        assert all(turn.invalid_action for turn in t.turns)  # an untrained model writes no valid call


def test_sandbox_fault_is_an_infra_failure_and_a_crashing_program_is_not(tiny_policy, monkeypatch):
    cfg = RolloutConfig(context="full_history", max_turns=4, max_new_tokens=64, max_context_tokens=4096,
                        include_instructions=False)
    envs = make_batch("python-tasks", 3)

    def broken(*args, **kwargs):
        raise SandboxError("bwrap exited with status 1 before the program started")

    monkeypatch.setattr(envs[1].sandbox, "run", broken)
    trajs, stats = inline_engine(tiny_policy, envs, cfg).play(_requests(envs[0], 3), ExpertActor())
    assert stats.infra_failures == 1 and "SandboxError: bwrap exited" in trajs[1].infra_failure
    assert trajs[0].success and trajs[2].success and trajs[0].infra_failure is None

    envs = make_batch("python-tasks", 1)  # the agent's program crashes: a tool result, the episode goes on
    start = envs[0].initial_state
    monkeypatch.setattr(envs[0], "initial_state",
                        lambda level, rng: start(dataclasses.replace(level, program="raise SystemExit(5)"), rng))
    trajs, stats = inline_engine(tiny_policy, envs, cfg).play(_requests(envs[0], 1), ExpertActor())
    assert stats.infra_failures == 0 and trajs[0].infra_failure is None
    assert trajs[0].turns[1].observation == "exit code 5" and trajs[0].turns[0].info["n_tool_errors"] == 1


# A Qwen2.5-style template (written for this test): tools listed in the system message, tool
# results wrapped in <tool_response> inside a user turn, consecutive tool results merged.
QWEN_STYLE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{{- messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}"
    "{{- '\\n\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (m['role'] == 'system' and tools) %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_wraps_tool_results_in_user_turns(tiny_policy):
    tok = copy.deepcopy(tiny_policy.tokenizer)
    tok.chat_template = QWEN_STYLE
    chat = ChatFormat(tok)
    head, tail = chat.turn("tool")
    assert tok.decode(head) == "<|im_start|>user\n<tool_response>\n"
    assert tok.decode(tail) == "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    schema = make_batch("calculator", 1)[0].tools
    head, _ = chat.start(None, json.dumps(list(schema)))
    assert '"name": "calculator"' in tok.decode(head) and tok.decode(head).startswith("<|im_start|>system\nYou are a helpful")


def test_templates_without_tool_support_are_refused_clearly(tiny_policy):
    tok = copy.deepcopy(tiny_policy.tokenizer)
    tok.chat_template = (
        "{%- for m in messages %}{%- if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('roles must be system, user or assistant') }}{%- endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    chat = ChatFormat(tok)
    with pytest.raises(UserError, match="cannot render a 'tool' message: roles must be system, user or assistant"):
        chat.turn("tool")
    with pytest.raises(UserError, match="does not render tools; the env has tools"):
        chat.start(None, json.dumps([{"type": "function", "function": {"name": "f"}}]))
