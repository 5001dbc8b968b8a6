"""Reasoning templates: their behaviour found by rendering, both history policies token-exact
(every sample's ids are the template's rendering of its turn's prompt plus the sampled ids), the
thinking budget, and env actions parsed from the answer only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import inline_engine
from turnforge.config import RolloutConfig
from turnforge.errors import UserError
from turnforge.policy.generate import Generation
from turnforge.policy.model import ChatFormat, load_policy
from turnforge.policy.thinking import drops_before
from turnforge.policy.tiny import THINKING_CHAT_TEMPLATE
from turnforge.rollout.actors import NO_PROBE, ActorInput
from turnforge.rollout.budget import think_then_answer
from turnforge.rollout.context import EpisodeContext, PromptSpec
from turnforge.rollout.engine import EpisodeRequest

#: DeepSeek-R1's way: every assistant message keeps only what follows its last </think>, newlines included.
R1_STYLE = THINKING_CHAT_TEMPLATE.replace("and (loop.last or reasoning)", "and false").replace(".lstrip('\\n')", "")
#: DeepSeek-R1's newer templates: the generation prompt opens the thinking, so the model's turn starts inside it.
R1_OPENS = R1_STYLE.replace("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}",
                            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}")
#: Not a dropped thinking: earlier thinking replaced by a marker.
REPLACES = THINKING_CHAT_TEMPLATE.replace("content.split('</think>')[-1].lstrip('\\n')", "'[thought] ' + content.split('</think>')[-1]")
#: No thinking markers; the last assistant message is written differently from earlier ones.
LAST_DIFFERS = ("{%- for m in messages %}{%- if m['role'] == 'assistant' and loop.last %}{{- '<|im_start|>assistant\\nFINAL '"
                " + m['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


#: Qwen3's chat template (tool schemas left out): thinking kept after the last user query, tool
#: results as <tool_response> blocks in user turns.
QWEN3 = """{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""


def _chat(model_dir, template: str | None = None) -> ChatFormat:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if template is not None:
        tok.chat_template = template
    return ChatFormat(tok)


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3", "tiny-r1-opens", "smollm2"])
def chat(request):
    if request.param == "smollm2":
        return _chat(request.getfixturevalue("smollm2_thinking_dir"))
    template = {"tiny-qwen3": QWEN3, "tiny-r1-opens": R1_OPENS}.get(request.param)
    return _chat(request.getfixturevalue("tiny_thinking_dir"), template)


def test_the_templates_behaviour_is_found_by_rendering(tiny_model_dir, tiny_thinking_dir):
    assert _chat(tiny_model_dir).thinking is None  # ChatML: no markers
    qwen3 = _chat(tiny_thinking_dir).thinking
    assert qwen3 is not None and qwen3.drops and qwen3.lstrip and not qwen3.prompt_opens
    r1 = _chat(tiny_thinking_dir, R1_STYLE).thinking
    assert r1 is not None and r1.drops and not r1.lstrip and not r1.prompt_opens
    opens = _chat(tiny_thinking_dir, R1_OPENS)  # the generation prompt opens thinking: supported
    assert opens.thinking.prompt_opens and opens.thinking.drops and opens.opened == "<think>\n"
    assert opens.continuing("<think>\nT\n</think>\n\nA") == "T\n</think>\n\nA" and opens.continuing("A") == "A"
    with pytest.raises(UserError, match=r"rewrites an earlier assistant message .* as '\[thought\] ") as err:
        _chat(tiny_thinking_dir, REPLACES)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="re-renders earlier turns when a message is added .*FINAL") as err:
        _chat(tiny_thinking_dir, LAST_DIFFERS)
    assert "\n" not in str(err.value)
    # Qwen3 keeps thinking before tool results (until the next user message): found by rendering too
    for chat in (_chat(tiny_thinking_dir), _chat(tiny_thinking_dir, QWEN3)):
        assert chat.thinking.drops and chat.thinking.lstrip
        assert drops_before(chat, "user") and not drops_before(chat, "tool")
    assert _chat(tiny_thinking_dir, QWEN3).turn("tool")  # a <tool_response> inside a user turn


