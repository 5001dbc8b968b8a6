"""The trainer on N processes: torch.distributed with FSDP2 (``fully_shard``) over an explicit mesh.

One program runs on every rank (SPMD). A world of one process is today's run exactly: no
process group, no wrapper, no extra copy. With ``size > 1``:

- **Sharding.** The policy keeps its plain model (``Policy.model``) for sampling, scoring
  without gradients and saving; the updates run through ``Policy.trainer``, a copy sharded
  with ``fully_shard`` per decoder block and on the root over ``init_device_mesh(device,
  (size,))``: parameters, gradients and AdamW's state are split over the ranks. After an
  update ``sync_sampler`` gathers the new weights one tensor at a time into the plain model
  (the in-process form of a weight push: every rank samples with the same weights).
  Departure from verl/SkyRL: they hand the gathered weights to vLLM; here the sampler is the
  HF model itself (a CPU run has no vLLM), at the cost of one full copy of the parameters per
  rank beside the shards.
- **Reductions.** A minibatch's rows are split over the ranks (``rank_slice``); each rank's
  loss is its share of a global weighted mean (``minibatch_share``: ``size * w_rank / w_total``,
  with ``w`` the minibatch's token weights), so FSDP's mean over ranks gives the gradient
  of 1 rank with the whole minibatch, token-weighted as before. A rank's rows may take several
  passes of at most ``model.micro_batch_tokens`` padded tokens (``micro_batches``), their
  gradients added before the step.
- **Data.** Every rank runs the same program; only rank 0 writes the run directory (the
  others read it: a checkpoint to resume from, rank 0's base model). Objects (an iteration's
  trajectories, counters) travel with ``gather``/``broadcast``.

Every collective has the process group's timeout (``dist.timeout_s``): a rank that dies or
hangs stops the others within it. The launchers live in the application layer
(``turnforge.app.launch``: torch's elastic agent; ``turnforge.app.ray_ranks``); a rank leaves its
closing line for turnforge's launcher (``report_failure``) and learns from it whether a SIGTERM
is a user's interrupt or the launcher stopping it because another rank failed
(``stopped_by_launcher``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch

T = TypeVar("T")

#: What a rank reports when another rank went away under it (a collective's peer closed or timed out).
LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "timed out", "Timed out", "Timeout", "Broken pipe")

#: Per-rank closing lines (``RankReport``): a directory turnforge's launcher names, each rank writes ``rank<R>.json``.
ERRORS_ENV = "TURNFORGE_RANK_ERRORS"
#: The launcher's note in that directory: written before it stops the ranks because one ended in failure.
STOPPING = "stopping"


@dataclass(frozen=True)
class World:
    """Who this process is among the trainer's ranks."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    backend: str | None = None  # 'gloo' / 'nccl'; None in a world of one

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


_WORLD = World()


def world() -> World:
    """This process's world (a world of one until ``init_world``)."""
    return _WORLD


def launched_size() -> int:
    """The world size torch's launcher set for this process (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank as torch's launcher set it (0 when not launched by it); known before
    ``init_world`` joins the process group."""
    return int(os.environ.get("RANK", "0")) if launched_size() > 1 else 0


def init_world(backend: str, timeout_s: float, device: str = "cpu") -> World:
    """Join the process group of a launcher-started run (``WORLD_SIZE``, ``RANK``,
    ``LOCAL_RANK`` and the rendezvous from ``torch.distributed.run``); a world of one when not
    launched. ``backend``: 'auto' (gloo on CPU, NCCL on a GPU), 'gloo' or 'nccl'."""
    global _WORLD
    size = launched_size()
    if size <= 1:
        _WORLD = World()
        return _WORLD
    import torch.distributed as dist

    chosen = ("nccl" if device.startswith("cuda") else "gloo") if backend == "auto" else backend
    if chosen == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(chosen, timeout=timedelta(seconds=timeout_s))
    _WORLD = World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                   int(os.environ.get("LOCAL_WORLD_SIZE", str(size))), chosen)
    return _WORLD


