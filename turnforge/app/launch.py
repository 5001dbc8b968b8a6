"""Starting the trainer's ranks on this machine (``turnforge train --nproc N``) and telling how they ended.

``start_ranks`` checks everything first (``check_world``, ``preflight``: one line, exit 2, before
any rank starts), then starts the ranks: with ``cluster=ray`` as Ray actors
(``turnforge.app.ray_ranks``), otherwise through torch's elastic agent, the launcher behind
``torchrun --standalone`` (``launch``), each rank running ``python -m turnforge.cli <argv>``.

The agent runs in this process, not as a ``python -m torch.distributed.run`` child whose output
would have to be parsed: its result is typed, each rank's exit status as the kernel gave it (an
exit code, or minus the signal that killed it), where torchrun's output is a log and the
``ChildFailedError`` traceback, worded differently from one torch version to the next. The agent
is torch's ``LocalElasticAgent`` with one method extended (``_monitor_workers``, the check
``SimpleElasticAgent`` leaves to its subclasses): it sees a rank's end before torch's own poll
sends SIGTERM to the others (torch's agent offers no hook there, nor another signal to send), so the launcher knows which ranks ended first (the cause; the rest
were stopped because of it) and leaves ``dist.STOPPING`` beside the ranks' reports first. A rank
that then gets SIGTERM knows that it is not a user's interrupt (``dist.stopped_by_launcher``).

Each rank leaves its closing line (``dist.report_failure``) instead of printing it; once every
rank has stopped the launcher prints the story once (``story``): one line for the rank that
ended first and how (a signal, and whether the kernel's OOM killer is the likely sender; or its
own error line and exit code; or, when the others only lost it, that it hung), at most one line
for each other rank ("stopped because rank 1 died"), and where to resume; exit 1
(``RunStopped``'s) or the failing rank's own code. A user's Ctrl-C or SIGTERM to this process is
forwarded to the ranks by the agent; then rank 0's "interrupted ..." line is the one printed,
exit 128 + the signal. torch's own log lines are kept out of the terminal: the story replaces
them.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from turnforge.dist import ERRORS_ENV, LOST_PEER, STOPPING, RankReport, read_reports
from turnforge.errors import RunStopped, UserError
from turnforge.runs import resume_lines


def start_ranks(cfg, run_dir: Path, argv: list[str], *, resume: bool) -> int:
    """Start ``cfg.dist.nproc`` trainer ranks of the run ``argv`` describes (``turnforge <argv>``)
    after every check that can fail before work; returns the exit status for the command line."""
    from turnforge.app.setup import preflight

    n = cfg.dist.nproc
    if cfg.cluster == "ray":  # the ranks are Ray actors on the cluster (turnforge.app.ray_ranks)
        preflight(cfg, run_dir, resume)  # every bad input is one line here, before any rank starts
        from turnforge.app.ray_ranks import launch_on_ray

        return launch_on_ray(cfg, run_dir, resume=resume)
    check_world(cfg, n)
    preflight(cfg, run_dir, resume)
    return launch(n, argv, threads=max(1, cfg.threads // n), run_dir=run_dir)


def check_world(cfg, n: int) -> None:
    """``--nproc`` against this machine: no more ranks than CPU cores (or GPUs with a GPU device)."""
    import torch

    if cfg.model.device.startswith("cuda") or (cfg.model.device == "auto" and torch.cuda.is_available()):
        gpus = torch.cuda.device_count()  # (none at all: model.device's own check names it)
        if gpus and n > gpus:
            raise UserError(f"--nproc {n} is more than the {gpus} GPUs here; use --nproc {gpus} or fewer")
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n > cores:
        raise UserError(f"--nproc {n} is more than the {cores} CPU cores this process may use; use --nproc {cores} or fewer")


# --- how the ranks ended --------------------------------------------------------------------------


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended: its exit status (an exit code, or minus the signal that killed it), its
    closing line (``dist.RankReport``; None when it ended without leaving one: killed, or gone
    before it could), and whether it had ended before the launcher stopped the others (``first``)."""

    rank: int
    status: int
    report: RankReport | None
    first: bool