def test_the_history_policies_are_the_configs_choices():
    from turnforge.app.config import VARIANT_KEYS
    from turnforge.rollout.history import HISTORIES

    (key,) = [v for v in VARIANT_KEYS if v.key == "rollout.history"]
    assert set(key.choices()) == set(HISTORIES)


def _messages(spec, observations, actions_text):
    msgs = [{"role": "system", "content": spec.system}]
    for i, obs in enumerate(observations):
        msgs.append({"role": "user", "content": obs})
        if i < len(actions_text):
            msgs.append({"role": "assistant", "content": actions_text[i]})
    return msgs


WORD = st.sampled_from(["up", "left", "box", "wall", "12", "goal", "move", "the", "x"])
TEXT = st.lists(WORD, min_size=1, max_size=6).map(" ".join)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(TEXT, TEXT, TEXT, st.booleans(), st.integers(0, 2**31)), min_size=1, max_size=4),
       context=st.sampled_from(["full_history", "window"]), history=st.sampled_from(["as_rendered", "as_sampled"]))
def test_every_sample_is_the_templates_rendering_of_its_prompt_plus_the_sampled_ids(chat, turns, context, history):
    """A sampled action is either canonical text (then the prompt is exactly the template's rendering,
    tokenized) or random ids (then the prompt decodes to the template's rendering)."""
    tok = chat.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    think = chat.thinking
    safe = [i for i in range(min(len(tok), 400)) if i not in tok.all_special_ids and not set(tok.decode([i])) & set("<>")
            and i not in (think.open_id, think.close_id)]
    cfg = RolloutConfig(context=context, history=history, history_window=8, max_new_tokens=64, max_context_tokens=4096)
    spec = PromptSpec(system="Play.")
    ctx = EpisodeContext(chat, cfg, spec, (), "t0")
    observations, texts, prompts, canonical = [], [], [], True
    for obs, thought, answer, random_ids, seed in turns:
        observations.append(obs)
        ctx.observe(obs)
        prompts.append(ctx.prompt())
        if random_ids:  # any ids a sampler could produce, the newline handling included
            rng = np.random.default_rng(seed)
            body = [int(i) for i in rng.choice(safe, 3)]
            tail = [int(i) for i in rng.choice(safe, 3)]
            opening = () if think.prompt_opens else (think.open_id,)
            ids = (*opening, *body, think.close_id, *tail, im_end)
            canonical = False
        else:  # (a prompt that opens thinking: the model's turn starts inside it)
            ids = chat.encode(chat.continuing(f"<think>\n{thought}\n</think>\n\n{answer}")) + (im_end,)
        assert (think.open_id in ids) != think.prompt_opens and think.close_id in ids
        texts.append(tok.decode(ids[:-1], skip_special_tokens=False))
        ctx.act(ids, tuple(-1.0 for _ in ids), 0)
        if history == "as_rendered":  # this turn's sample: its prompt as the template renders it, then the sampled ids
            sample = ctx.samples[-1]
            n = len(prompts[-1])
            assert tuple(sample.token_ids[n:]) == ids and sample.loss_mask[n:].all() and not sample.loss_mask[:n].any()
            rendered = chat._render(_messages(spec, observations, texts[:-1]), gen=True)
            assert tok.decode(prompts[-1], skip_special_tokens=False) == rendered
            if canonical:
                assert prompts[-1] == tuple(tok(rendered, add_special_tokens=False)["input_ids"])
    samples = ctx.finish()
    if history == "as_sampled" and context == "full_history":  # one sample: every prompt as the sampler saw it
        assert len(samples) == 1
        for p in prompts:
            assert tuple(samples[0].token_ids[: len(p)]) == p
    else:
        assert [s.turn_index for s in samples] == list(range(len(turns)))