def shutdown(wait: bool = True) -> None:
    """Leave the process group (a world of one again). ``wait``: after a barrier, so that no rank
    tears its connections down while another still uses them (gloo then aborted a rank at exit
    in 4 of about 20 runs); pass False when a rank failed (the others may be gone, and the
    barrier would wait for ``dist.timeout_s``)."""
    global _WORLD
    if _WORLD.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            if wait:
                dist.barrier()
            dist.destroy_process_group()
    _WORLD = World()


# --- sharding --------------------------------------------------------------------------------


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of an HF causal LM (a PEFT model's too): the units FSDP2
    shards one at a time; [] for a model without a known block list (the root group holds all)."""
    for name in ("layers", "h", "blocks"):
        for module in model.modules():
            blocks = getattr(module, name, None)
            if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 0:
                return list(blocks)
    return []


def shard(model: torch.nn.Module, w: World | None = None) -> torch.nn.Module:
    """``model`` sharded in place with FSDP2 over a 1-D mesh of the world (gloo on CPU, NCCL on
    a GPU): one ``fully_shard`` per decoder block, then the root (embeddings, final norm, the
    LM head). Frozen parameters (a LoRA base) are sharded too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    w = w or _WORLD
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (w.size,))
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@torch.no_grad()
def sync_weights(trainer: torch.nn.Module | None, plain: torch.nn.Module) -> None:
    """Copy a sharded ``trainer``'s (``sharded_copy``) updated weights into its ``plain`` model, one
    tensor at a time (each rank gathers a parameter's shards, copies, frees them: never a second
    full model). Only the trainable tensors move (a LoRA run: the adapter). Nothing to do without
    a trainer (a world of one, where updates run through ``plain`` itself)."""
    if trainer is None:
        return
    named = dict(plain.named_parameters())
    for name, p in trainer.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            named[name].copy_(full)


def sync_sampler(policy) -> None:
    """The policy's trainer's new weights into the model it samples with (``sync_weights``), at the
    policy's version (bumped first); on several ranks with inference replicas, on to them
    (``ServerSampler.publish``, a collective; in a world of one the replicas get the weights when
    they are next sampled with)."""
    sync_weights(getattr(policy, "trainer", None), policy.model)
    publish_weights(policy)


def publish_weights(policy) -> None:
    """On several ranks with inference replicas (``rollout.backend=server``): the policy's
    sampling model at its version, to them (``ServerSampler.publish``, a collective every rank
    calls alike); nothing otherwise."""
    publish = getattr(policy.sampler, "publish", None)
    if publish is not None and _WORLD.distributed:
        publish(policy.model, policy.version)


@torch.no_grad()
def broadcast_weights(model: torch.nn.Module, src: int = 0) -> None:
    """Every rank's ``model`` gets rank ``src``'s weights (and buffers)."""
    if not _WORLD.distributed:
        return
    import torch.distributed as dist

    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src)


# --- reductions and objects ----------------------------------------------------------------------


def rank_slice(items: Sequence[T], w: World | None = None) -> list[T]:
    """This rank's share of ``items``: every ``size``-th, from its rank (all of them in a world of one)."""
    w = w or _WORLD
    return list(items) if w.size == 1 else list(items[w.rank::w.size])


