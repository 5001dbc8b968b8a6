"""The ``turnforge`` command line: train, eval, recipes, envs, check-env, tiny-model.

User errors (unknown recipe/env/key, malformed YAML, wrong types, missing paths) print
one line ``error: ...`` naming the bad input and the valid choices and exit with code 2.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from turnforge.errors import UserError
from turnforge.train.common import NonFiniteLoss

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="turnforge: multi-turn RL for LLM agents in interactive environments.",
)
console = Console()


@app.command(context_settings={"allow_extra_args": False})
def train(
    args: Optional[List[str]] = typer.Argument(None, help="[RECIPE | path.yaml] [key=value ...] (default recipe: sokoban-tiny)"),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (default: runs/<recipe>-<time>)"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this directory from its last checkpoint"),
) -> None:
    """Train a policy: behaviour-cloning warm start, then GRPO, with held-out evaluation."""
    from turnforge.config import load_config, parse_overrides
    from turnforge.train.run import load_run_config, train as run_train

    args = list(args or [])
    if resume is not None:
        if args:
            raise UserError("--resume continues a run with its saved config; drop the recipe and overrides")
        cfg = load_run_config(resume)
        run_train(cfg, resume, resume=True)
        return
    recipe = "sokoban-tiny"
    if args and "=" not in args[0]:
        recipe = args.pop(0)
    parse_overrides(args)  # validates the key=value form before anything heavy runs
    cfg = load_config(recipe, args)
    run_dir = out or Path("runs") / f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_train(cfg, run_dir)


@app.command()
def recipes() -> None:
    """List the shipped recipes."""
    import yaml

    from turnforge.config import list_recipes

    table = Table("recipe", "env", "model", "description")
    for name, path in list_recipes().items():
        data = yaml.safe_load(path.read_text()) or {}
        first = path.read_text().splitlines()[0].lstrip("# ").strip() if path.read_text().startswith("#") else ""
        table.add_row(name, str(data.get("env", {}).get("id", "sokoban")), str(data.get("model", {}).get("path", "tiny")), first)
    console.print(table)


@app.command()
def envs() -> None:
    """List the registered environments (built-in and from entry points)."""
    from turnforge.envs import list_envs

    table = Table("env id", "source", "defaults")
    for env_id, spec in list_envs().items():
        table.add_row(env_id, spec.source, json.dumps(spec.kwargs))
    console.print(table)


@app.command("check-env")
def check_env_cmd(
    env_id: str = typer.Argument(..., help="Registered env id (see `turnforge envs`)"),
    options: Optional[List[str]] = typer.Argument(None, help="Env options as key=value (e.g. dim=8 num_boxes=2)"),
    tasks: Optional[Path] = typer.Option(None, "--tasks", help="JSONL task file, as env.tasks in a recipe"),
    model: Optional[Path] = typer.Option(None, "--model", help="HF model directory whose tokenizer measures the actions"),
    max_new_tokens: int = typer.Option(8, "--max-new-tokens", min=1, help="rollout.max_new_tokens to measure against"),
    min_heldout: int = typer.Option(10, "--min-heldout", min=1, help="Fewest distinct held-out tasks accepted"),
) -> None:
    """Run check_env on a registered env with options; a failure names the fix (exit 1)."""
    from turnforge.config import parse_overrides
    from turnforge.envs import EnvCheckError, check_env

    kwargs = parse_overrides(list(options or []))
    chat = None
    if model is not None:
        from turnforge.policy.model import load_chat_format
        from turnforge.train.run import _quiet_hf

        _quiet_hf()
        chat = load_chat_format(model)
    try:
        report = check_env(env_id, env_kwargs=kwargs, tasks=str(tasks) if tasks else None, min_heldout=min_heldout,
                           tokenizer=chat, max_new_tokens=max_new_tokens)
    except EnvCheckError as err:
        print(f"FAIL {env_id}: {err}", file=sys.stderr)
        sys.exit(1)
    for warning in report.warnings:
        console.print(f"[yellow]warning[/yellow] {warning}", highlight=False, soft_wrap=True)
    if chat is None:
        console.print("note: action lengths not checked; give --model DIR (and --max-new-tokens N) to check them", soft_wrap=True)
    console.print(f"{env_id}: ok ({', '.join(report.checks)})", highlight=False, soft_wrap=True)


@app.command("eval")
def eval_cmd(
    checkpoint: Path = typer.Argument(..., help="HF model directory (e.g. RUN/checkpoints/final)"),
    env: str = typer.Option("sokoban", "--env", help="Registered env id"),
    episodes: int = typer.Option(200, "--episodes", min=1, help="Episodes to play"),
    seed: int = typer.Option(0, "--seed", help="Seed of sampling (greedy ignores it)"),
    split: str = typer.Option("heldout", "--split", help="'heldout' or 'train'"),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    out: Optional[Path] = typer.Option(None, "--out", help="JSON file (default: CHECKPOINT/eval_<env>_<split>.json)"),
) -> None:
    """Evaluate a checkpoint; prints the eval dict and writes it as JSON."""
    import torch
    import yaml

    from turnforge.config import EnvConfig, TrainConfig, config_from_dict
    from turnforge.policy.model import load_policy
    from turnforge.rollout.engine import make_engine
    from turnforge.train.evaluate import evaluate
    from turnforge.train.run import _quiet_hf

    if split not in ("heldout", "train"):
        raise UserError(f"unknown split {split!r}; valid splits: 'heldout', 'train'")
    _quiet_hf()
    torch.set_num_threads(2)
    cfg = TrainConfig(env=EnvConfig(id=env))
    run_cfg = checkpoint.resolve().parent.parent / "config.yaml"  # RUN/checkpoints/<name>/ -> RUN/config.yaml
    if run_cfg.exists():
        cfg = config_from_dict(yaml.safe_load(run_cfg.read_text()))
        if cfg.env.id != env:
            cfg = cfg.model_copy(update={"env": EnvConfig(id=env)})
    policy = load_policy(checkpoint)
    with closing(make_engine(cfg, policy, min(episodes, 256))) as engine:
        result, _ = evaluate(engine, policy, episodes=episodes, split=split, temperature=temperature, seed=seed)
    data = {**result.as_dict(), "checkpoint": str(checkpoint), "seed": seed, "temperature": temperature}
    path = out or checkpoint / f"eval_{env}_{split}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))


@app.command("tiny-model")
def tiny_model(out: Path = typer.Argument(..., help="Directory to write the model to")) -> None:
    """Build the tiny Qwen2 model + tokenizer locally and save it in HF format."""
    from turnforge.policy.tiny import build_tiny_model
    from turnforge.train.run import _quiet_hf

    _quiet_hf()
    build_tiny_model(out)
    console.print(f"saved a tiny Qwen2 model to {out}")

def main() -> None:
    try:
        app(standalone_mode=False)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteLoss as err:
        print(f"error: training stopped: {err}", file=sys.stderr)
        sys.exit(1)
    except (typer.Abort, KeyboardInterrupt):
        print("interrupted; continue with: turnforge train --resume <run dir>", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # click usage errors carry their own exit code
        import click

        if isinstance(err, click.exceptions.ClickException):
            err.show()
            sys.exit(err.exit_code)
        if isinstance(err, click.exceptions.Exit):
            sys.exit(err.exit_code)
        raise


if __name__ == "__main__":
    main()
