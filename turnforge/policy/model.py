"""Load any Hugging Face causal LM with its tokenizer and chat template as a ``Policy``.

``Policy`` is the model, its tokenizer, a ``ChatFormat`` that turns chat messages into
token ids piece by piece (so observations can be truncated by tokens), the stop token
ids, and a version counter bumped after every optimizer step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from turnforge.errors import UserError
from turnforge.policy.thinking import Thinking, detect, strip_final

SENTINEL = "\u2063TURNFORGE_CONTENT\u2063"
ROLES = ("user", "tool")  # roles an observation can come back as


class ChatFormat:
    """Token pieces of a chat template, derived once by rendering it around a sentinel.

    A conversation is tokenized piece by piece: ``start(system) + tokenize(content) +
    user_tail`` for the first user message, ``user_head + tokenize(content) + user_tail``
    for later ones, with the assistant's generated ids and the template's closing text in
    between. Tool results are later messages of role "tool" (``turn("tool")``: whatever the
    template makes of them, e.g. a ``<tool_response>`` inside a user turn), and tool schemas
    go through the template's own ``tools`` argument (``start(system, tools)``). The ids the
    model sees are composed of pieces and never re-tokenized across a
    boundary, so an observation can be truncated by tokens. Works for templates that
    render each message independently (ChatML/Qwen2, Llama 3, Mistral-style) and for reasoning
    templates that drop the thinking of earlier assistant messages (Qwen3, DeepSeek-R1: found by
    rendering, ``thinking``; ``turnforge.policy.thinking``); templates that rewrite earlier turns
    in any other way are rejected with one line naming the rewrite.
    """

    def __init__(self, tokenizer) -> None:
        name = getattr(tokenizer, "name_or_path", "") or "tokenizer"
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"tokenizer {name!r} has no chat_template; use an instruct/chat model or set one")
        self.tokenizer = tokenizer
        self._name = name
        #: How the template treats thinking (``turnforge.policy.thinking``); None: it names no thinking markers.
        self.thinking: Thinking | None = detect(self)
        u, a = {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}
        base = strip_final(self._render([u, a], gen=False), self.thinking)
        later = self._render([u, a, {"role": "user", "content": SENTINEL}], gen=True)
        if not later.startswith(base):
            raise UserError(f"chat template of {name!r} re-renders earlier turns when a message is added ({_rewrite(base, later)}); "
                            "turnforge needs a template whose rendering extends its prefix, or one that only drops earlier thinking")
        head, tail = self._split(later[len(base):])
        self._turns: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {"user": (self._template(head), self._template(tail))}
        self.user_head, self.user_tail = self._turns["user"]  # around a later user message's content
        prompt_u = self._render([u], gen=True)
        #: What the generation prompt writes of the assistant message itself: a template whose prompt
        #: opens thinking (DeepSeek-R1's newer ones) ends it with the open marker and its newline, so
        #: the model's turn starts inside its thinking; "" otherwise.
        self.opened: str = ""
        if self.thinking is not None and self.thinking.prompt_opens:
            self.opened = prompt_u[prompt_u.rstrip().rfind(self.thinking.open):]
        self.opened_ids: tuple[int, ...] = self._template(self.opened)  # the last ids of every generation prompt
        if self.opened_ids and self.user_tail[-len(self.opened_ids):] != self.opened_ids:
            raise UserError(f"chat template of {name!r} opens thinking in its generation prompt, but {self.opened!r} is not "
                            "a separate run of tokens at its end; turnforge cannot tell the prompt from the thinking")
        with_assistant = self._render([u, {"role": "assistant", "content": self.opened + SENTINEL}], gen=False)
        if not with_assistant.startswith(prompt_u):
            raise UserError(f"chat template of {name!r} does not put assistant content right after the generation prompt")
        #: Text the template puts after assistant content (e.g. "<|im_end|>\n").
        self.assistant_close: str = self._split(with_assistant[len(prompt_u):])[1]
        self._starts: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def _render(self, messages: list[dict], gen: bool, tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)

    def _split(self, text: str) -> tuple[str, str]:
        if text.count(SENTINEL) != 1:
            raise UserError(f"chat template of {self._name!r} does not render message content verbatim")
        head, tail = text.split(SENTINEL)
        return head, tail

    def continuing(self, text: str) -> str:
        """An assistant message's ``text`` as the model writes it after the generation prompt: with
        a prompt that opens thinking (``opened``), without its own opening of it."""
        if self.opened and text.startswith(self.thinking.open):
            return text[len(self.thinking.open):].removeprefix(self.opened[len(self.thinking.open):])
        return text

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of content ``text`` (an observation, an action, a prompt of ours), no special
        tokens added and none read from it: a page that shows ``<|im_end|>`` or ``<image>`` as
        text gets those characters' ordinary tokens, not a turn end or an image placeholder."""
        return tuple(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]) if text else ()

    def _template(self, text: str) -> tuple[int, ...]:
        """Token ids of a piece the chat template rendered: its special tokens are read as such."""
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()

    def start(self, system: str | None, tools: str = "", examples: tuple[tuple[str, str], ...] = (),
              example_role: str = "user") -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(head, tail) ids around the first real user message's content, with ``system`` as the
        system prompt (``None`` for none), ``tools`` (a JSON list of tool schemas, "" for
        none) rendered by the template's own tool section, and ``examples`` (observation,
        answer) pairs of one worked episode as earlier turns (few-shot): its first observation
        a user message, the later ones messages of ``example_role`` (the env's observation
        role, e.g. "tool" for tool results), each followed by its answer. Cached per arguments."""
        if examples:
            key = (system, tools, examples, example_role)
            if key not in self._starts:
                head, tail = self.start(system, tools)
                later_head, later_tail = self.turn(example_role)
                ids = list(head)
                for i, (obs, answer) in enumerate(examples):
                    ids += ([] if i == 0 else list(later_head)) + list(self.encode(obs))
                    ids += list(tail if i == 0 else later_tail) + list(self.encode(self.continuing(answer)))
                    ids += list(self.close_after(answer))
                self._starts[key] = (tuple(ids) + self.user_head, self.user_tail)
            return self._starts[key]
        key = (system, tools)
        if key not in self._starts:
            messages = [{"role": "user", "content": SENTINEL}]
            if system:
                messages.insert(0, {"role": "system", "content": system})
            schemas = json.loads(tools) if tools else None
            rendered = self._render(messages, gen=True, tools=schemas)
            if schemas and rendered == self._render(messages, gen=True):
                raise UserError(
                    f"chat template of {self._name!r} does not render tools; the env has tools, so set "
                    "rollout.tools_in_system_prompt=true (the schemas as text) or use a model whose template takes them"
                )
            head, tail = self._split(rendered)
            self._starts[key] = (self._template(head), self._template(tail))
        return self._starts[key]

    def turn(self, role: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(head, tail) ids around the content of a later message of ``role`` ("user", or
        "tool" for a tool result), the tail ending with the generation prompt."""
        if role not in self._turns:
            if role not in ROLES:
                raise ValueError(f"unknown observation role {role!r}; valid roles: {', '.join(map(repr, ROLES))}")
            u, a = {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}
            base = strip_final(self._render([u, a], gen=False), self.thinking)
            try:
                later = self._render([u, a, {"role": role, "content": SENTINEL}], gen=True)
            except Exception as err:  # jinja raise_exception for unsupported roles
                raise UserError(f"chat template of {self._name!r} cannot render a {role!r} message: {err}") from None
            if not later.startswith(base) or later.count(SENTINEL) != 1:
                raise UserError(
                    f"chat template of {self._name!r} re-renders earlier turns or drops the content of a {role!r} "
                    "message; turnforge needs a template whose rendering of a conversation extends its prefix"
                )
            head, tail = self._split(later[len(base):])
            self._turns[role] = (self._template(head), self._template(tail))
        return self._turns[role]

    def close_after(self, generated_text: str) -> tuple[int, ...]:
        """Ids the template adds after an assistant message whose generated ids decode to
        ``generated_text``: the closing text minus what the model already emitted (its stop
        token), so nothing is duplicated."""
        close = self.assistant_close
        for k in range(len(close), 0, -1):
            if generated_text.endswith(close[:k]):
                return self._template(close[k:])
        return self._template(close)