def _lost_a_peer(end: RankEnd) -> bool:
    """The rank's own line says that another rank went away under it, or that a signal stopped it
    (the agent's SIGTERM reaching it before the collective failed)."""
    return end.report is not None and (end.report.interrupted or any(k in end.report.line for k in LOST_PEER))


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _cause(end: RankEnd, oom: bool | None) -> tuple[str, str]:
    """(one line saying how ``end``'s rank ended, the verb the other ranks' lines use for it)."""
    r = end.rank
    if not end.first:  # ended only when the launcher stopped it, while the others had lost it: it hung
        return (f"rank {r} hung: the other ranks gave up waiting for it in a collective (dist.timeout_s)"
                + (", and it did not stop when asked: the launcher killed it" if end.status == -signal.SIGKILL else ""), "hung")
    if end.status < 0:
        sig = -end.status
        line = f"rank {r} was killed by {_signal_name(sig)} (signal {sig})"
        if sig == signal.SIGKILL:  # the kernel's OOM killer sends SIGKILL, and so does `kill -9`
            line += {True: ": out of memory (the kernel's OOM killer killed a process of this run's memory cgroup)",
                     False: " from outside the run (the kernel counted no out-of-memory kill here)",
                     None: "; possibly out of memory (the kernel's OOM killer sends SIGKILL)"}[oom]
        return line, "died"
    if end.report is None:
        return f"rank {r} exited with code {end.status} before it could say why (its own output above may)", "failed"
    if end.report.interrupted:  # a signal sent to that rank alone, by someone else than the launcher
        return f"rank {r} was stopped by {_signal_name(end.status - 128)} sent to it alone: {end.report.line}", "was stopped"
    return f"rank {r} failed (exit code {end.status}): {end.report.line}", "failed"


def story(ends: Sequence[RankEnd], run_dir: Path | None, *, oom: bool | None = None) -> tuple[list[str], int]:
    """The lines to print after a run on several ranks, and the exit status. The cause is the
    rank that ended first in failure, unless its own line only says that another rank went away
    (then the cause is a rank that ended only when the launcher stopped it, without a line: it
    hung). ``oom``: whether the kernel counted an out-of-memory kill meanwhile (None: unknown)."""
    failed_first = [e for e in ends if e.first and e.status != 0]
    if not failed_first and all(e.status == 0 for e in ends):
        return [], 0
    causes = [e for e in failed_first if not _lost_a_peer(e)]
    if not causes:
        causes = [e for e in ends if not e.first and e.report is None and e.status != 0]
    if not causes:
        causes = failed_first or [e for e in ends if e.status != 0]
    causes = sorted(causes, key=lambda e: e.rank)
    told = [_cause(e, oom) for e in causes]
    lines = [line for line, _ in told]
    first, verb = causes[0].rank, told[0][1]
    for e in sorted(ends, key=lambda e: e.rank):
        if e in causes or (e.status == 0 and e.first):
            continue
        if e.report is not None and e.status > 0 and not _lost_a_peer(e):  # an error of its own, after the first
            alike = any(c.report is not None and c.report.line == e.report.line for c in causes)
            lines.append(f"rank {e.rank} failed alike (exit code {e.status})" if alike else
                         f"rank {e.rank} failed too (exit code {e.status}): {e.report.line}")
        else:
            lines.append(f"rank {e.rank}: stopped because rank {first} {verb}")
    own = [e.report.code for e in causes if e.report is not None and not e.report.interrupted and e.first]
    code = own[0] if own else RunStopped.exit_code
    if code != 2:  # (a user error in a rank: fix it first; its line says what)
        named = [e.report.line for e in sorted(ends, key=lambda e: e.rank)
                 if e.report is not None and e.report.interrupted and e.report.line.startswith("interrupted ")]
        lines += resume_lines(run_dir, named[0].removeprefix("interrupted ") if named else None)
    return lines, code


def interrupted_story(reports: dict[int, RankReport], run_dir: Path | None, signum: int) -> tuple[list[str], int]:
    """A user's signal to the launcher, forwarded to every rank: rank 0's "interrupted ..." line
    (the lowest rank's that has one), as one process would print it; exit 128 + the signal."""
    said = [reports[r].line for r in sorted(reports) if reports[r].interrupted]
    fallback = "interrupted" + (f"; resume with: turnforge train --resume {run_dir}" if run_dir is not None else "")
    return [said[0] if said else fallback], 128 + int(signum)


