"""The run's records, typed: what ``metrics.jsonl`` holds, and the reader benchmarks use.

Every line of ``RUN/metrics.jsonl`` is one event: ``{"event": KIND, "env_steps": N, "time": T,
...fields of its record}``, with nested records as nested objects. ``EVENTS`` maps each kind
to its record class; the fields are documented here, once. ``read_metrics(run_dir)`` returns
them as these dataclasses (``RunMetrics``), so nothing downstream parses keys by hand; a line
with a field its class does not have is an error, so schema drift shows.

Kinds: ``bc_epoch`` (``BCEpoch``), ``bc_done`` (``BCStats``), ``eval`` (``EvalRecord``),
``value_pretrain`` (``ValuePretrainStats``), ``rl_iter`` (``IterationMetrics``), ``warning``
(``RunWarning``), ``flywheel_round`` (``FlywheelRound``), ``boundary`` (``BoundaryReport``).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from turnforge.data.filters import FilterCount
from turnforge.envpool.pool import PoolStats
from turnforge.inference.client import ServerStats
from turnforge.memory import PeakMemory
from turnforge.rollout.engine import RolloutStats
from turnforge.runs import RunDir
from turnforge.train.mechanisms import MechanismRecord
from turnforge.types import EvalResult, Trajectory


@dataclass(frozen=True)
class BCEpoch:
    """One epoch of behaviour cloning."""

    epoch: int
    loss: float  # the epoch's mean loss per action token (its minibatches' losses weighted by their action tokens)
    env_steps: int = 0
    time: float = 0.0


@dataclass(frozen=True)
class BCStats:
    """The behaviour-cloning stage."""

    demonstrations: int  # demonstration episodes kept (infra failures left out; all are in bc_demos.parquet)
    demo_env_steps: int
    demo_samples: int  # training samples they gave
    demo_infra_failures: int  # demonstration episodes lost to env failures
    expert_success_rate: float  # share of kept demonstrations that succeeded
    expert_noise: float  # bc.expert_noise
    demo_random_actions: int  # turns where the noisy demonstrator played a random action
    final_loss: float
    optimizer_steps: int
    skipped_steps: int  # optimizer steps skipped for a non-finite loss or gradient
    env_steps: int = 0
    time: float = 0.0


@dataclass(frozen=True)
class ValuePretrainStats:
    """Value pretraining of the learned critic on Monte-Carlo returns of the BC policy."""

    steps: int  # optimizer steps taken
    passes: int  # passes over the states
    explained_variance: float  # on the held-back states, at the end
    states: int
    held_back: int
    episodes: int  # BC-policy episodes it fitted (infra failures left out)
    infra_failures: int = 0  # BC-policy episodes lost to infrastructure failures
    env_steps: int = 0
    time: float = 0.0


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation (before RL, every ``eval.every`` iterations, after RL)."""

    tag: str  # "before-rl", "rl-N", "after-rl"
    iteration: int  # RL iterations done when it ran
    result: EvalResult
    env_events: dict[str, int] = field(default_factory=dict)  # event counters (``n_*`` info keys) of its scored episodes
    temperature: float | None = None  # the sampling temperature it ran at (None in runs written before it was kept)
    env_steps: int = 0
    time: float = 0.0


@dataclass(frozen=True)
class PassAtK:
    """pass@k at one k: the unbiased estimator (``turnforge.algos.boundary.pass_at_k``) averaged over tasks."""

    k: int
    value: float | None  # mean over the tasks with at least k scored samples; None when no task has k
    tasks: int  # tasks averaged (a task whose samples infrastructure failures cut below k is left out)