class Scripted:
    """A token actor that plays fixed sequences: ``script[trajectory_id]`` = the ids it would sample
    in one go; a second call (``part='answer'``) after a forced close samples ``answer`` instead."""

    needs_tokens, version = True, 0

    def __init__(self, script, answer, stop):
        self.script, self.answer, self.stop, self.base, self.calls = script, answer, stop, {}, []

    def probe(self, task, trajectory_id, turn):
        return NO_PROBE

    def act(self, inputs):
        out = []
        self.calls.append([(x.part, x.max_new_tokens) for x in inputs])
        for x in inputs:
            if not x.part:
                self.base[x.trajectory_id] = len(x.prompt)
            done = len(x.prompt) - self.base[x.trajectory_id]
            seq = self.script[x.trajectory_id]
            if x.part and x.prompt[-3:] == self.forced:
                seq, done = self.answer, 0
            ids = tuple(seq[done: done + x.max_new_tokens])
            out.append(Generation(ids, tuple(-0.5 for _ in ids), self.stop in ids))
        return out


def test_a_thinking_budget_closes_thinking_and_leaves_the_answer_its_own_budget(tiny_thinking_dir):
    chat = _chat(tiny_thinking_dir)
    t = chat.thinking
    stop = chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    a, b = chat.encode("up"), chat.encode("left wall box")
    script = {"long": (t.open_id,) + b * 5,  # never closes its thinking
              "short": (t.open_id, *a, t.close_id, *a, stop),  # closes and answers within the budget
              "slow": (t.open_id, t.close_id, *b * 4, stop),  # closes at once, then a long answer
              "plain": (*a, stop),  # no thinking
              "again": (t.open_id, t.close_id, *a, t.open_id, *b)}  # thinks again inside its answer: cut there
    actor = Scripted(script, (*a, stop), stop)
    actor.forced = t.forced_close
    inputs = [ActorInput((1, 2, 3), None, k, 0, None, max_new_tokens=None) for k in script]  # type: ignore[arg-type]
    out = dict(zip(script, think_then_answer(actor, inputs, t, budget=6, answer_tokens=4)))
    long, forced = out["long"]
    assert forced == (6, 6 + len(t.forced_close)) and long.ids == script["long"][:6] + t.forced_close + (*a, stop)
    assert np.isnan(long.logprobs[6:forced[1]]).all() and long.stopped
    assert out["short"] == (Generation(script["short"], tuple(-0.5 for _ in script["short"]), True), (0, 0))
    slow, forced = out["slow"]  # 4 answer tokens in the first call: cut there, no second call
    assert forced == (0, 0) and slow.ids == script["slow"][:6] and not slow.stopped
    assert out["plain"][0].ids == (*a, stop)
    assert out["again"] == (Generation((t.open_id, t.close_id, *a), (-0.5,) * (2 + len(a)), False), (0, 0))
    assert actor.calls == [[("", 6)] * 5, [("answer", 4)]]


def _over_the_budget(policy, history: str):
    """Two 3-turn echo episodes whose every turn thinks past a budget of 5 tokens (from its first
    sampled token where the prompt opens the thinking), then answers "up": the env gets the answer
    only, every turn is cut. Returns the engine (to close), the trajectories, the stats, the answer's ids."""
    chat, t = policy.chat, policy.chat.thinking
    stop = policy.stop_ids[0]
    thought, answer = chat.encode("left wall box move"), chat.encode("up")
    opening = () if t.prompt_opens else (t.open_id,)
    script = {f"t{i}": (*opening, *thought * 3) for i in range(2)}
    cfg = RolloutConfig(context="full_history", history=history, max_turns=3, max_new_tokens=4, thinking_budget=5)
    engine = inline_engine(policy, "test-echo", cfg, 2, episode_len=3)
    actor = Scripted(script, (*answer, stop), stop)
    actor.forced = t.forced_close
    reqs = [EpisodeRequest(engine.env.task("train", i), i, "g", f"t{i}") for i in range(2)]
    trajs, stats = engine.play(reqs, actor)
    assert all(turn.action_text == "up" for tr in trajs for turn in tr.turns)  # the env never sees the thinking
    assert stats.turns == 6 and stats.thinking_cuts == 6 and stats.thinking_tokens == 6 * 5
    return engine, trajs, stats, answer


