"""Tiny Hugging Face models for tests and the default CPU job, built locally (no download).

``build_tiny_model(out_dir, cfg)`` trains a small byte-level BPE tokenizer with the
``tokenizers`` library, wraps it as a ``PreTrainedTokenizerFast`` with a ChatML chat
template (the format Qwen models use), builds a randomly initialised Qwen2 causal LM
from a ``Qwen2Config``, and saves both in Hugging Face format (safetensors). Everything
downstream loads it with ``from_pretrained``, the same code path as a 7B model.

Tokenizer: punctuation and whitespace characters are split into single tokens before
BPE, so a text grid such as a Sokoban room becomes one token per cell; words and
numbers are merged by BPE. Byte-level fallback means any text encodes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from turnforge.config import CORPUS_ENVS, TinyModelConfig
from turnforge.errors import UserError
from turnforge.types import THINKING_MARKERS

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TINY_RECORD = "turnforge_tiny.json"  # the TinyModelConfig a tiny model directory was built with
TOOL_TOKENS = ("<tool_call>", "</tool_call>")

# ChatML, as in Qwen2 (without Qwen's default system prompt). With ``tools``, the system
# message lists their JSON schemas and asks for hermes-style <tool_call>{json}</tool_call>
# calls inside the assistant content, as Qwen2.5's template does (shorter); tool results
# are messages of role "tool". Without tools it renders exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool with <tool_call>{\\\"name\\\": <name>, \\\"arguments\\\": <json object>}</tool_call>.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# ChatML with Qwen3's treatment of thinking, for tests and benchmarks of reasoning templates
# (``turnforge.policy.thinking``): an assistant message after the last user message is written
# with its thinking block (the final one with an empty block when it has none); those before
# the last user message keep only what follows their last </think>, leading newlines stripped
# (so thinking is kept before tool results, as Qwen3 does). Needs THINKING_MARKERS[0] in the tokenizer.
THINKING_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def add_thinking(tok, template: str = THINKING_CHAT_TEMPLATE):
    """``tok`` (changed in place and returned) with ``<think>``/``</think>`` as single tokens and
    ``template`` as its chat template: what makes a tokenizer a reasoning model's
    (``make_thinking``, ``model.thinking``)."""
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in THINKING_MARKERS[0]])
    tok.chat_template = template
    return tok


def make_thinking(model_dir: str | Path, out_dir: str | Path, template: str = THINKING_CHAT_TEMPLATE) -> Path:
    """A copy of the model in ``model_dir`` (a tiny one, or any local model) that thinks:
    ``<think>``/``</think>`` added to its tokenizer and ``template`` as its chat template
    (default: ChatML that drops earlier thinking, as Qwen3). The embeddings grow by the two rows,
    set (under a fixed seed) to the other rows' mean plus a negligible draw from their covariance,
    transformers' mean resizing (after Hewitt, 2021): a new token starts with an average token's
    logits rather than a random row's, whose scale can be far off a pretrained model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = add_thinking(AutoTokenizer.from_pretrained(model_dir, local_files_only=True), template)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    if model.get_input_embeddings().weight.shape[0] < len(tok):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model.resize_token_embeddings(len(tok), mean_resizing=True)
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def cached_thinking(model_dir: str | Path, log: Callable[[str], None] | None = None) -> Path:
    """``make_thinking`` of ``model_dir``, made once under ``$TURNFORGE_CACHE/models`` (keyed by
    the model's files and the template) and sealed with a manifest; a damaged copy is made again."""
    from turnforge.policy.gguf import cache_dir
    from turnforge.paths import seal, verify

    source = Path(model_dir)
    digest = hashlib.sha256(THINKING_CHAT_TEMPLATE.encode())
    for f in sorted(p for p in source.iterdir() if p.is_file()):
        digest.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    target = cache_dir() / f"{source.name}-thinking-{digest.hexdigest()[:16]}"
    if verify(target) is None:
        return target
    (log or (lambda line: None))(f"model {source}: adding <think>/</think> and a thinking template in {target}")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    make_thinking(source, tmp)
    seal(tmp)
    tmp.rename(target)
    return target


# Text the BPE merges are learned from: game vocabulary, directions, numbers and common
# words, plus whatever corpus the caller adds (e.g. rendered observations of the envs).
BASE_CORPUS = """
Up Down Left Right up down left right UP DOWN LEFT RIGHT
<answer>Up</answer> <answer>Down</answer> <answer>Left</answer> <answer>Right</answer>
Invalid action: could not parse as an action. Valid actions: Up, Down, Left, Right.
You are playing Sokoban. Push every box onto a target. Answer with one of Up, Down, Left, Right.
You are on a frozen lake. Reach the goal without falling into a hole.
You are playing 2048. Slide the tiles to merge equal numbers and reach the target tile.
wall floor target box player hole goal tile score step turn reward move moves the a an of to and
2 4 8 16 32 64 128 256 512 1024 2048 4096 0 1 3 5 6 7 9 10 100
You are a helpful assistant. The user asks and the assistant answers. system user assistant tool
calculator python result error output true false none
""".strip()