def _rewrite(base: str, later: str) -> str:
    """Where the rendering ``base`` changed when a message was added (``later``): "'X...' became 'Y...'"."""
    start = len(os.path.commonprefix([base, later]))
    return f"{base[start:start + 60]!r} became {later[start:start + 60]!r}"


@dataclass
class Policy:
    """A causal LM, its tokenizer and chat format, stop ids, and a version counter."""

    model: torch.nn.Module
    tokenizer: object
    chat: ChatFormat
    stop_ids: tuple[int, ...]
    pad_id: int
    path: str
    version: int = 0
    #: Actors of this policy reuse KV caches across turns and prefill identical prompts once
    #: (``rollout.prefix_cache``; ``turnforge.policy.generate.PrefixCache``).
    prefix_cache: bool = False
    #: Memory budget of that cache in GiB (``rollout.kv_cache_gib``; None: ``kvcache.default_budget_bytes()``).
    kv_cache_gib: float | None = None
    #: Another rollout backend to sample with (``rollout.backend=vllm``: a
    #: ``turnforge.policy.vllm_sampler.VLLMSampler``); None samples with ``model`` itself.
    sampler: object | None = None
    #: The processor side of a vision-language model (``turnforge.policy.vision.Vision``); None: text-only.
    vision: object | None = None
    #: The module updates run through on several trainer ranks: a copy of ``model`` sharded with
    #: FSDP2 (``turnforge.dist``); None (a world of one): ``model`` itself.
    trainer: torch.nn.Module | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def train_model(self) -> torch.nn.Module:
        """The module to compute losses with gradients through and to optimize."""
        return self.model if self.trainer is None else self.trainer