@dataclass(frozen=True)
class BoundaryReport:
    """The boundary of what the policy solves (``turnforge.train.boundary``): N samples on each of
    T held-out tasks at a sampling temperature. Sharpening (concentrating on what it already
    solves) raises pass@1 but not pass@k at large k; expansion (solving what it never solved)
    raises both and lowers the never-solved share. Infrastructure failures are left out of
    every rate and counted."""

    tag: str  # "start" (after BC, or the model itself without BC), "after" (after training), "eval" (turnforge eval)
    split: str  # the tasks' split (eval.split)
    tasks: int  # T: held-out tasks 0..T-1 (the first of the evaluation's tasks)
    samples_per_task: int  # N (eval.pass_at_k_samples)
    temperature: float  # the samples' sampling temperature (eval.pass_at_k_temperature, default rollout.temperature)
    pass_at_k: tuple[PassAtK, ...]  # one per k of eval.pass_at_k
    never_solved_at_8: float | None  # expected share of the T tasks with no success among 8 samples: mean of
    #   C(n-c, 8) / C(n, 8) = 1 - pass@8 (None when N < 8)
    never_solved_at_64: float | None  # the same at 64 samples (None when N < 64)
    solved_tasks: int  # tasks with at least one success among their N samples
    distinct_successes: float | None  # distinct successful action sequences per task, over tasks with a success
    entropy: float | None  # mean next-token entropy (nats, T=1) of the policy on the samples' action tokens
    action_mi: float | None  # I(A; O) in nats of the first action over the action names across the T tasks'
    #   first observations (None for open-text envs); 0 = the first action ignores the observation
    action_mi_max: float | None  # log(number of action names): the most I(A; O) can be
    malformed_rate: float  # invalid actions / actions in the samples (at ``temperature``)
    eval_temperature: float  # eval.temperature
    eval_malformed_rate: float  # invalid actions / actions of the evaluation of the same weights at eval.temperature
    episodes: int  # samples scored (infrastructure failures left out)
    infra_failures: int  # samples lost to infrastructure failures
    turns: int  # env steps the samples played (not counted in the run's env steps)
    seconds: float  # wall time of the measurement (sampling and scoring)
    policy_version: int
    env_events: dict[str, int] = field(default_factory=dict)  # event counters (``n_*`` info keys) of its scored samples
    solved: tuple[int, ...] = ()  # indices of the tasks with at least one success among their N samples (levels
    #   gained and lost against the start: ``turnforge.algos.boundary.gained_and_lost``; () in records before it)
    env_steps: int = 0
    time: float = 0.0

    def at(self, k: int) -> float | None:
        """pass@k at ``k`` (None when ``k`` was not reported)."""
        return next((p.value for p in self.pass_at_k if p.k == k), None)


@dataclass(frozen=True)
class AWRStats:
    """A flywheel round's advantage-weighted regression (``flywheel.weighting=mc_awr`` or
    ``group_awr``, ``turnforge.train.awr``): the estimates and the weights they gave."""

    states: int  # distinct states whose V(s) was estimated (group_awr: visited more than once)
    actions: int  # distinct (state, action) pairs whose Q(s, a) was estimated
    restarts: int  # Monte-Carlo episodes played, failed ones included (group_awr: 0)
    failed: int  # restarts lost to infrastructure failures (left out of the means)
    env_steps: int  # env steps of the restarts (part of the round's env_steps)
    samples: int  # turns weighted (mc_awr: every turn of the round's scored episodes)
    value_stderr: float  # mean standard error of the V and Q estimates
    mean_abs_advantage: float  # mean |Q(s, a) - V(s)| over the samples
    positive_share: float  # share of samples with A > 0
    mean_weight: float
    clipped_share: float  # share of samples at flywheel.awr_max_weight
    ess: float  # Kish's effective sample size of the weights, as a share of the samples


@dataclass(frozen=True)
class FlywheelRound:
    """One data-flywheel round (``turnforge.train.flywheel``). Episode counts are
    (scored episodes, successes), infrastructure failures left out."""

    round: int
    round_env_steps: int  # turns played this round (all sources)
    tasks: int  # distinct tasks of the waves (fresh ones and the mechanisms')
    plain: tuple[int, int]  # the waves' episodes of fresh tasks
    unsolved_tasks: int  # tasks of the waves none of whose rollouts succeeded (after the mechanisms' re-attempts)
    filters: list[FilterCount]  # what each filter kept, in order
    rft_samples: int  # samples of the round's RFT stage (kept + replayed + the mechanisms' own: negatives' failed turns)
    entropy: float | None  # mean next-token entropy on the round's plain action tokens, before the update
    eval: EvalResult
    seconds: float
    mechanisms: dict[str, MechanismRecord] = field(default_factory=dict)  # each of flywheel.mechanisms' part, by
    #   name (its class's Record, turnforge.train.mechanisms: its episodes and what it keeps), in registry order
    expert_queries: int = 0  # solver-backed hints shown so far (guidance)
    anchor_expert_moves: int = 0  # expert moves played to find anchor states, so far
    boundary: BoundaryReport | None = None  # pass@k after the round (flywheel.pass_at_k)
    awr: AWRStats | None = None  # flywheel.weighting=mc_awr|group_awr: the round's advantages and weights
    pass_k_dropped: int = 0  # flywheel.pass_k >= 2: kept episodes left out (weight 0: too few failures beside them)
    memory_entries: int = 0  # episodic memory (memory.enabled): tasks remembered after the round
    memory_added: int = 0  # of them, entered or shortened by this round
    memory_recalls: int = 0  # the round's episodes shown past successes
    summaries: SummaryStats | None = None  # rollout.context=summarize: the summaries the round's episodes wrote
    thinking_tokens: int = 0  # a reasoning template's: sampled tokens before the answers of the round's episodes
    answer_tokens: int = 0  # ... and of the answers (every sampled token without thinking)
    thinking_cuts: int = 0  # ... and the turns whose thinking reached rollout.thinking_budget
    env_steps: int = 0
    time: float = 0.0