CORPUS_MAX_STEPS = 100  # expert steps per corpus episode (an expert that never ends is cut here)


def build_tokenizer(corpus: list[str], vocab_size: int = 512, split_digits: bool = False, thinking: bool = False):
    """Train a byte-level BPE on ``BASE_CORPUS + corpus`` and return a ``PreTrainedTokenizerFast``
    (``split_digits``: every digit its own token, as Llama's and Qwen's tokenizers do; ``thinking``:
    a reasoning model's, ``add_thinking``: two more tokens, the same BPE merges)."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    splits = [pre_tokenizers.Split(Regex(r"[^A-Za-z0-9]"), behavior="isolated")]
    if split_digits:
        splits.append(pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = [PAD_TOKEN, IM_START, IM_END]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator([BASE_CORPUS, *corpus], trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    return add_thinking(fast) if thinking else fast


def default_corpus(samples_per_env: int = 20, env_ids: tuple[str, ...] = CORPUS_ENVS,
                   images: list[bytes] | None = None) -> list[str]:
    """Instructions and observations of ``env_ids`` (train tasks 0..``samples_per_env``-1, each
    played with its index as seed), and, for envs with open-text actions (tool calls) and an
    expert, the expert's actions and the observations they lead to, so the tokenizer knows
    their words. Any env of the two-method contract works; one without an expert gives its
    first observations only. With ``images``, the images an env shows with each episode's first
    observation are appended to it (the tiny VLM's processor normalises by their statistics)."""
    from turnforge.envs import make
    from turnforge.envs.base import capabilities, close_env

    texts: list[str] = []
    for env_id in env_ids:
        env = make(env_id)
        texts.append(env.instructions)
        texts.extend(json.dumps(tool) for tool in env.tools)
        plays = not env.action_names and capabilities(env).expert
        shows = images is not None and capabilities(env).images
        try:
            for i in range(samples_per_env):
                texts.append(env.reset(env.task("train", i), i))
                if shows:
                    images.extend(env.observation_images())  # type: ignore[union-attr]
                for _ in range(CORPUS_MAX_STEPS if plays else 0):
                    action = env.expert_action()
                    result = env.step(action)
                    texts.extend((action, result.observation))
                    if result.terminated or result.truncated:
                        break
        finally:
            close_env(env)
    return texts


def tiny_hf_config(cfg: TinyModelConfig, vocab_size: int | None = None, special: dict[str, int] | None = None):
    """The transformers config of a tiny model (``vocab_size`` defaults to the configured one)."""
    from transformers import GPT2Config, Qwen2Config

    vocab_size = cfg.vocab_size if vocab_size is None else vocab_size
    special = special or {}
    if cfg.architecture == "qwen2":
        config = Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings,
            use_sliding_window=False,
            **special,
        )
    else:
        config = GPT2Config(
            vocab_size=vocab_size,
            n_embd=cfg.hidden_size,
            n_inner=cfg.intermediate_size,
            n_layer=cfg.num_hidden_layers,
            n_head=cfg.num_attention_heads,
            n_positions=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **special,
        )
    return config


#: SigLIP's (and Idefics3's processor's default) per-channel normalisation.
SIGLIP_MEAN_STD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


def image_stats(images: list[bytes], min_std: float = 0.05) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation (in [0, 1] units) of the RGB pixels of ``images``
    (PNG bytes), each std at least ``min_std``; SigLIP's 0.5 / 0.5 when there are none.

    Why the tiny VLM's processor normalises by its corpus: GUI screenshots are mostly white, and
    with SigLIP's 0.5 / 0.5 every blank patch is +1 in every channel, a large common vector beside
    which a 20 x 12 px widget barely moves its patch's features. Measured on a control (name the
    colour of one 20 x 12 px box on white, batches of 32), a from-scratch model stayed at chance
    for 500 steps with 0.5 / 0.5 and learned it (0.03 nats) in about 380 with the corpus
    statistics. A pretrained SigLIP is used with its own statistics (its processor's), never these."""
    import io

    import numpy as np
    from PIL import Image

    if not images:
        return SIGLIP_MEAN_STD
    total = np.zeros(3)
    squares = np.zeros(3)
    count = 0
    for png in images:
        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64).reshape(-1, 3) / 255.0
        total += pixels.sum(0)
        squares += (pixels * pixels).sum(0)
        count += len(pixels)
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean * mean, 0.0))
    return tuple(round(float(m), 4) for m in mean), tuple(round(max(float(v), min_std), 4) for v in std)


