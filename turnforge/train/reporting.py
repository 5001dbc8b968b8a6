"""Run reporting: metrics (JSONL + TensorBoard), the live progress display, the learning curve.

``MetricsLog`` appends one JSON object per event to ``metrics.jsonl`` and mirrors
numeric values to TensorBoard (``tb/``) with the env step as the x axis. ``Progress``
shows a rich live panel on a terminal and plain log lines otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.live import Live
from rich.table import Table

from turnforge.train.metrics import KINDS, read_metrics, to_json

T = TypeVar("T")


class MetricsLog:
    """``RUN/metrics.jsonl`` (one typed record per line, ``turnforge.train.metrics``) mirrored to
    TensorBoard: every numeric field, nested ones as ``kind/field/subfield``, against env steps."""

    def __init__(self, run_dir: Path, keep_until_env_steps: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        if keep_until_env_steps is not None and self.path.exists():
            # Resuming: drop events logged after the checkpoint we resume from.
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["env_steps"] <= keep_until_env_steps]
            self.path.write_text("".join(line + "\n" for line in kept))
        from tensorboardX import SummaryWriter

        self.tb = SummaryWriter(str(run_dir / "tb"))
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
    """Stage, iteration, reward, success, tokens/s and ETA: live on a TTY, log lines otherwise."""

    def __init__(self, recipe: str, live: bool | None = None) -> None:
        self.console = Console(stderr=True)
        self.live_mode = sys.stderr.isatty() if live is None else live
        self.recipe = recipe
        self.state: dict[str, Any] = {"stage": "setup"}
        self._live: Live | None = None
        self._stage_start = time.time()

    def __enter__(self) -> "Progress":
        if self.live_mode:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(*exc)

    def stage(self, name: str, total: int | None = None) -> None:
        self.state = {"stage": name, "total": total}
        self._stage_start = time.time()
        self._emit(f"stage {name}" + (f" ({total} steps)" if total else ""))

    def update(self, step: int, **values: Any) -> None:
        total = self.state.get("total")
        elapsed = time.time() - self._stage_start
        eta = elapsed / step * (total - step) if total and step else None
        self.state.update(values, step=step, eta=eta)
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
        self._emit(f"[{self.state['stage']}] {step}/{total or '?'} {shown}" + (f" eta={eta:.0f}s" if eta is not None else ""))

    def message(self, text: str) -> None:
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def _emit(self, line: str) -> None:
        if self._live is not None:
            self._live.update(self._table())
        else:
            print(line, file=sys.stderr, flush=True)

    def _table(self) -> Table:
        table = Table(title=f"turnforge train · {self.recipe}", show_header=False, expand=False)
        for key in ("stage", "step", "total", "reward", "success", "loss", "tokens_per_s", "eta"):
            if self.state.get(key) is not None:
                table.add_row(key, _fmt(self.state[key]) + ("s" if key == "eta" else ""))
        return table


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def plot_learning_curve(run_dir: Path, title: str) -> Path:
    """Held-out success and mean return against env steps, BC and RL stages marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = read_metrics(run_dir)
    out = run_dir / "learning_curve.png"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
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
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