@dataclass(frozen=True)
class TemperatureEval:
    """The BC policy evaluated at one sampling temperature."""

    temperature: float
    result: EvalResult


@dataclass(frozen=True)
class BestTemperature:
    """The BC policy at its best sampling temperature (``eval.bc_temperatures``): the
    baseline learning is stated against."""

    temperature: float
    eval: EvalResult
    all: list[TemperatureEval]


@dataclass(frozen=True)
class ExpertQueries:
    """Every label or hint an expert (the env's solver) gave the run."""

    demonstration_actions: int  # expert moves in the BC demonstrations (random moves of a noisy one left out)
    hints: int  # solver-backed hints shown in guided flywheel episodes
    total: int
    anchor_moves: int = 0  # expert moves played to find the flywheel's anchor states


@dataclass(frozen=True)
class OffPolicyStats:
    """The decoupled objective's view of an iteration's samples (asynchronous rollouts, or
    another engine's numerics: vLLM, inference replicas). ``logprob_mismatch_*``,
    ``log_ratio_abs_*`` and ``ratio_out_of_band`` are the mismatch watch; the ``token_ratio_*`` and
    ``sequence_ratio_*`` quantiles are the distribution of ``pi_prox / pi_behav`` that
    ``engine.correction`` weighs (``turnforge.algos.corrections``), over the update's rows
    (repeated samples once; a sequence is a row, its ratio the geometric mean of its tokens')."""

    offpolicy_token_fraction: float  # action tokens sampled by an older policy version
    is_weight_mean: float  # mean off-policy weight of engine.correction (tis: min(pi_prox / pi_behav, engine.tis.cap))
    is_weight_max: float  # largest token ratio pi_prox / pi_behav, before any cut (never below 1)
    is_truncated_fraction: float  # tokens whose ratio leaves the correction's band (tis: weight hit the cap)
    logprob_mismatch_max: float  # |p_trainer - p_rollout| on tokens the current version sampled (numerics)
    logprob_mismatch_mean: float
    log_ratio_abs_max: float = 0.0  # |logp_trainer - logp_rollout| on the same tokens
    log_ratio_abs_mean: float = 0.0
    ratio_out_of_band: float = 0.0  # share of those tokens whose p_trainer / p_rollout leaves [0.9, 1.1]
    token_ratio_p1: float = 1.0  # quantiles of pi_prox / pi_behav over the action tokens
    token_ratio_p50: float = 1.0
    token_ratio_p99: float = 1.0
    sequence_ratio_p1: float = 1.0  # ... and over the sequences (geometric mean of a row's token ratios)
    sequence_ratio_p50: float = 1.0
    sequence_ratio_p99: float = 1.0
    sequence_out_of_band: float = 0.0  # share of sequences whose ratio leaves the correction's band
    masked_fraction: float = 0.0  # share of action tokens the correction gave weight 0 (no policy gradient)


@dataclass(frozen=True)
class UpdateStats:
    """The policy update of one iteration (``rl.epochs`` passes of PPO-clip minibatch steps)."""

    loss: float  # mean over minibatch steps
    clip_fraction: float  # share of action tokens whose ratio was clipped
    approx_kl: float  # KL(old || new) estimate between rollout and updated policy
    kl_ref: float  # KL to the reference (the BC policy) in the loss; 0 without one
    entropy: float  # mean policy entropy on action tokens
    grad_norm: float  # mean gradient norm before clipping
    tokens: int  # tokens trained on (repeated samples counted once per copy)
    merged_row_fraction: float  # rows after merging repeated samples / samples (1 = nothing merged)
    offpolicy: OffPolicyStats | None = None  # asynchronous or vLLM rollouts only
    rehearsal_nll: float | None = None  # rl.rehearsal_coef > 0: mean NLL of the rehearsed samples (per action token)