def stop_token_ids(tokenizer, model) -> tuple[int, ...]:
    """Ids that end a turn: the tokenizer's eos, the generation config's eos ids, and the
    template's end-of-message token when it is a single token (e.g. ``<|im_end|>``)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]:
        if i is not None:
            ids.append(int(i))
    for tok in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.append(tid)
    if not ids:
        raise UserError(f"tokenizer {tokenizer.name_or_path!r} has no eos token; cannot tell where a turn ends")
    return tuple(dict.fromkeys(ids))


ROUND_TRIP = "Move up, then left: 12 #@$ ok."  # the text a model directory's tokenizer must round-trip


def check_model_dir(path: str | Path) -> Path:
    """One ``UserError`` line for a directory that cannot be a usable model: missing,
    no ``config.json``, a sealed checkpoint whose files are truncated or corrupt, or no
    tokenizer files."""
    from turnforge.paths import MANIFEST, verify

    p = Path(path)
    if not p.exists():
        raise UserError(f"model path {str(path)!r} does not exist; give a local directory saved with save_pretrained")
    if not p.is_dir():
        raise UserError(f"model path {str(path)!r} is a file; give the directory saved with save_pretrained")
    if not (p / "config.json").exists():
        raise UserError(f"model path {str(path)!r} has no config.json; it is not a Hugging Face model directory")
    if (p / MANIFEST).exists():
        problem = verify(p)
        if problem is not None:
            raise UserError(f"model directory {str(path)!r} is damaged: {problem}")
    if not any((p / name).exists() for name in TOKENIZER_FILES):
        raise UserError(
            f"model path {str(path)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "save the tokenizer with tokenizer.save_pretrained(DIR) next to the model"
        )
    return p


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def check_tokenizer(tokenizer, path: str | Path) -> None:
    """The tokenizer must encode a test string to ids and decode them back to it."""
    ids = tokenizer(ROUND_TRIP, add_special_tokens=False)["input_ids"]
    back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) if ids else ""
    if back.strip() != ROUND_TRIP:
        raise UserError(
            f"tokenizer of {str(path)!r} does not round-trip text ({ROUND_TRIP!r} -> {len(ids)} ids -> {back!r}); "
            "its files are incomplete or do not belong to this model"
        )


def load_chat_format(path: str | Path) -> ChatFormat:
    """The tokenizer and chat template of a local HF model directory, without the weights."""
    from transformers import AutoTokenizer

    p = check_model_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    check_tokenizer(tokenizer, p)
    return ChatFormat(tokenizer)


def quiet_hf() -> None:
    """Hugging Face libraries offline and quiet: no hub calls, no tokenizer thread warnings,
    errors only in their logs, no download progress bars (every command that loads a model)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def resolve_device(name: str, what: str = "model.device") -> str:
    """The torch device ``name`` (``what``: the key or flag it came from) stands for: 'cpu'; 'auto',
    the first GPU torch sees, else the CPU; 'cuda' / 'cuda:N', checked: one ``UserError`` line
    when torch sees no such GPU."""
    if name == "cpu":
        return "cpu"
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise UserError(f"{what}={name!r} but torch {torch.__version__} sees no CUDA GPU; valid here: 'cpu', 'auto'")
    index = int(name.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise UserError(f"{what}={name!r} but torch sees {torch.cuda.device_count()} CUDA GPU(s); valid: "
                        + ", ".join(["'cuda'", *(f"'cuda:{i}'" for i in range(torch.cuda.device_count())), "'cpu'", "'auto'"]))
    return name


def use_gradient_checkpointing(model: torch.nn.Module) -> None:
    """HF gradient checkpointing on ``model`` (under a ``PeftModel``, on its base), non-reentrant,
    so a frozen LoRA base needs no gradient on its inputs. It acts in train mode only: sampling
    (eval mode) keeps its KV cache. A LoRA merge keeps it (the same modules)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(inner, "supports_gradient_checkpointing", False):
        raise UserError(f"model.gradient_checkpointing=true: {type(inner).__name__} does not support gradient checkpointing; "
                        "set it to false")
    if hasattr(inner, "activation_checkpointing_enable"):  # transformers 5's name
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_policy(path: str | Path, dtype: str = "float32", device: str = "cpu") -> Policy:
    """Load a local HF causal LM directory (or a vision-language model with its processor:
    ``turnforge.policy.vision``) with ``from_pretrained`` (no download), after
    checking that the directory is whole and its tokenizer works (``check_model_dir``,
    ``check_tokenizer``); unreadable weights are one ``UserError`` line naming the directory."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from turnforge.policy.vision import load_vision, suppress_image_tokens

    p = check_model_dir(path)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise UserError(f"unknown dtype {dtype!r}; valid dtypes: 'bfloat16', 'float16', 'float32'")
    tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    check_tokenizer(tokenizer, p)
    chat = ChatFormat(tokenizer)
    try:
        vision = load_vision(p)
        auto = AutoModelForCausalLM if vision is None else AutoModelForImageTextToText
        model = auto.from_pretrained(p, dtype=torch_dtype, local_files_only=True).to(device)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:  # truncated/empty weights, bad config.json
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        weights = ", ".join(sorted(f.name for f in p.iterdir() if f.suffix in (".safetensors", ".bin"))) or "no weight files"
        raise UserError(f"cannot load the model weights in {str(path)!r} ({weights}): {first}") from None
    if vision is not None:
        suppress_image_tokens(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Policy(
        model=model,
        tokenizer=tokenizer,
        chat=chat,
        stop_ids=stop_token_ids(tokenizer, model),
        pad_id=int(pad),
        path=str(p),
        vision=vision,
    )
