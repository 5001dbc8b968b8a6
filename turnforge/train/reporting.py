"""Run reporting: metrics (JSONL + TensorBoard), the live progress display, the learning curve,
the run's summary and its last line.

``MetricsLog`` appends one JSON object per event to ``metrics.jsonl`` and mirrors
numeric values to TensorBoard (``tb/``) with the env step as the x axis. ``Progress``
shows a rich live panel on a terminal and plain log lines otherwise. ``run_summary``
builds ``summary.json``'s record; ``final_line`` says what the run reached and against what.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from turnforge.config import TrainConfig
from turnforge.dist import gather, world
from turnforge.memory import peak_memory
from turnforge.plots import save_figure, subplots
from turnforge.policy.lora import adapter_change, trainable_parameters
from turnforge.runs import RunDir
from turnforge.train.metrics import (KINDS, BoundaryReport, ExpertQueries, PolicySummary, RunMetrics, RunSummary,
                                     SamplingOverrides,
                                     Software, read_metrics, to_json)
from turnforge.types import EvalResult

if TYPE_CHECKING:
    from turnforge.policy.model import Policy
    from turnforge.rollout.engine import Engine
    from turnforge.train.run_dir.checkpoint import TrainerState

T = TypeVar("T")


class MetricsLog:
    """``RUN/metrics.jsonl`` (one typed record per line, ``turnforge.train.metrics``) mirrored to
    TensorBoard: every numeric field, nested ones as ``kind/field/subfield``, against env steps."""

    def __init__(self, run_dir: Path | RunDir, keep_until_env_steps: int | None = None) -> None:
        run = RunDir(run_dir)
        self.path = run.metrics
        if keep_until_env_steps is not None and self.path.exists():
            # Resuming: drop events logged after the checkpoint we resume from.
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["env_steps"] <= keep_until_env_steps]
            self.path.write_text("".join(line + "\n" for line in kept))
        from tensorboardX import SummaryWriter

        self.tb = SummaryWriter(str(run.tb))
        self._file = self.path.open("a")

    def log(self, record: T, env_steps: int) -> T:
        """Append ``record`` (a dataclass of ``turnforge.train.metrics.EVENTS``) at ``env_steps``;
        returns it as written (with its env steps and time)."""
        kind = KINDS[type(record)]
        record = dataclasses.replace(record, env_steps=env_steps, time=round(time.time(), 3))
        data = to_json(record)
        self._file.write(json.dumps({"event": kind, **data}) + "\n")
        self._file.flush()
        for key, value in _scalars(data):
            if key not in ("env_steps", "time"):
                self.tb.add_scalar(f"{kind}/{key}", value, env_steps)
        return record

    def close(self) -> None:
        self._file.close()
        self.tb.close()


class SilentMetricsLog(MetricsLog):
    """The metrics log of a rank other than 0 (``turnforge.dist``): records are stamped as rank
    0's are and returned, nothing is written (rank 0's log is the run's)."""

    def __init__(self) -> None:
        pass

    def log(self, record: T, env_steps: int) -> T:
        return dataclasses.replace(record, env_steps=env_steps, time=round(time.time(), 3))

    def close(self) -> None:
        pass


def _scalars(data: dict, prefix: str = "") -> list[tuple[str, float]]:
    """The numeric leaves of nested JSON data as ``(path, value)``."""
    out = []
    for key, value in data.items():
        if isinstance(value, dict):
            out += _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((f"{prefix}{key}", value))
    return out