@dataclass(frozen=True)
class PolicyIteration:
    """One policy's part of an RL iteration (``agent.policies``): its episodes, its reward, its update."""

    episodes: int  # episodes in which it was called (infrastructure failures excluded)
    calls: int  # its calls in them
    reward: float  # its mean reward over those episodes (the agent's ``rewards[name]``, else ``reward``)
    samples: int  # (sample, advantage) pairs it trained on
    zero_variance_groups: float  # share of its groups whose advantages were all 0
    update: UpdateStats


@dataclass(frozen=True)
class PolicySummary:
    """One policy's RL stage (``agent.policies``; ``RunSummary.policies``)."""

    calls: int  # its calls in the RL iterations' episodes
    train_tokens: int  # action tokens its updates trained on
    reward_first: float | None  # its mean reward in the first RL iteration
    reward_last: float | None  # and in the last
    adapter_change: float  # ||scale * B A||_F over its adapted layers: how far its adapter moved the base (0 at the start)


@dataclass(frozen=True)
class StreamStats:
    """How the rollout engine's group stream produced the iteration's batch."""

    env_steps_executed: int  # env steps the engine ran so far (running and discarded episodes included)
    trainer_wait_seconds: float  # the trainer waited this long for the batch
    trainer_idle_ratio: float  # share of the RL stage's wall time spent waiting for batches so far
    stale_restarts: int  # groups restarted for exceeding the staleness bound (partial rollouts)
    resumed_steps: int  # steps of the batch replayed from a snapshot after an env worker crash
    mean_generation_batch: float  # episodes per generation call (last 200 calls)
    staleness_mean: float | None = None  # trainer version minus each trajectory's oldest token version
    staleness_max: int | None = None
    staleness_shares: tuple[float, ...] = ()  # share of trajectories at staleness 0, 1, ..., eta
    env_pool: PoolStats | None = None  # the stream's env workers (engine.env_workers > 0)


@dataclass(frozen=True)
class CriticStats:
    """State values for GAE (``rl.advantage=gae``)."""

    value_loss: float | None = None  # the learned critic's clipped value loss (None without one)
    explained_variance: float | None = None  # of the learned critic's rollout-time values vs its targets
    explained_variance_used: float | None = None  # of the values GAE used (learned, Monte-Carlo or blended)


@dataclass(frozen=True)
class MCStats:
    """Monte-Carlo rollouts from env snapshots (MC-critic values, MC-GRPO's Q values)."""

    states: int  # distinct states (MC-GRPO: states sampled at)
    env_steps: int  # env steps of the Monte-Carlo rollouts (not counted in the run's env steps)
    failed: int  # rollouts lost to infra failures (excluded from the means)
    value_stderr: float  # mean standard error of the estimates
    rollouts: int = 0  # Monte-Carlo rollouts played, failed ones included
    distinct_actions: float | None = None  # MC-GRPO: distinct actions scored per state
    q_std: float | None = None  # MC-GRPO: mean std of Q within a state's group


@dataclass(frozen=True)
class SummaryStats:
    """The summaries written in a set of episodes (``rollout.context=summarize``): one per
    segment that ends in one, its length the segment's ``summary_tokens``."""

    count: int  # summaries written
    mean_tokens: float  # their mean length in tokens (a sampled stop token included); 0 without any
    max_tokens: int  # the longest (rollout.summary_max_tokens caps it)


def summary_stats(trajectories: Sequence[Trajectory]) -> SummaryStats:
    """Count and lengths of the summaries in ``trajectories``' segments."""
    lengths = [x.summary_tokens for t in trajectories for x in t.samples if x.summary_tokens > 0]
    return SummaryStats(len(lengths), sum(lengths) / len(lengths) if lengths else 0.0, max(lengths, default=0))


def summary_text(stats: SummaryStats) -> str:
    """'12 (mean 6.5, max 8 tokens)', the summaries of a log line."""
    return f"{stats.count} (mean {stats.mean_tokens:.1f}, max {stats.max_tokens} tokens)"