def all_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sums of ``values`` over the ranks (float64; ``values`` as given in a world of one)."""
    if not _WORLD.distributed:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def minibatch_share(rows: Sequence[T], weight: Callable[[T], float]) -> tuple[list[T], float]:
    """This rank's rows of a global minibatch (``rank_slice``) and the factor its loss takes:
    ``size * w_rank / w_total``, with ``w`` the rows' ``weight`` (the weight the loss's mean
    divides by), so that FSDP's mean of the ranks' gradients is the gradient of the mean over
    the whole minibatch. Every rank holds the whole minibatch's rows, so no message is needed.
    A rank left without rows gets the first row with factor 0: it still runs the forward and
    backward passes whose collectives the other ranks wait on. ``(rows, 1.0)`` in a world of one."""
    if not _WORLD.distributed:
        return list(rows), 1.0
    mine = rank_slice(rows)
    total = float(sum(weight(r) for r in rows))
    share = _WORLD.size * float(sum(weight(r) for r in mine)) / total if total > 0 else 0.0
    return (mine, share) if mine else ([rows[0]], 0.0)


@dataclass(frozen=True)
class Pass:
    """One forward and backward pass of a minibatch step (``micro_batches``): this rank's ``rows``,
    the ``factor`` its loss takes (as ``minibatch_share``'s; 0 for a placeholder row) and
    ``fraction``, the pass's share of the whole minibatch's weight over all ranks (for a term
    that is not a plain sum over rows, taken per pass)."""

    rows: list
    factor: float
    fraction: float


def micro_batches(rows: Sequence[T], weight: Callable[[T], float], length: Callable[[T], int],
                  budget: int) -> list[Pass]:
    """This rank's rows of a global minibatch (``minibatch_share``) in passes of at most ``budget``
    padded tokens each (rows x the longest ``length``; 0: one pass), whose gradients add up to the
    minibatch's: pass ``p`` takes ``size * w_p / w_total``. Rows that fit in one pass are that pass
    as given (the step is then exactly ``minibatch_share``'s); otherwise they are packed longest
    first (a row longer than the budget is a pass alone), which also pads less. Every rank runs
    the same number of passes (FSDP's collectives): a rank with fewer gets placeholder passes of
    factor 0. Departure from verl's dynamic batch size: the budget counts padded tokens, as the
    collated batch holds them, not the rows' own lengths."""
    size = _WORLD.size if _WORLD.distributed else 1
    slices = [list(rows[r::size]) for r in range(size)] if size > 1 else [list(rows)]
    packed = [_pack(x, length, budget) for x in slices]
    mine = packed[_WORLD.rank if size > 1 else 0]
    if len(packed) == 1 and len(mine) == 1:
        return [Pass(mine[0], 1.0, 1.0)]
    total = float(sum(weight(r) for r in rows))
    out, n = [], max(len(x) for x in packed)
    for p in range(n):
        everyone = sum(weight(r) for x in packed if p < len(x) for r in x[p])
        fraction = 1.0 if n == 1 else everyone / total if total > 0 else 0.0
        if p < len(mine):
            out.append(Pass(mine[p], size * float(sum(weight(r) for r in mine[p])) / total if total > 0 else 0.0, fraction))
        else:
            out.append(Pass([rows[0]], 0.0, fraction))
    return out


def _pack(rows: list[T], length: Callable[[T], int], budget: int) -> list[list[T]]:
    """``rows`` in passes of at most ``budget`` padded tokens (see ``micro_batches``); ``[rows]``
    when they fit in one (or ``budget`` is 0). An empty list has no pass."""
    if not rows:
        return []
    if budget <= 0 or len(rows) * max(length(r) for r in rows) <= budget:
        return [rows]
    parts: list[list[T]] = []
    for r in sorted(rows, key=length, reverse=True):  # stable: equal lengths keep their order
        if parts and (len(parts[-1]) + 1) * length(parts[-1][0]) <= budget:
            parts[-1].append(r)
        else:
            parts.append([r])
    return parts


def masked_mean_over_ranks(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The masked mean of ``x`` over the whole minibatch, every rank's rows (a world of one:
    ``masked_mean``). Its value is the global mean on every rank; its gradient on a rank is
    ``size`` times its own rows' part (``d S_rank / C``), so FSDP's mean over the ranks gives
    the gradient of the global mean. For a loss that is not a plain sum over rows (the entropy
    floor's hinge on the mean)."""
    from turnforge.algos import masked_mean

    if not _WORLD.distributed:
        return masked_mean(x, mask)
    local = (x * mask).sum()
    total, count = all_sum([float(local.detach()), float(mask.sum())])
    count = max(count, 1e-12)
    return _WORLD.size * (local - local.detach()) / count + total / count


def share_weighted(values: Sequence[Sequence[float]], shares: Sequence[float | Sequence[float]]) -> list[list[float]]:
    """Per-minibatch figures (a loss, a clip fraction; one row per minibatch) over all ranks: each
    rank's row times its minibatch ``share`` (one per row, or one per figure of the row when the
    figures are means over different weights: a loss over its weights, an entropy over tokens),
    averaged over the ranks, in one message for all the rows; ``values`` as given in a world of one."""
    if not _WORLD.distributed:
        return [list(v) for v in values]
    width = len(values[0]) if values else 0
    per_figure = [sh if isinstance(sh, Sequence) else [sh] * width for sh in shares]
    flat = all_sum([x * sh for row, row_shares in zip(values, per_figure) for x, sh in zip(row, row_shares)])
    return [[x / _WORLD.size for x in flat[i * width:(i + 1) * width]] for i in range(len(values))]


def gather(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` in a world of one)."""
    if not _WORLD.distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * _WORLD.size
    dist.all_gather_object(out, obj)
    return out


def summed(parts: Sequence[T]) -> T:
    """Dataclasses of counters (one per rank, from ``gather``) added field by field."""
    return type(parts[0])(**{f.name: sum(getattr(p, f.name) for p in parts) for f in dataclasses.fields(parts[0])})


def ranked_play(play: Callable[[list[T], Callable[[int], None] | None], tuple[list[Any], Any]], items: Sequence[T],
                on_progress: Callable[[int], None] | None = None) -> tuple[list[Any], Any]:
    """``play(items, on_progress)`` (results in item order, and a dataclass of counters) with the
    items dealt to the ranks: rank r plays items r, r + size, ...; every rank gets all the results
    in item order and the counters summed (``summed``). ``on_progress`` hears this rank's count
    times the ranks (rank 0 shows it). ``play(items, on_progress)`` itself in a world of one."""
    if not _WORLD.distributed:
        return play(list(items), on_progress)
    size = _WORLD.size
    progress = None if on_progress is None else (lambda n: on_progress(min(len(items), n * size)))
    parts = gather(play(list(items[_WORLD.rank::size]), progress))
    out: list[Any] = [None] * len(items)
    for r, (results, _) in enumerate(parts):
        out[r::size] = results
    return out, summed([counters for _, counters in parts])


def broadcast(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank."""
    if not _WORLD.distributed:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def barrier() -> None:
    if _WORLD.distributed:
        import torch.distributed as dist

        dist.barrier()


# --- failures: what a rank leaves for its launcher -------------------------------------------------


@dataclass(frozen=True)
class RankReport:
    """A rank's closing line, left for turnforge's launcher to print (``turnforge.app.launch``):
    the line the rank would have printed (``error: ...``, ``interrupted during ...; resume
    with: ...``), its exit status, and whether a signal interrupted it (``Interrupted``)."""

    rank: int
    code: int
    line: str
    interrupted: bool = False


def _reports_dir() -> Path | None:
    """The launcher's directory for this rank's report (``ERRORS_ENV``); None outside turnforge's
    launcher (a world of one, plain ``torchrun``, a Ray actor)."""
    where = os.environ.get(ERRORS_ENV)
    return Path(where) if where and launched_size() > 1 else None


def report_failure(message: str, code: int = 1, *, interrupted: bool = False) -> bool:
    """Leave this rank's closing line (the last line of ``message``) and exit status for turnforge's
    launcher, which prints every rank's story once all have stopped; the first report of a rank is
    its cause. True when that launcher is there to print it (the rank then prints nothing itself)."""
    where = _reports_dir()
    if where is None:
        return False
    rank = launched_rank()
    path = where / f"rank{rank}.json"
    if not path.exists():
        cause = message.strip().splitlines()[-1] if message.strip() else "failed"
        report = RankReport(rank, int(code), cause, interrupted)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(report)))
        tmp.replace(path)  # whole or absent for the launcher
    return True


def read_reports(directory: Path) -> dict[int, RankReport]:
    """The ranks' reports in ``directory`` (``report_failure``), by rank."""
    reports = [RankReport(**json.loads(p.read_text())) for p in Path(directory).glob("rank*.json")]
    return {r.rank: r for r in reports}


def stopped_by_launcher() -> bool:
    """Whether turnforge's launcher is stopping this rank because another rank ended in failure
    (it leaves ``STOPPING`` in the reports' directory before it sends SIGTERM): a SIGTERM that is
    not a user's interrupt, and an error that is the other rank's fault, not this one's."""
    where = _reports_dir()
    return where is not None and (where / STOPPING).exists()


def sharded_copy(model: torch.nn.Module) -> torch.nn.Module | None:
    """On several ranks: a fresh copy of ``model`` sharded with FSDP2 (``shard``), the module its
    updates run through (``sync_weights`` copies them back); in a world of one, None (updates run
    through ``model`` itself)."""
    import copy

    return shard(copy.deepcopy(model)) if _WORLD.distributed else None


def attach_trainer(policy) -> None:
    """``policy.trainer`` becomes ``sharded_copy(policy.model)``, the module the next stage
    optimizes (None in a world of one). Called again when the model's structure changes (a LoRA
    adapter merged and a new one added after BC)."""
    policy.trainer = None  # the old copy freed before the new one is made
    policy.trainer = sharded_copy(policy.model)


# --- optimizer state across world sizes ---------------------------------------------------------

#: Key of a checkpoint's optimizer state written by torch.distributed.checkpoint (every rank its
#: shards, ``ShardedOptimizer``); its value names the directory.
SHARDED = "sharded"
#: Key of an optimizer state saved whole by parameter name (checkpoints written before sharded saves).
BY_NAME = "by_name"


@dataclass
class ShardedOptimizer:
    """An optimizer's sharded state, still on the ranks: ``write`` is a collective that saves each
    rank's shards into one directory (``torch.distributed.checkpoint``: a file per rank and the
    metadata that lets any world size read it back), so no rank ever holds the whole state."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def write(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save({"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}, checkpoint_id=directory)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | ShardedOptimizer:
    """The optimizer state a checkpoint keeps. A world of one: ``optimizer.state_dict()`` as
    always. Several ranks: a ``ShardedOptimizer`` that the checkpoint writes rank by rank
    (``turnforge.train.run_dir.checkpoint.save_resumable``); either resumes at any world size
    (``load_optimizer_state``)."""
    return optimizer.state_dict() if not _WORLD.distributed else ShardedOptimizer(model, optimizer)


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Restore ``optimizer_state``'s result, whichever world size saved it. A sharded save
    (``{SHARDED: directory}``) is read by parameter name and resharded to this world (into a
    world of one without a process group); a world of one's positional state is loaded as
    always, or on several ranks renamed first (the optimizer's parameters are the model's
    trainable ones, in order)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

    if SHARDED in saved:
        import torch.distributed.checkpoint as dcp

        template = get_optimizer_state_dict(model, optimizer)  # this world's layout, the state allocated
        dcp.load({"optimizer": template}, checkpoint_id=saved[SHARDED])
        set_optimizer_state_dict(model, optimizer, template)
        return
    if BY_NAME not in saved and not _WORLD.distributed:
        optimizer.load_state_dict(saved)
        return
    by_name = saved[BY_NAME] if BY_NAME in saved else _named(model, saved)
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _named(model: torch.nn.Module, saved: dict[str, Any]) -> dict[str, Any]:
    """A positional ``optimizer.state_dict()`` keyed by the names of ``model``'s trainable parameters."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {
        "state": {names[i]: v for i, v in saved["state"].items()},
        "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in saved["param_groups"]],
    }
