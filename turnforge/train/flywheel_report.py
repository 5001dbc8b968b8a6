"""The flywheel's report: ``RUN/flywheel_report.md`` and ``RUN/flywheel.png`` from the run's
``flywheel_round`` records, its summary and its config. Each mechanism writes its own columns
of the table of rounds and its own paragraph (``turnforge.train.mechanisms``)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np

from turnforge.config import TrainConfig
from turnforge.plots import save_figure, subplots
from turnforge.runs import RunDir
from turnforge.train.mechanisms import MECHANISMS
from turnforge.train.metrics import BoundaryReport, FlywheelRound, RunSummary, read_metrics


def write_flywheel_report(run: RunDir, summary: RunSummary, cfg: TrainConfig) -> None:
    """``RUN/flywheel_report.md`` and ``RUN/flywheel.png`` (on rank 0): held-out success per round,
    where the successes came from (plain and each mechanism's episodes), what each filter kept, and
    pass@k of the start and the end (nothing without flywheel rounds)."""
    rounds = read_metrics(run).flywheel
    if not rounds:
        return
    run.write(run.flywheel_plot, partial(plot_flywheel, rounds=rounds, summary=summary, temperature=cfg.eval.temperature))
    run.write_text(run.flywheel_report, "\n".join(report_lines(rounds, summary)))


def plot_flywheel(path: Path, rounds: list[FlywheelRound], summary: RunSummary, temperature: float) -> Path:
    """Three panels: held-out success per round (against BC at its best temperature and the
    final evaluation), successful episodes per round by source, what each filter kept."""
    xs = [0] + [x.round for x in rounds]
    fig, (ax1, ax2, ax3) = subplots(1, 3, figsize=(15, 4))
    ax1.plot(xs, [summary.eval_before_rl.success_rate] + [x.eval.success_rate for x in rounds], marker="o",
             label=f"held-out (T={temperature})")
    best = summary.eval_bc_best_temperature
    if best is not None:
        ax1.axhline(best.eval.success_rate, color="tab:red", linestyle="--", label=f"BC at its best T={best.temperature}")
    ax1.axhline(summary.eval_after_rl.success_rate, color="tab:green", linestyle=":", label="final (after RL)")
    ax1.set(xlabel="round (0 = after BC)", ylabel="held-out success", ylim=(-0.02, 1.02), title="held-out success per round")
    ax1.legend(loc="lower right")
    bottom = np.zeros(len(rounds))
    for source, pairs in _episodes_by_source(rounds).items():
        ys = np.array([p[1] for p in pairs], dtype=float)
        ax2.bar(xs[1:], ys, bottom=bottom, label=source)
        bottom += ys
    ax2.set(xlabel="round", ylabel="successful episodes", title="where successes came from")
    ax2.legend()
    names = [f.name for f in rounds[0].filters]
    kept = [sum(x.filters[i].episodes_out for x in rounds) for i in range(len(names))]
    offered = sum(x.filters[0].episodes_in for x in rounds) if names else 0
    ax3.bar(["offered"] + names, [offered] + kept, color="tab:gray")
    ax3.set(ylabel="episodes (all rounds)", title="what each filter kept")
    ax3.tick_params(axis="x", rotation=30)
    return save_figure(fig, path)


def _episodes_by_source(rounds: list[FlywheelRound]) -> dict[str, list[tuple[int, int]]]:
    """(scored episodes, successes) per round, of plain collection and of each mechanism that plays episodes."""
    out = {"plain": [x.plain for x in rounds]}
    for name, record in rounds[0].mechanisms.items():
        if record.episodes is not None:
            out[MECHANISMS[name].source or name] = [x.mechanisms[name].episodes for x in rounds]
    return out


def report_lines(rounds: list[FlywheelRound], summary: RunSummary) -> list[str]:
    """The report's Markdown, line by line."""
    before, best, q = summary.eval_before_rl.success_rate, summary.eval_bc_best_temperature, summary.expert_queries
    lines = [f"# Flywheel report: {summary.recipe} (seed {summary.seed})", "",
             f"Held-out success ({summary.eval_after_rl.episodes} episodes): after BC {before:.3f}"
             + (f", BC at its best temperature (T={best.temperature}) {best.eval.success_rate:.3f}" if best else "")
             + f", final {summary.eval_after_rl.success_rate:.3f}"
             + (f" ({summary.gain_over_bc_best_points:+.1f} points over BC at its best temperature)" if best else "") + ".",
             f"Expert queries: {q.total} ({q.demonstration_actions} demonstration moves, {q.hints} hints, "
             f"{q.anchor_moves} moves along anchored tasks).", "",
             "![flywheel](flywheel.png)", ""]
    lines += rounds_table(rounds)
    for name in rounds[0].mechanisms:
        lines += MECHANISMS[name].report_lines(rounds)
    names = [f.name for f in rounds[0].filters]
    lines += ["", "Filters (episodes in -> out, kept turns in -> out, all rounds):", ""]
    for i, name in enumerate(names):
        f = [x.filters[i] for x in rounds]
        lines.append(f"- `{name}`: {sum(c.episodes_in for c in f)} -> {sum(c.episodes_out for c in f)} episodes, "
                     f"{sum(c.turns_in for c in f)} -> {sum(c.turns_out for c in f)} turns")
    lines += boundary_lines(summary)
    if any(x.awr is not None for x in rounds):  # flywheel.weighting=mc_awr or group_awr
        lines += ["", "## Advantage-weighted regression (turnforge.train.awr)", "",
                  "| round | states | (s, a) pairs | restart steps | samples | mean abs A | A > 0 | mean weight | clipped | ESS |",
                  "|" + "---|" * 10]
        lines += [f"| {x.round} | {a.states} | {a.actions} | {a.env_steps} | {a.samples} | {a.mean_abs_advantage:.3f} | "
                  f"{a.positive_share:.2f} | {a.mean_weight:.2f} | {a.clipped_share:.2f} | {a.ess:.2f} |"
                  for x in rounds if (a := x.awr) is not None]
    lines += ["", "Query the episodes: `turnforge data RUN \"SELECT * FROM success_by_source\"`.", ""]
    return lines


def rounds_table(rounds: list[FlywheelRound]) -> list[str]:
    """One row per round: its env steps, plain episodes, each mechanism's columns, what it
    trained on, its entropy and held-out success (and pass@k, where measured)."""
    per_round = any(x.boundary is not None for x in rounds)

    def mechanism_cells(x: FlywheelRound) -> dict[str, str]:
        return {k: v for name, record in x.mechanisms.items() for k, v in MECHANISMS[name].columns(record).items()}

    columns = (["round", "env steps", "plain", *mechanism_cells(rounds[0]), "unsolved tasks", "RFT samples", "entropy",
                "held-out"] + (["pass@1", "pass@N", "never solved@8"] if per_round else []))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for x in rounds:
        cells = [str(x.round), str(x.round_env_steps), f"{x.plain[1]}/{x.plain[0]}", *mechanism_cells(x).values(),
                 str(x.unsolved_tasks), str(x.rft_samples), "" if x.entropy is None else f"{x.entropy:.3f}",
                 f"{x.eval.success_rate:.3f} ({x.eval.episodes})"] + (_boundary_cells(x.boundary) if per_round else [])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _boundary_cells(b: BoundaryReport | None) -> list[str]:
    """A round's pass@1, pass@N and never-solved share (empty without a measurement)."""
    if b is None or not b.pass_at_k:
        return ["", "", ""]
    return ["" if v is None else f"{v:.3f}" for v in (b.pass_at_k[0].value, b.pass_at_k[-1].value, b.never_solved_at_8)]


def boundary_lines(summary: RunSummary) -> list[str]:
    """The report's section on what the policy solves: pass@k of the start and after training
    (``summary.json``'s ``boundary_start``, ``boundary_after``) and ``pass_at_k.png``."""
    reports = [(name, r) for name, r in (("after BC", summary.boundary_start), ("final", summary.boundary_after)) if r is not None]
    if not reports:
        return []
    ks = sorted({p.k for _, r in reports for p in r.pass_at_k})
    first = reports[0][1]
    lines = ["", f"## The boundary: pass@k on {first.tasks} {first.split} tasks x {first.samples_per_task} samples "
             f"(T={first.temperature:g})", "",
             "Sharpening (the policy concentrates on tasks it already solves) raises pass@1 only; expansion (it solves "
             "tasks it never solved) raises pass@k at large k too and lowers the never-solved share.", "",
             "![pass@k](pass_at_k.png)", "",
             "| policy | " + " | ".join(f"pass@{k}" for k in ks) + " | never solved@8 | distinct successes | entropy | "
             "I(A;O) | malformed (T={:g}) | malformed (eval) |".format(first.temperature),
             "|" + "---|" * (len(ks) + 7)]

    def fmt(x: float | None, digits: int = 3) -> str:
        return "" if x is None else f"{x:.{digits}f}"

    for name, r in reports:
        lines.append(f"| {name} | " + " | ".join(fmt(r.at(k)) for k in ks) + f" | {fmt(r.never_solved_at_8)} | "
                     f"{fmt(r.distinct_successes, 2)} | {fmt(r.entropy)} | {fmt(r.action_mi)} | {r.malformed_rate:.3f} | "
                     f"{r.eval_malformed_rate:.3f} |")
    if summary.boundary_start is not None and summary.boundary_after is not None:
        from turnforge.train.boundary import format_levels  # (torch: only when there is a boundary to report)

        line = format_levels(summary.boundary_start, summary.boundary_after)
        if line is not None:
            lines += ["", line[0].upper() + line[1:] + "."]
    return lines


__all__ = ["boundary_lines", "plot_flywheel", "report_lines", "rounds_table", "write_flywheel_report"]
