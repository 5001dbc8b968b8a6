"""Tool envs: schemas from typed functions, tool-call parsing, bad input as counted error
observations, output cleaning, the calculator and the sandboxed Python tool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turnforge.envs import make
from turnforge.envs.base import InvalidAction
from turnforge.envs.tool import ToolCall, clean_output, parse_tool_calls
from turnforge.envs.tool.formats import TOOL_FORMATS
from turnforge.envs.tool.calculator import evaluate, left_to_right
from turnforge.errors import UserError


def call(name, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# ---------------------------------------------------------------- parsing
def test_hermes_calls_are_parsed_in_order():
    text = 'Let me check. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call> {"name": "b"} </tool_call>'
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    assert parse_tool_calls("no calls here") == []
    # arguments given as a JSON string (some models do this) are decoded
    assert parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>') == [ToolCall("a", {"x": 2})]


def test_json_format_is_the_whole_message():
    assert parse_tool_calls(' {"name": "a", "parameters": {"x": 1}} ', "json") == [ToolCall("a", {"x": 1})]
    assert parse_tool_calls("<answer>3</answer>", "json") == []


@pytest.mark.parametrize("text, reason", [
    ('<tool_call>{"name": "a", "arguments": {}}', "unbalanced <tool_call> tags"),
    ("<tool_call>{name: a}</tool_call>", "not valid JSON (Expecting property name enclosed in double quotes at character 1)"),
    ("<tool_call>[1, 2]</tool_call>", 'JSON object with a string "name"'),
    ('<tool_call>{"name": 3}</tool_call>', 'JSON object with a string "name"'),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "\"arguments\" of 'a' must be a JSON object"),
    ('<tool_call>{"name": "a", "arguments": "x=1"}</tool_call>', "string that is not a JSON object"),
])
def test_malformed_calls_say_what_is_wrong(text, reason):
    with pytest.raises(InvalidAction, match=None) as err:
        parse_tool_calls(text)
    assert reason in str(err.value)


def test_clean_output_truncates_and_flags_binary():
    assert clean_output("fine\n\ttext", 100) == ("fine\n\ttext", False, False)
    text, truncated, not_text = clean_output("x" * 150, 100)
    assert truncated and not not_text and text == "x" * 100 + "\n[output truncated: 50 more characters]"
    text, truncated, not_text = clean_output("a\x00b\x1b", 100)
    assert text == "a\\x00b\\x1b" and not_text and not truncated
    assert clean_output(b"\xff\xfeok".decode("utf-8", "replace"), 100)[2]


# ---------------------------------------------------------------- the tool env contract
def test_tools_are_json_schemas_of_typed_functions():
    (schema,) = make("calculator").tools
    assert schema == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": 'integers, + - * / and parentheses, e.g. "(3+4)*2"'}},
                "required": ["expression"],
            },
        },
    }
    assert make("calculator").observation_role == "tool" and make("sokoban").observation_role == "user"


@pytest.mark.parametrize("action, reason", [
    (call("calc", expression="1+2"), "unknown tool 'calc'; tools: 'calculator'"),
    (call("calculator"), "bad arguments for calculator: expression: Missing required argument"),
    (call("calculator", expression=3), "bad arguments for calculator: expression: Input should be a valid string"),
    (call("calculator", expression="1", base=10), "bad arguments for calculator: base: Unexpected keyword argument"),
    ("I would compute 6*2", "no tool call and no answer found"),
    (call("calculator", expression="6*2") + "<answer>6*2</answer>", "both tool calls and an answer in one turn"),
    ("<tool_call>{oops}</tool_call>", "tool call is not valid JSON"),
])
def test_bad_calls_are_counted_invalid_actions_with_the_reason(action, reason):
    env = make("calculator", invalid_action_penalty=-0.3)
    first = env.reset(seed=0)
    r = env.step(action)
    assert r.invalid_action and r.reward == -0.3 and not r.terminated
    assert r.observation.startswith(f"Error: {reason}")
    assert "<tool_call>" in r.observation  # says what a valid action looks like
    assert env.render() == first and env.state["calls"] == ()  # nothing happened


MALFORMED = {  # a call each format reads as one, and cannot parse
    "hermes": "<tool_call>{oops}</tool_call>",
    "json": '{"name": 3}',
    "llama3_json": '{"name": "calculator", "parameters": {"expression": "1+2"}} and then',
    "qwen3_coder_xml": "<tool_call>\n<function=calculator>\n<parameter=expression>\n1+2\n</function>\n</tool_call>",
    "mistral": '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1+2"}}',
    "mistral_v11": '[TOOL_CALLS]calculator{"expression": "1+2"}',
}


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_every_format_calls_tools_and_a_malformed_call_is_a_counted_invalid_action(fmt):
    env = make("calculator", tool_call_format=fmt, invalid_action_penalty=-0.3, max_tool_calls=2)
    first = env.reset(seed=0)
    r = env.step(MALFORMED[fmt])
    assert r.invalid_action and r.reward == -0.3 and not r.terminated  # counted, never dropped
    assert r.observation.startswith("Error: ") and TOOL_FORMATS[fmt].example in r.observation
    assert env.render() == first and env.state["calls"] == ()
    r = env.step(env.call_text("calculator", {"expression": "2*3"}))
    assert not r.invalid_action and r.observation == "6" and r.info["n_tool_calls"] == 1
    assert env.state["calls"] == (("calculator", '{"expression": "2*3"}', "6"),)


def test_tool_call_budget_is_enforced():
    env = make("calculator", max_tool_calls=1)
    env.reset(seed=0)
    assert not env.step(call("calculator", expression="1+1")).invalid_action
    r = env.step(call("calculator", expression="2+2"))
    assert r.invalid_action and "only 0 of 1 tool calls left; answer now" in r.observation


def test_calculator_episode_and_counters():
    env = make("calculator")
    env.reset(seed=3)
    level = env.state["level"]
    r = env.step(call("calculator", expression="1/0"))
    assert r.observation == "error: division by zero" and not r.invalid_action
    assert r.info == {"n_tool_calls": 1, "n_tool_errors": 1, "n_output_truncated": 0, "n_output_not_text": 0}
    env = make("calculator", max_tool_calls=2)
    env.reset(seed=3)
    r = env.step(call("calculator", expression=level.solution) + call("calculator", expression="2*3"))
    assert r.observation == f"[1] calculator: {level.target}\n\n[2] calculator: 6" and r.info["n_tool_calls"] == 2
    r = env.step(f"<answer>{level.solution}</answer>")
    assert r.terminated and r.success and r.reward == 1.0


def test_calculator_arithmetic_is_exact_and_safe():
    assert evaluate("(3+4)*2") == (14, [3, 4, 2])
    assert evaluate("7/2")[0] * 2 == 7 and evaluate("-3+5")[0] == 2
    for bad in ["__import__('os').system('true')", "2**99999", "x+1", "1 +", "'a'*3", "1.5*2"]:
        with pytest.raises(ValueError):
            evaluate(bad)
    with pytest.raises(ValueError, match="longer than 200"):
        evaluate("1+" * 101 + "1")


def test_calculator_scoring_needs_each_number_once():
    env = make("calculator")
    env.reset(seed=0)
    level = env.state["level"]
    a, b = level.numbers
    assert env.score(level, level.solution) == (1.0, True)
    assert env.score(level, str(level.target)) == (0.0, False)  # the numbers must be used
    assert env.score(level, f"{a}+{b}+0") == (0.0, False)
    assert env.score(level, "((") == (0.0, False)


def test_countdown_levels_are_solvable_left_to_right():
    assert left_to_right((6, 2), "+-*") == [("2*6", 12), ("2+6", 8), ("6*2", 12), ("6+2", 8), ("6-2", 4)]
    assert ("(1+2)*3", 9) in left_to_right((1, 2, 3), "+*")
    env = make("calculator", num_numbers=3, ops="+-*/")
    for i in range(50):
        level = env.level_for(env.task("train", i))
        assert evaluate(level.solution)[0] == level.target and sorted(evaluate(level.solution)[1]) == sorted(level.numbers)


def test_guess_expert_checks_then_answers():
    env = make("calculator", expert="guess")
    wins = 0
    for i in range(300):
        env.reset(seed=i)
        first = env.expert_action()
        assert first.startswith("<tool_call>")
        r = env.step(first)
        r = env.step(env.expert_action())
        assert r.terminated
        wins += r.success
    assert 0.6 < wins / 300 < 0.8  # 1/3 found by the check, half of the rest by the unverified guess


def test_arithmetic_needs_the_calculator_and_a_plain_number():
    env = make("arithmetic", num_numbers=3)
    level = env.level_for(env.task("train", 0))
    assert evaluate(level.expression)[0] == level.value and len(evaluate(level.expression)[1]) == 3
    assert env.question(level) == f"Expression: {level.expression}"
    env.reset(seed=0)
    first = env.expert_action()  # the oracle copies the expression into a calculator call
    assert first == call("calculator", expression=env.state["level"].expression)
    r = env.step(first)
    assert r.observation == str(env.state["level"].value) and not r.terminated
    r = env.step(env.expert_action())
    assert r.terminated and r.success and r.reward == 1.0
    lvl = env.level_for(env.task("train", 1))
    assert env.score(lvl, f" {lvl.value} ") == (1.0, True)
    assert env.score(lvl, lvl.expression) == (0.0, False)  # the expression is not an answer
    assert env.score(lvl, str(lvl.value + 1)) == (0.0, False)
    guess, wins = make("arithmetic", expert="guess"), 0
    for i in range(50):  # answers without the tool, and wrongly
        guess.reset(seed=i)
        wins += guess.step(guess.expert_action()).success
    assert wins == 0
    with pytest.raises(UserError, match="no /"):
        make("arithmetic", ops="+/")


def test_bad_options_are_user_errors():
    with pytest.raises(UserError, match="unknown expert 'psychic'; valid experts: guess, oracle"):
        make("calculator", expert="psychic")
    with pytest.raises(UserError, match="unknown tool_call_format 'xml'; valid formats: 'hermes', 'json', 'llama3_json', "
                                        "'mistral', 'mistral_v11', 'qwen3_coder_xml'"):
        make("calculator", tool_call_format="xml")
    with pytest.raises(UserError, match="ops must be"):
        make("calculator", ops="+^")
    with pytest.raises(UserError, match="unknown task families"):
        make("python-tasks", families=["chess"])


# ---------------------------------------------------------------- Python in the sandbox
def run(env, code):
    env.reset(seed=0)
    return env.step(call("run_python", code=code))


def test_python_tool_runs_in_the_sandbox():
    env = make("python-tasks")
    r = run(env, "print(6 * 7)")
    assert r.observation == "42" and r.info["n_tool_errors"] == 0
    project = str(Path(__file__).resolve().parents[2])
    r = run(env, f"import os; print(os.path.exists({project!r}), os.path.exists('/tmp'))")
    assert r.observation == "False True"  # the project is not visible (tests/sandbox shows every guarantee)


def test_agent_program_failures_are_observations_not_infra_failures():
    env = make("python-tasks", timeout_s=1.0)
    r = run(env, "print('partial'); raise SystemExit(3)")
    assert r.observation == "partial\nexit code 3" and r.info["n_tool_errors"] == 1 and not r.invalid_action
    r = run(env, "1/0")
    assert "ZeroDivisionError" in r.observation and r.observation.endswith("exit code 1")
    r = run(env, "while True: pass")
    assert r.observation.endswith("killed: timeout limit") and r.info["n_tool_errors"] == 1
    r = run(env, "print('y' * 100000)")
    assert r.info["n_output_truncated"] == 1 and r.observation.endswith("[output truncated: 98000 more characters]")
    r = run(env, "import sys; sys.stdout.buffer.write(b'\\xff\\xfe\\x00ok')")
    assert r.info["n_output_not_text"] == 1 and "\\x00ok" in r.observation


def test_python_expert_solves_every_family():
    env = make("python-tasks")
    for i in range(10):
        env.reset(seed=i)
        while not env.done:
            r = env.step(env.expert_action())
        assert r.success, env.state["level"].question