class Progress:
    """Where the run is, on stderr: stage, step, reward, success, loss, tokens/s, ETA.

    On a terminal (``live``, default: stderr is a TTY): rich's live panel, and a progress bar
    for each long activity inside a stage (an evaluation, the demonstrations). Elsewhere (CI,
    ``nohup``, a pipe): a line per stage and per message, and progress lines at most one every
    ``interval`` seconds, each with its ETA (plus a stage's last step), so a log holds
    O(stages + minutes) lines, not one per optimizer step. ``clock`` (seconds, monotonic) is
    injectable, so the throttle is tested without sleeping. ``quiet``: prints nothing (the
    trainer ranks other than 0; rank 0's display is the run's). ``command``: the panel's title
    (``turnforge eval`` shows its own)."""

    def __init__(self, recipe: str, live: bool | None = None, *, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, quiet: bool = False, command: str = "turnforge train") -> None:
        self.console = Console(stderr=True)
        self.quiet, self.command = quiet, command
        self.live_mode = (sys.stderr.isatty() if live is None else live) and not quiet
        self.recipe, self.interval, self.clock = recipe, interval, clock
        self.state: dict[str, Any] = {"stage": "setup"}
        self._live: Live | None = None
        self._bars = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn(), console=self.console, auto_refresh=False)
        self._stage_start = self._last_line = clock()

    def __enter__(self) -> "Progress":
        if self.live_mode:
            self._live = Live(self._panel(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self._panel())
            self._live.__exit__(*exc)

    def stage(self, name: str, total: int | None = None) -> None:
        """A new stage of ``total`` steps (one line without a terminal)."""
        self.state = {"stage": name, "total": total}
        self._stage_start = self._last_line = self.clock()
        self._emit(f"stage {name}" + (f" ({total} steps)" if total else ""), force=True)

    def update(self, step: int, **values: Any) -> None:
        """Step ``step`` of the stage done, with values to show (throttled without a terminal)."""
        total = self.state.get("total")
        elapsed = self.clock() - self._stage_start
        eta = elapsed / step * (total - step) if total and step else None
        self.state.update(values, step=step, eta=eta)
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
        last = total is not None and step >= total
        self._emit(f"[{self.state['stage']}] {step}/{total or '?'} {shown}"
                   + (f" (done in {elapsed:.0f}s)" if last else f" eta={eta:.0f}s" if eta is not None else ""), force=last)

    @contextmanager
    def activity(self, name: str, total: int, unit: str = "episodes") -> Iterator[Callable[[int], None]]:
        """A long step inside a stage (an evaluation): yields ``advance(done)``, to call with how
        many of ``total`` are done. A progress bar on a terminal; otherwise a throttled line
        ``[NAME] done/total UNIT eta=...`` (``... (Ns)`` while none is done: a long activity whose
        items all finish late, e.g. lookahead's episodes, still shows that it runs)."""
        started = self.clock()
        task = self._bars.add_task(name, total=total) if self._live is not None else None

        def advance(done: int) -> None:
            if task is not None:
                self._bars.update(task, completed=done)
                self._live.update(self._panel())
                return
            elapsed = self.clock() - started
            if done < total and (done or elapsed >= self.interval):  # (the activity's closing line, its result, follows)
                when = f" eta={elapsed / done * (total - done):.0f}s" if done else f" ({elapsed:.0f}s)"
                self._emit(f"[{name}] {done}/{total} {unit}{when}")

        try:
            yield advance
        finally:
            if task is not None:
                self._bars.remove_task(task)
                self._live.update(self._panel())

    def message(self, text: str) -> None:
        """A line, always (a result, a warning)."""
        if self.quiet:
            return
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def _emit(self, line: str, force: bool = False) -> None:
        if self._live is not None:
            self._live.update(self._panel())
            return
        now = self.clock()
        if (force or now - self._last_line >= self.interval) and not self.quiet:
            self._last_line = now
            print(line, file=sys.stderr, flush=True)

    def _panel(self) -> Group:
        return Group(self._table(), self._bars)

    def _table(self) -> Table:
        table = Table(title=f"{self.command} · {self.recipe}", show_header=False, expand=False)
        for key in ("stage", "step", "total", "reward", "success", "loss", "tokens_per_s", "summaries", "eta"):
            if self.state.get(key) is not None:
                table.add_row(key, _fmt(self.state[key]) + ("s" if key == "eta" else ""))
        return table


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def plot_learning_curve(out: Path, metrics: RunMetrics, title: str) -> Path:
    """``RUN/learning_curve.png`` (``out``): held-out success and mean return of the run's
    evaluations (``metrics``) against env steps, BC and RL stages marked."""
    fig, (ax1, ax2) = subplots(1, 2, figsize=(11, 4))
    bc_end = metrics.bc.env_steps if metrics.bc is not None else 0
    for ax, key, label in ((ax1, "success_rate", "held-out success rate"), (ax2, "mean_return", "held-out mean return")):
        xs = [e.env_steps for e in metrics.evals]
        ys = [getattr(e.result, key) for e in metrics.evals]
        ax.plot(xs, ys, marker="o", color="tab:blue")
        ax.axvspan(0, bc_end, color="tab:orange", alpha=0.12, label="BC stage (expert env steps)")
        ax.axvspan(bc_end, max(xs + [bc_end + 1]), color="tab:green", alpha=0.06, label="RL stage (GRPO rollouts)")
        ax.axvline(bc_end, color="tab:orange", linestyle="--")
        ax.set_xlabel("env steps (demonstrations + RL rollouts)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    ax1.set_ylim(-0.02, 1.02)
    fig.suptitle(title)
    return save_figure(fig, out)


def plot_pass_at_k(out: Path, summary: RunSummary, title: str) -> Path:
    """``RUN/pass_at_k.png`` (``out``): pass@k against k (log scale) for the start and after
    training, and the never-solved share beside it: a curve raised at k=1 only is sharpening, one
    raised at large k too is expansion."""
    fig, (ax1, ax2) = subplots(1, 2, figsize=(11, 4))
    reports = [(label, r) for label, r in (("start", summary.boundary_start), ("after training", summary.boundary_after))
               if r is not None]
    for (label, r), color in zip(reports, ("tab:orange", "tab:green")):
        points = [(x.k, x.value) for x in r.pass_at_k if x.value is not None]
        ax1.plot([k for k, _ in points], [v for _, v in points], marker="o", color=color,
                 label=f"{label} ({r.tasks} tasks x {r.samples_per_task}, T={r.temperature:g})")
        never = [(k, v) for k, v in ((8, r.never_solved_at_8), (64, r.never_solved_at_64)) if v is not None]
        ax2.bar([f"{label}\n@{k}" for k, _ in never], [v for _, v in never], color=color)
    ax1.set_xscale("log", base=2)
    ks = sorted({x.k for _, r in reports for x in r.pass_at_k})
    ax1.set_xticks(ks, [str(k) for k in ks])
    ax1.set(xlabel="k (samples per task)", ylabel="pass@k (unbiased)", ylim=(-0.02, 1.02), title="pass@k on held-out tasks")
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right")
    ax2.set(ylabel="expected share of tasks never solved", ylim=(0, 1), title="never solved in k samples")
    fig.suptitle(title)
    return save_figure(fig, out)


def start_name(cfg: TrainConfig) -> str:
    """What RL starts from, in messages: the BC policy, or the model itself without BC."""
    return "BC policy" if cfg.bc.enabled else "starting policy (no BC)"


def _peak_memory():
    """``peak_memory()`` of this process, with every trainer rank's own peak on several ranks (a collective)."""
    peak = peak_memory()
    if not world().distributed:
        return peak
    return dataclasses.replace(peak, ranks_mib=tuple(gather(peak.process_mib)))


def run_summary(cfg: TrainConfig, state: TrainerState, policy: Policy, engine: Engine, run_dir: Path, after: EvalResult,
                rl_seconds: float | None, boundary_after: BoundaryReport | None = None) -> RunSummary:
    """The ``RunSummary`` of a finished run: its evaluations before and after RL, the gains
    (against the evaluation before RL, and against the start at its best temperature), pass@k of
    the start and the end, the counters of ``state``, the engine and software it ran with."""
    before, best = state.eval_before_rl, state.bc_temperatures
    agent = cfg.agent.entrypoint is not None
    demos = (state.bc.demo_env_steps - state.bc.demo_random_actions) if state.bc else 0
    return RunSummary(
        recipe=cfg.recipe, seed=cfg.seed, wall_seconds=round(state.wall_seconds, 2), env_steps=state.env_steps,
        mc_env_steps=state.mc_env_steps, train_tokens=state.train_tokens, eval_before_rl=before, eval_after_rl=after,
        success_gain_points=round(100 * (after.success_rate - before.success_rate), 2), rl_iterations=state.iteration,
        rl_seconds=None if rl_seconds is None else round(rl_seconds, 2), engine_mode=cfg.engine.mode,
        eta=cfg.engine.eta, env_workers=cfg.engine.env_workers, cluster=cfg.cluster, policy_version=policy.version,
        skipped_steps=state.skipped_steps, advantage=cfg.rl.advantage, bc=state.bc, value_pretrain=state.value_pretrain,
        env_id=engine.env.env_id,
        env_kwargs={"entrypoint": cfg.agent.entrypoint, "tasks": cfg.agent.tasks} if agent else dict(cfg.env.kwargs),
        model=f"gguf:{cfg.model.gguf}" if cfg.model.gguf else cfg.model.path,
        num_parameters=sum(p.numel() for p in policy.model.parameters()),
        trainable_parameters=sum(p.numel() for p in trainable_parameters(policy.model)), torch_threads=cfg.threads,
        env_pool=engine.pool_stats(), software=Software.current(), peak_memory=_peak_memory(),
        eval_bc_best_temperature=best, flywheel_rounds=cfg.flywheel.rounds,
        gain_over_bc_best_points=None if best is None else round(100 * (after.success_rate - best.eval.success_rate), 2),
        expert_queries=ExpertQueries(demos, state.hints, demos + state.hints + state.anchor_moves, state.anchor_moves),
        boundary_start=state.boundary_start, boundary_after=boundary_after,
        sampling_overrides=sampling_overrides(read_metrics(run_dir)) if agent else None,
        policies=policy_summaries(read_metrics(run_dir), policy, cfg.agent.policies) if cfg.agent.policies else None,
    )


def policy_summaries(metrics: RunMetrics, policy: Policy, names: list[str]) -> dict[str, PolicySummary]:
    """Each policy's RL figures (``agent.policies``), from its iterations' records and its adapter."""
    parts = [m.policies for m in metrics.iterations if m.policies]
    return {name: PolicySummary(
        calls=sum(p[name].calls for p in parts), train_tokens=sum(p[name].update.tokens for p in parts),
        reward_first=parts[0][name].reward if parts else None, reward_last=parts[-1][name].reward if parts else None,
        adapter_change=round(adapter_change(policy.model, name), 6)) for name in names}


def sampling_overrides(metrics: RunMetrics) -> SamplingOverrides:
    """An agent run's calls sampled with the trainer's settings instead of the agent's: the
    ``n_overridden_*`` counters of its RL iterations, evaluations and pass@k measurements summed."""
    events = ([m.env_events for m in metrics.iterations] + [e.env_events for e in metrics.evals]
              + [b.env_events for b in metrics.boundaries])
    keys = ("calls", "temperature", "top_p", "max_tokens")
    return SamplingOverrides(**{key: sum(e.get(f"n_overridden_{key}", 0) for e in events) for key in keys})


def final_line(summary: RunSummary, cfg: TrainConfig, run_dir: Path) -> str:
    """The run's last line: held-out success at the end, and each gain with the baseline it is
    measured against, named with its temperature and score: the start (BC policy, or the model
    without BC) at its best of ``eval.bc_temperatures`` first, then the start at ``eval.temperature``.
    Without ``eval.bc_temperatures`` it says that the start's best temperature was not measured.
    In a tool env it adds the share of episodes that called a tool, at the end and at that baseline."""
    before, after, best = summary.eval_before_rl, summary.eval_after_rl, summary.eval_bc_best_temperature
    start, t = start_name(cfg), cfg.eval.temperature
    at_t = f"{summary.success_gain_points:+.1f} points against the {start} at T={t:g} ({before.success_rate:.3f})"
    if best is None:
        gains = f"{at_t}; its best temperature was not measured (set eval.bc_temperatures)"
    else:
        gains = (f"{summary.gain_over_bc_best_points:+.1f} points against the {start} at its best temperature "
                 f"(T={best.temperature:g}: {best.eval.success_rate:.3f}), {at_t}")
    if after.tool_call_rate is not None:  # a tool env: does the policy still call its tools?
        ref = before if best is None else best.eval
        gains += (f"; episodes calling a tool {after.tool_call_rate:.3f} (the {start}"
                  f"{'' if best is None else f' at T={best.temperature:g}'}: {ref.tool_call_rate:.3f})")
    return (f"done in {summary.wall_seconds:.0f}s: held-out success {after.success_rate:.3f} at the end "
            f"(T={t:g}, {after.episodes} episodes), {gains}; run dir {run_dir}")