@dataclass(frozen=True)
class IterationMetrics:
    """One RL iteration (event ``rl_iter``)."""

    iteration: int  # RL iterations done, this one included
    reward: float  # mean episode return of the batch (infra failures excluded: rollout.infra_failures of rollout.episodes)
    success: float  # share of those episodes that succeeded
    invalid_action_rate: float  # invalid actions / actions
    mean_turns: float
    samples: int  # (sample, advantage) pairs trained on, after the zero-variance filter
    lr: float
    zero_variance_groups: float  # share of groups whose advantages were all 0
    group_return_std: float  # mean std of episode returns within a group
    action_tokens_per_turn: float
    update: UpdateStats
    rollout: RolloutStats  # counters of the batch: episodes, infra failures, truncations, overflows
    stream: StreamStats
    rollout_seconds: float  # waiting for the batch (lock-step: playing it)
    credit_seconds: float  # advantages (Monte-Carlo rollouts included)
    update_seconds: float
    gen_tokens_per_s: float  # action tokens of the batch / rollout seconds
    train_tokens_per_s: float
    skipped_steps: int  # optimizer steps skipped so far (non-finite loss or gradient)
    policy_version: int
    env_events: dict[str, int] = field(default_factory=dict)  # env event counters (``n_*`` info keys) summed
    critic: CriticStats | None = None
    mc: MCStats | None = None
    kl_penalty_per_turn: float | None = None  # rl.kl_mode=reward: mean KL penalty per turn
    void_episodes: int = 0  # rl.malformed=void: episodes with a malformed turn, left out of the update
    overlong_episodes: int = 0  # rollout.overlong_mask: episodes ended by rollout.max_summaries, no gradient
    summaries: SummaryStats | None = None  # rollout.context=summarize: the summaries the batch's episodes wrote
    inference: ServerStats | None = None  # rollout.backend=server: the replicas' counters so far (pushes, losses)
    policies: dict[str, PolicyIteration] | None = None  # agent.policies: each policy's figures (``update`` is all of theirs)
    env_steps: int = 0
    time: float = 0.0


@dataclass(frozen=True)
class RunWarning:
    """Something the run found wrong but could go on with (e.g. actions longer than max_new_tokens)."""

    message: str
    env_steps: int = 0
    time: float = 0.0


@dataclass(frozen=True)
class Software:
    """What decides a run's floating-point results besides the config and seed: versions, the
    CPU and the kernel path. A fixed seed repeats bit for bit where all of these are the same;
    another CPU model or kernel path moves the last bits, and training can grow them into other
    figures (README, "Reproducibility")."""

    python: str
    torch: str
    transformers: str
    tokenizers: str
    numpy: str
    cpu_capability: str  # torch's CPU kernel path (e.g. AVX2, AVX512): another path gives other weights
    cpu_model: str
    cpu_vendor: str = ""  # e.g. AuthenticAMD, GenuineIntel
    cpu_family_model: str = ""  # /proc/cpuinfo's 'cpu family/model' (e.g. 25/17: AMD Zen 4)
    cpu_flags: tuple[str, ...] = ()  # those of turnforge.kernels.KERNEL_FLAGS the CPU has (AVX-512, AMX, ...)
    mkl: str = ""  # the MKL torch was built with (its BLAS on x86)
    onednn: str = ""
    threads: int = 0  # torch's intra-op threads when the summary was written
    kernel_env: dict[str, str] = field(default_factory=dict)  # ATEN_CPU_CAPABILITY, MKL_CBWR, ... where set

    @classmethod
    def current(cls) -> "Software":
        import platform
        import re

        import numpy
        import tokenizers
        import torch
        import transformers

        from turnforge.kernels import cpu_identity, kernel_env

        cpu = cpu_identity()
        config = torch.__config__.show()
        mkl = re.search(r"Math Kernel Library Version (\S+)", config)
        onednn = re.search(r"MKL-DNN (v\S+)", config)
        return cls(platform.python_version(), torch.__version__, transformers.__version__, tokenizers.__version__,
                   numpy.__version__, torch.backends.cpu.get_cpu_capability(), str(cpu["model_name"]),
                   cpu_vendor=str(cpu["vendor"]), cpu_family_model=str(cpu["family_model"]),
                   cpu_flags=tuple(cpu["flags"]), mkl=mkl.group(1) if mkl else "",
                   onednn=onednn.group(1) if onednn else "", threads=torch.get_num_threads(), kernel_env=kernel_env())