def _tiny_vlm(cfg: TinyModelConfig, tokenizer, special: dict[str, int],
              mean_std: tuple[tuple[float, ...], tuple[float, ...]] = SIGLIP_MEAN_STD):
    """A randomly initialised Idefics3 (SmolVLM-class) model around the tiny text model, and its
    processor (image splitting off: every image is one fixed-length block; pixels normalised by
    ``mean_std``, see ``image_stats``)."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    from turnforge.policy.vision import IMAGE_TOKEN, IMAGE_TOKENS

    v = cfg.vision
    if cfg.architecture != "qwen2":
        raise UserError("model.tiny.vision.enabled=true needs model.tiny.architecture=qwen2 (rotary positions)")
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    text = tiny_hf_config(cfg, len(tokenizer), special)
    side = {"longest_edge": v.image_size}
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side,
                                                  image_mean=list(mean_std[0]), image_std=list(mean_std[1])),
        tokenizer=tokenizer, image_seq_len=v.image_seq_len, chat_template=tokenizer.chat_template)
    vision = dict(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_hidden_layers=v.num_hidden_layers,
                  num_attention_heads=v.num_attention_heads, image_size=v.image_size, patch_size=v.patch_size)
    config = Idefics3Config(vision_config=vision, text_config=text.to_dict(), scale_factor=v.scale_factor,
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                            tie_word_embeddings=cfg.tie_word_embeddings, **special)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Idefics3ForConditionalGeneration(config)
    side = v.image_size // v.patch_size
    with torch.no_grad():  # 2-D sin-cos positions (as MAE's ViT) instead of N(0, 0.02): see sincos_2d
        model.model.vision_model.embeddings.position_embedding.weight.copy_(sincos_2d(side, v.hidden_size))
    return model, processor


def sincos_2d(side: int, dim: int) -> torch.Tensor:
    """``[side * side, dim]`` 2-D sine-cosine position embeddings of a ``side`` x ``side`` patch grid,
    row-major (MAE's ``get_2d_sincos_pos_embed``): half the dims encode the row, half the column.

    The tiny VLM's vision tower starts from these, not from transformers' N(0, 0.02) init: there,
    position is ~1/25 of a patch embedding's scale, so blank patches at different places look alike
    and a randomly initialised model could not learn where a widget is (measured: BC on one-widget
    screens stayed at chance for 3,000 steps). A pretrained SigLIP's positions are large; these are
    the standard from-scratch choice, and stay trainable."""
    if dim % 4:
        raise UserError(f"model.tiny.vision.hidden_size={dim} must be a multiple of 4 (2-D sin-cos positions)")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    rows, cols = torch.meshgrid(torch.arange(side, dtype=torch.float64), torch.arange(side, dtype=torch.float64), indexing="ij")
    parts = []
    for grid in (rows.reshape(-1), cols.reshape(-1)):
        angles = grid[:, None] * omega[None, :]
        parts += [torch.sin(angles), torch.cos(angles)]
    return torch.cat(parts, dim=1).float()


def build_tiny_model(out_dir: str | Path, cfg: TinyModelConfig | None = None, corpus: list[str] | None = None,
                     thinking: bool = False) -> Path:
    """Build and save a tiny Qwen2 model + tokenizer in HF format (with ``cfg.vision.enabled``, a
    tiny Idefics3 vision-language model around it and its processor; with ``thinking``, a
    reasoning model's tokenizer and template, ``add_thinking``); returns ``out_dir``.

    The directory is written beside ``out_dir`` and renamed into place, so a kill never
    leaves a model without its tokenizer; an existing ``out_dir`` is replaced only if it
    is empty or a tiny model directory itself (``turnforge_tiny.json`` records the config)."""
    from transformers import GPT2LMHeadModel, Qwen2ForCausalLM

    cfg = cfg or TinyModelConfig()
    final = Path(out_dir)
    if final.exists() and (not final.is_dir() or (any(final.iterdir()) and not (final / TINY_RECORD).exists())):
        raise UserError(f"{str(final)!r} exists and is not a tiny model directory; give a new or empty directory")
    out = final.with_name(final.name + ".tmp")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    images: list[bytes] = []  # the corpus envs' screenshots (a caller's own text corpus has none: SigLIP's statistics)
    wants_images = cfg.vision.enabled and cfg.vision.normalize == "corpus"
    texts = default_corpus(cfg.corpus_episodes, cfg.corpus_envs, images if wants_images else None) if corpus is None else corpus
    tokenizer = build_tokenizer(texts, cfg.vocab_size, cfg.split_digits, thinking)
    special = {
        "bos_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    }
    if cfg.vision.enabled:
        model, processor = _tiny_vlm(cfg, tokenizer, special, image_stats(images))
        config = model.config.text_config
    else:
        config = tiny_hf_config(cfg, len(tokenizer), special)
        model_cls = Qwen2ForCausalLM if cfg.architecture == "qwen2" else GPT2LMHeadModel
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = model_cls(config)
        processor = tokenizer
    model.generation_config.eos_token_id = [config.eos_token_id]
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)  # a VLM's processor saves its tokenizer too
    (out / TINY_RECORD).write_text(json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    out.rename(final)
    return final

