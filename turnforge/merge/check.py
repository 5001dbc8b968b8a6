"""``turnforge merge``'s sanity check: the merged model and its parents, each evaluated on the
same few held-out episodes of every run the parents come from, and a warning line when the merge
broke what the parents could do.

A parent's run is its run directory (``RUN/checkpoints/<name>/`` next to ``RUN/config.yaml``):
the merge is evaluated as ``turnforge eval`` evaluates a checkpoint of that run (its env, tasks,
rollout settings, evaluation temperature and seed; episodic memory off), and so is each parent
from that run, on the same tasks with the same sampling seed. Parents outside a run directory
have no env to check on; when none has one, there is no check. A few episodes measure a
collapse, not a small loss: the thresholds (``problems``) ask for a large drop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from turnforge.merge.methods import MergeSpec
from turnforge.merge.sweep import EvalTarget
from turnforge.types import EvalResult

#: Held-out episodes per model and run of the check (``turnforge merge --episodes`` overrides).
CHECK_EPISODES = 20
#: The merge's invalid-action share this far above its worst parent's is a problem.
INVALID_JUMP = 0.2
#: The merge's success below this share of its worst parent's, and by at least ``COLLAPSE_DROP``, is a problem.
COLLAPSE_SHARE = 0.5
COLLAPSE_DROP = 0.15


@dataclass(frozen=True)
class CheckRow:
    """The check on one run: the merge's evaluation and that of each parent from the run."""

    target: str  # the run's env label
    merged: EvalResult
    parents: tuple[tuple[str, EvalResult], ...]  # (parent label, its evaluation)


def problems(merged: EvalResult, parents: Sequence[EvalResult]) -> list[str]:
    """What the merge lost against its parents on one run (empty: nothing large): success
    collapsed (below ``COLLAPSE_SHARE`` of the worst parent's and ``COLLAPSE_DROP`` under it),
    or the invalid-action share jumped (``INVALID_JUMP`` above the worst parent's)."""
    out = []
    worst = min(p.success_rate for p in parents)
    if merged.success_rate < COLLAPSE_SHARE * worst and worst - merged.success_rate >= COLLAPSE_DROP:
        out.append(f"success {merged.success_rate:.3f} against the checkpoints' "
                   + " / ".join(f"{p.success_rate:.3f}" for p in parents))
    most = max(p.invalid_action_rate for p in parents)
    if merged.invalid_action_rate - most >= INVALID_JUMP:
        out.append(f"invalid actions {merged.invalid_action_rate:.0%} against at most {most:.0%}")
    return out


def advice(spec: MergeSpec) -> str:
    """What to try instead of ``spec``."""
    if spec.method in ("ties", "dare"):
        return (f"try --method linear or slerp, or a higher --density (now {spec.density:g}: the share of each task vector "
                "kept; dense task vectors, as fine-tuning every weight gives, lose most of what they learned)")
    if spec.method in ("task_arithmetic", "ram"):
        return "try --method linear or slerp (weights summing to 1), or smaller --weights"
    return "try other --weights (closer to the better parent)"


def run_check(model: Path, parents: Sequence[Path], labels: Sequence[str], targets: Sequence[EvalTarget],
              episodes: int) -> list[CheckRow]:
    """Evaluate ``model`` and, per target, the parents from that run, on ``episodes`` held-out
    episodes each (as ``turnforge merge --sweep`` evaluates its points)."""
    from turnforge.merge import sweep

    return [CheckRow(t.label, sweep.evaluate_on(model, t, episodes),
                     tuple((labels[i], sweep.evaluate_on(parents[i], t, episodes)) for i in t.parents))
            for t in targets]


def figures_line(row: CheckRow) -> str:
    """One line: the merge's and the parents' success and invalid-action share on the row's run."""
    def fig(r: EvalResult) -> str:
        return f"success {r.success_rate:.3f}, invalid {r.invalid_action_rate:.0%}"

    return (f"check on {row.target} ({row.merged.episodes} held-out episodes): merged {fig(row.merged)}; "
            + "; ".join(f"{label} {fig(r)}" for label, r in row.parents))


def warning_line(row: CheckRow, spec: MergeSpec) -> str | None:
    """The warning for a row whose merge broke its parents' skill (None: no large drop)."""
    found = problems(row.merged, [r for _, r in row.parents])
    if not found:
        return None
    return f"the {spec.method} merge looks broken on {row.target}: {', '.join(found)}; {advice(spec)}"