@dataclass(frozen=True)
class SamplingOverrides:
    """An agent run's gateway calls sampled with the trainer's settings instead of the ones the
    agent sent (``agent.sampling``, ``turnforge.gateway.sampling``): the ``n_overridden_*``
    counters of its RL iterations, evaluations and pass@k measurements summed (scored episodes)."""

    calls: int  # calls with at least one setting overridden
    temperature: int  # of them, sent another temperature than the trainer's
    top_p: int  # sent top_p < 1
    max_tokens: int  # sent a max_tokens beyond the context left (capped)


@dataclass(frozen=True)
class RunSummary:
    """A finished run's headline figures: ``RUN/summary.json`` (``read_summary``)."""

    recipe: str
    seed: int
    wall_seconds: float  # the whole run, interrupted parts included
    env_steps: int  # turns played by the policy and the demonstrator (and the flywheel's mc_awr restarts; the RL stage's Monte-Carlo rollouts apart)
    mc_env_steps: int
    train_tokens: int
    eval_before_rl: EvalResult
    eval_after_rl: EvalResult
    success_gain_points: float  # 100 x (after - before) held-out success
    rl_iterations: int
    rl_seconds: float | None  # the RL stage of the last process
    engine_mode: str  # engine.mode
    eta: int
    env_workers: int
    cluster: str
    policy_version: int
    skipped_steps: int
    advantage: str  # rl.advantage
    bc: BCStats | None
    value_pretrain: ValuePretrainStats | None
    env_id: str
    env_kwargs: dict[str, Any]
    model: str | None  # model.path ('tiny' = built in the run directory; 'gguf:SOURCE' = model.gguf)
    num_parameters: int
    torch_threads: int
    env_pool: PoolStats | None = None  # the run's own engine on env workers: demonstrations, evaluations, sync RL
    software: Software | None = None  # versions and CPU kernel path the run used (figures repeat bit for bit only with the same)
    eval_bc_best_temperature: BestTemperature | None = None  # the BC policy at its best temperature (eval.bc_temperatures)
    expert_queries: ExpertQueries | None = None
    flywheel_rounds: int = 0
    gain_over_bc_best_points: float | None = None  # 100 x (after - the BC policy at its best temperature)
    trainable_parameters: int | None = None  # those the optimizer updated last (the adapters under model.lora)
    peak_memory: PeakMemory | None = None  # peak RSS of the run's process (the last one, if resumed) and its children
    boundary_start: BoundaryReport | None = None  # pass@k and friends of the start (eval.pass_at_k_samples > 0)
    boundary_after: BoundaryReport | None = None  # the same after training
    sampling_overrides: SamplingOverrides | None = None  # agent runs: calls the trainer's sampling settings won
    policies: dict[str, PolicySummary] | None = None  # agent.policies: each policy's RL figures


def read_summary(run_dir: str | Path | RunDir) -> RunSummary:
    """``RUN/summary.json`` as a ``RunSummary``."""
    return from_json(RunSummary, json.loads(RunDir(run_dir).summary.read_text()))


EVENTS: dict[str, type] = {
    "bc_epoch": BCEpoch, "bc_done": BCStats, "eval": EvalRecord, "value_pretrain": ValuePretrainStats,
    "rl_iter": IterationMetrics, "warning": RunWarning, "flywheel_round": FlywheelRound, "boundary": BoundaryReport,
}
KINDS: dict[type, str] = {cls: kind for kind, cls in EVENTS.items()}


@dataclass
class RunMetrics:
    """Everything ``metrics.jsonl`` holds, typed (``read_metrics``)."""

    bc_epochs: list[BCEpoch] = field(default_factory=list)
    bc: BCStats | None = None
    evals: list[EvalRecord] = field(default_factory=list)
    value_pretrain: ValuePretrainStats | None = None
    iterations: list[IterationMetrics] = field(default_factory=list)
    warnings: list[RunWarning] = field(default_factory=list)
    flywheel: list[FlywheelRound] = field(default_factory=list)
    boundaries: list[BoundaryReport] = field(default_factory=list)


def to_json(record: Any) -> dict[str, Any]:
    """A record as the JSON object of its event line (without the ``event`` key)."""
    return dataclasses.asdict(record)