def test_the_engine_sends_the_env_the_answer_only_and_counts_thinking(tiny_thinking_dir):
    policy = load_policy(tiny_thinking_dir)
    t = policy.chat.thinking
    for history in ("as_sampled", "as_rendered"):
        engine, trajs, stats, answer = _over_the_budget(policy, history)
        assert stats.answer_tokens == 6 * (len(answer) + 1)
        for tr in trajs:
            samples = tr.samples
            assert len(samples) == (1 if history == "as_sampled" else 3)
            for s in samples:  # forced closes are context: never trained, no logprob
                assert np.isnan(s.logprobs[s.loss_mask == 0]).all() and not np.isnan(s.logprobs[s.loss_mask == 1]).any()
            if history == "as_sampled":
                assert samples[0].run_turns == (0, 0, 1, 1, 2, 2)  # each turn: its thinking, then its answer
            else:  # later prompts show earlier turns without their thinking
                assert t.open_id not in samples[2].token_ids[: len(samples[2].token_ids) - 5 - 3 - len(answer) - 1]
        engine.close()


class Thoughtful:
    """A text actor (an expert) whose every action is a thought and a move."""

    needs_tokens, version = False, 0

    def probe(self, task, trajectory_id, turn):
        return NO_PROBE

    def act(self, inputs):
        return ["<think>\nplan\n</think>\n\nup" for _ in inputs]


def test_a_template_whose_generation_prompt_opens_thinking_trains_token_exact(tiny_thinking_dir):
    """The model's turn starts inside its thinking: sampled ids have no open marker, the budget
    still closes it, an expert's written thought is not opened twice, and under as_rendered the
    earlier answers follow the assistant header without the prompt's opening, as the template renders."""
    policy = load_policy(tiny_thinking_dir)
    policy.tokenizer.chat_template = R1_OPENS
    policy.chat = ChatFormat(policy.tokenizer)
    for history in ("as_sampled", "as_rendered"):
        engine, trajs, _, _ = _over_the_budget(policy, history)  # thinking from the turn's first token
        expert, _ = engine.play([EpisodeRequest(engine.env.task("train", 5), 5, "g", "e5")], Thoughtful())
        for tr in trajs + expert:
            for sample in tr.samples:
                text = policy.tokenizer.decode(sample.token_ids, skip_special_tokens=False)
                prompt = policy.tokenizer.decode(sample.token_ids[: int(np.argmax(sample.loss_mask))], skip_special_tokens=False)
                assert "<think>\n<think>" not in text and prompt.endswith("<|im_start|>assistant\n<think>\n")
                if history == "as_sampled":  # every turn's thinking, opened by its prompt
                    assert text.count("<think>") == text.count("<|im_start|>assistant\n") == 3
                else:  # earlier answers right after their header, as the template renders them (the property test)
                    assert text.count("<think>") == 1  # the prompt's own opening only
                    assert sample.turn_index == 0 or "<|im_start|>assistant\n\n\nup<|im_end|>" in text
        assert "<think>\nplan\n</think>" in policy.tokenizer.decode(expert[0].samples[0].token_ids)
        engine.close()


def test_a_thinking_budget_needs_thinking_markers(tiny_policy):
    cfg = RolloutConfig(context="full_history", thinking_budget=8)
    with pytest.raises(UserError, match="rollout.thinking_budget=8 but the chat template .* has no thinking markers"):
        inline_engine(tiny_policy, "test-echo", cfg, 1)


def test_a_model_whose_template_rewrites_earlier_turns_is_refused_before_any_work(tmp_path, tiny_thinking_dir, monkeypatch,
                                                                                    capsys):
    import shutil

    from transformers import AutoTokenizer

    from helpers import run_main

    bad = Path(shutil.copytree(tiny_thinking_dir, tmp_path / "bad"))
    tok = AutoTokenizer.from_pretrained(bad, local_files_only=True)
    tok.chat_template = REPLACES
    tok.save_pretrained(bad)
    code, _, stderr = run_main(["train", "sokoban-hf", f"model.path={bad}", "--out", "run"], tmp_path, monkeypatch, capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "rewrites an earlier assistant message" in lines[0], stderr
    assert not (tmp_path / "run").exists()