def _oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's memory cgroup so
    far (cgroup v2 ``memory.events``, v1 ``memory.oom_control``); None where neither can be read."""
    try:
        groups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for entry in groups:
        _, controllers, path = entry.split(":", 2)
        if controllers == "":
            f = Path("/sys/fs/cgroup", path.lstrip("/"), "memory.events")
        elif "memory" in controllers.split(","):
            f = Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.oom_control")
        else:
            continue
        try:
            fields = dict(line.split(maxsplit=1) for line in f.read_text().splitlines() if " " in line)
        except OSError:
            continue
        if "oom_kill" in fields:
            return int(fields["oom_kill"])
    return None


# --- torch's agent ---------------------------------------------------------------------------------


def _ended(pid: int) -> int | None:
    """Child ``pid``'s exit status once it has ended (its exit code, or minus the signal that
    killed it) without reaping it (``WNOWAIT``: the agent's poll reaps it next); None while it
    runs. A child already reaped was reaped by that poll without a failure (a failure ends the
    agent's monitoring): 0."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return 0
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _agent(spec, logs_specs, on_failure: Callable[[dict[int, int]], None]):
    """torch's ``LocalElasticAgent`` for ``spec``, which looks at the ranks before torch's poll
    does: ``ended`` (rank -> exit status, as each rank ends) and ``first`` (the ranks that had
    ended when the first failure was seen); ``on_failure(first)`` runs before the others get
    SIGTERM. torch's poll runs only after a look that saw a rank end, so it cannot find a failure
    the look missed, but for one in the instant between them after another rank's clean exit."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class _Agent(LocalElasticAgent):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.ended: dict[int, int] = {}
            self.first: dict[int, int] | None = None

        def _monitor_workers(self, worker_group):
            seen = len(self.ended)
            for w in worker_group.workers:
                if w.global_rank not in self.ended and (status := _ended(w.id)) is not None:
                    self.ended[w.global_rank] = status
            if len(self.ended) == seen:  # nothing ended: torch's poll would find nothing either (its
                return RunResult(state=WorkerState.HEALTHY)  # optional D-state check, off by default, is skipped)
            if self.first is None and any(self.ended.values()):
                self.first = dict(self.ended)
                on_failure(self.first)
            return super()._monitor_workers(worker_group)  # reaps; on a failure, SIGTERM to the rest

    return _Agent(spec, logs_specs=logs_specs, start_method="spawn")


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` while the agent starts the ranks (they inherit it)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _torch_log_off() -> Iterator[None]:
    """torch's elastic agent logs each step ("Sending process ... closing signal SIGTERM", "failed
    (exitcode: -9) ..."); the launcher's story replaces them in the terminal."""
    log = logging.getLogger("torch.distributed.elastic")
    handler, propagate = logging.NullHandler(), log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def launch(nproc: int, argv: Sequence[str], *, threads: int, run_dir: Path | None = None) -> int:
    """Run ``turnforge <argv>`` on ``nproc`` local ranks through torch's elastic agent (a
    standalone rendezvous on localhost, no restarts), each rank with ``threads`` intra-op threads;
    prints how they ended (``story``) and returns the exit status."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    reports = Path(tempfile.mkdtemp(prefix="turnforge-ranks-"))
    oom_before = _oom_kills()

    def on_failure(first: dict[int, int]) -> None:  # before the agent's SIGTERM reaches the others
        failed = ", ".join(f"rank {r} (status {s})" for r, s in sorted(first.items()) if s)
        (reports / STOPPING).write_text(f"stopping the ranks: {failed} ended\n")

    rendezvous = get_rendezvous_handler(RendezvousParameters("c10d", "localhost:0", uuid.uuid4().hex, 1, 1))
    spec = WorkerSpec(role="trainer", local_world_size=nproc, entrypoint=sys.executable,
                      args=("-u", "-m", "turnforge.cli", *argv), rdzv_handler=rendezvous, max_restarts=0,
                      monitor_interval=0.1)
    agent = _agent(spec, DefaultLogsSpecs(log_dir=str(reports / "torch")), on_failure)
    try:
        with _environment(OMP_NUM_THREADS=str(threads), **{ERRORS_ENV: str(reports)}), _torch_log_off():
            try:
                result = agent.run()
            except SignalException as err:  # the user's Ctrl-C or SIGTERM; the agent has passed it on to the ranks
                lines, code = interrupted_story(read_reports(reports), run_dir, err.sigval)
            else:
                statuses = dict.fromkeys(range(nproc), 0) | {r: f.exitcode for r, f in result.failures.items()}
                statuses |= {r: s for r, s in agent.ended.items() if r not in result.failures}
                found = read_reports(reports)
                first = agent.first if agent.first is not None else statuses
                oom_after = _oom_kills()
                oom = None if oom_before is None or oom_after is None else oom_after > oom_before
                ends = [RankEnd(r, s, found.get(r), r in first) for r, s in sorted(statuses.items())]
                lines, code = story(ends, run_dir, oom=oom)
            finally:
                rendezvous.shutdown()
        for line in lines:
            print(line, file=sys.stderr)
        return code
    finally:
        shutil.rmtree(reports, ignore_errors=True)