def from_json(cls: type, data: Any) -> Any:
    """Rebuild a record of class ``cls`` (nested dataclasses, optional fields, tuples, dicts) from
    JSON data; an unknown field raises ``ValueError`` naming it."""
    if data is None:
        return None
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {unknown[0]!r} (fields: {', '.join(sorted(names))})")
        return cls(**{k: from_json(hints[k], v) for k, v in data.items()})
    origin = typing.get_origin(cls)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(cls) if a is not type(None)]
        return from_json(inner[0], data) if len(inner) == 1 else data
    if origin is tuple:
        (item, *_) = typing.get_args(cls)
        return tuple(from_json(item, x) for x in data)
    if origin is list:
        (item,) = typing.get_args(cls)
        return [from_json(item, x) for x in data]
    if origin is dict:  # a record class may name the class of each key's value (MechanismRecord.class_for)
        _, item = typing.get_args(cls)
        of = getattr(item, "class_for", None)
        return {k: from_json(item if of is None else of(k), v) for k, v in data.items()}
    return data


#: A ``flywheel_round`` record of runs made before the mechanisms kept their own records
#: (2026-11-27 and earlier) held each mechanism's figures as flat fields: mechanism -> (its record
#: from those fields, the fields at rest when it was off).
_FLAT_FLYWHEEL = {
    "retry": (lambda d: {"episodes": d["retry"]}, {"retry": [0, 0]}),
    "guidance": (lambda d: {"episodes": d["guided"]}, {"guided": [0, 0]}),
    "curriculum": (lambda d: {"episodes": d["curriculum"], "depth": d["curriculum_depth"],
                              "success": d["curriculum_success"]},
                   {"curriculum": [0, 0], "curriculum_depth": 1, "curriculum_success": None}),
    "anchor": (lambda d: {"episodes": d["anchor"], "live": d["anchor_live"], "graduated": d["anchor_graduated"],
                          "dropped": d["anchor_dropped"], "expert_share": d["anchor_expert_share"]},
               {"anchor": [0, 0], "anchor_live": 0, "anchor_graduated": 0, "anchor_dropped": 0,
                "anchor_expert_share": None}),
    "evolve": (lambda d: {"episodes": d["evolved"], "live": d["evolved_live"], "retired": d["evolved_retired"]},
               {"evolved": [0, 0], "evolved_live": 0, "evolved_retired": 0}),
    "replay": (lambda d: {"episodes": None, "size": d["replay_size"]}, {"replay_size": 0}),
}


def _upgrade_flywheel_round(data: dict, mechanisms: list[str] | None) -> dict:
    """An old flat ``flywheel_round`` record in today's shape. ``mechanisms``: the run's
    ``flywheel.mechanisms`` (from its config.yaml); without it, each mechanism whose fields are
    not at rest."""
    out = {k: v for k, v in data.items() if not any(k in rest for _, rest in _FLAT_FLYWHEEL.values())}
    out["mechanisms"] = {
        name: part(data) for name, (part, rest) in _FLAT_FLYWHEEL.items()
        if (name in mechanisms if mechanisms is not None else any(data.get(k, v) != v for k, v in rest.items()))
    }
    return out


def _run_mechanisms(run: RunDir) -> list[str] | None:
    try:
        cfg = yaml.safe_load(run.config.read_text()) or {}
        return list(cfg["flywheel"]["mechanisms"])
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None


def read_metrics(run_dir: str | Path | RunDir) -> RunMetrics:
    """The typed records of ``RUN/metrics.jsonl`` (an empty ``RunMetrics`` when there is none);
    older runs' flat flywheel records are read in today's shape."""
    run = RunDir(run_dir)
    path = run.metrics
    out = RunMetrics()
    if not path.exists():
        return out
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        data = json.loads(line)
        kind = data.pop("event")
        if kind == "flywheel_round" and "mechanisms" not in data and "retry" in data:
            data = _upgrade_flywheel_round(data, _run_mechanisms(run))
        if kind not in EVENTS:
            raise ValueError(f"{path}, line {n}: unknown event {kind!r} (events: {', '.join(EVENTS)})")
        try:
            record = from_json(EVENTS[kind], data)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}, line {n}: {err}") from None
        if kind in ("bc_done", "value_pretrain"):
            setattr(out, {"bc_done": "bc", "value_pretrain": "value_pretrain"}[kind], record)
        else:
            getattr(out, {"bc_epoch": "bc_epochs", "eval": "evals", "rl_iter": "iterations", "warning": "warnings",
                          "flywheel_round": "flywheel", "boundary": "boundaries"}[kind]).append(record)
    return out
