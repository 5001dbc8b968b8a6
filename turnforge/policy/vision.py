"""Vision-language policies: images in observations, rendered by the model's own processor.

An env that shows images implements ``observation_images() -> tuple[bytes, ...]`` (PNG bytes
of the images shown with its latest observation; ``turnforge.envs.base``). The episode's token
context puts each image's *block* before the observation's text: the ids the model's processor
expands one image into (for Idefics3/SmolVLM-class models ``<fake_token_around_image>
<global-img> <image> x image_seq_len <fake_token_around_image>``), taken from the processor
itself, so the ids the sampler sees, the ids stored and the ids re-scored are the ones the
model's forward expects. The pixels travel beside the ids: a ``Sample`` holds its images in the
order their blocks appear (``Sample.images``), and every forward pass over ids with image
blocks gets ``pixel_values`` of exactly those images (``Vision.inputs``); the model scatters
their features into the image-token positions in that order.

Architecture: Idefics3 (``Idefics3ForConditionalGeneration``: SigLIP vision encoder, pixel
shuffle, a causal LM; SmolVLM's layout). Its text model takes ordinary 1-D positions, so the
built-in sampler's KV cache, left padding and position ids work unchanged (a Qwen2-VL model's
3-D M-RoPE positions would not). Image blocks have fixed length (no image splitting), so an
observation's length does not depend on the image's size.

Two prompts whose ids are equal may hold different images, so the id-keyed caches of the
sampler (``rollout.prefix_cache``, the prefill cache) are refused or bypassed for vision
policies, and the vLLM backend is refused.
"""

from __future__ import annotations

import hashlib
import io
from collections import OrderedDict
from typing import Sequence

import torch

from turnforge.errors import UserError

SUPPORTED = ("idefics3", "smolvlm")  # model types whose text model takes 1-D positions and <image> blocks
IMAGE_TOKEN = "<image>"
IMAGE_TOKENS = (IMAGE_TOKEN, "<fake_token_around_image>", "<global-img>")  # what the Idefics3 processor expands into


#: What a logit of a suppressed token becomes (finite: 0 * it is 0 in an entropy, where -inf gives nan).
SUPPRESSED_LOGIT = -1e9


def suppress_image_tokens(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    """Make ``model`` never emit the image-block tokens (``IMAGE_TOKENS`` in its vocabulary): a hook
    on its output layer sets their logits to ``SUPPRESSED_LOGIT`` in every forward pass, so the
    sampler, every re-scoring and the gateway see the same distribution (token-exact). Without it a
    sampled ``<image>`` in an action made the next forward fail (as many image tokens as images'
    features is what Idefics3 checks): found in a GRPO run of ``gui-click-tiny``. HF's
    ``suppress_tokens`` does this at generation only, which would leave the trainer's logprobs
    other than the sampler's. Returns the ids suppressed."""
    vocab = tokenizer.get_vocab()
    ids = tuple(sorted(vocab[t] for t in IMAGE_TOKENS if t in vocab))
    head = model.get_output_embeddings()
    if not ids or head is None:
        return ids
    index = torch.as_tensor(ids, dtype=torch.long)

    def hook(_module, _inputs, logits):
        return logits.index_fill(-1, index.to(logits.device), SUPPRESSED_LOGIT)

    head.register_forward_hook(hook)
    return ids


def image_key(png: bytes) -> str:
    """The image's content hash (its name in a run's ``images/`` folder and in the Parquet)."""
    return hashlib.sha256(png).hexdigest()


def decode_image(png: bytes, where: str = "image"):
    """PIL RGB image of ``png``; one ``UserError`` line when it is not an image PIL can read."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(png, (bytes, bytearray)):
        raise UserError(f"{where}: expected PNG bytes, got {type(png).__name__}")
    try:
        with Image.open(io.BytesIO(png)) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise UserError(f"{where}: not an image the processor can read ({len(png)} bytes): {err}") from None


class Vision:
    """The processor side of a vision-language policy: an image's token block and pixels."""

    def __init__(self, processor, cache_images: int = 512) -> None:
        self.processor = processor
        tok = processor.tokenizer
        self.image_token_id = int(tok.convert_tokens_to_ids(IMAGE_TOKEN))
        self._cache: OrderedDict[str, tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = OrderedDict()
        self.cache_images = cache_images  # processed images kept (``model.image_cache``)

    def _encode(self, png: bytes) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
        key = image_key(png)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        img = decode_image(png)
        try:
            out = self.processor(text=[IMAGE_TOKEN], images=[[img]], return_tensors="pt")
        except Exception as err:  # noqa: BLE001 - the processor's own message names what it rejects
            raise UserError(f"the model's processor rejects an image of {img.size[0]}x{img.size[1]} px: {err}") from None
        pixels = out["pixel_values"][0]  # [crops, 3, H, W]: 1 crop without image splitting
        mask = out.get("pixel_attention_mask")
        mask = mask[0] if mask is not None else torch.ones(pixels.shape[0], *pixels.shape[2:], dtype=torch.bool)
        entry = (tuple(int(i) for i in out["input_ids"][0].tolist()), pixels, mask)
        self._cache[key] = entry
        if len(self._cache) > self.cache_images:
            self._cache.popitem(last=False)
        return entry

    def block(self, png: bytes) -> tuple[int, ...]:
        """The ids one image expands into, exactly as the processor writes them."""
        return self._encode(png)[0]

    def inputs(self, rows: Sequence[Sequence[bytes]], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Keyword arguments of the model's forward for a batch whose row ``i`` holds the blocks
        of ``rows[i]`` in order: ``pixel_values [1, N, 3, H, W]`` and ``pixel_attention_mask``
        of the N crops of those images in row-major order (one crop per image without image
        splitting; a split image's crops in the processor's order) ({} when there are none)."""
        crops = [(px[k], m[k]) for row in rows for png in row for _, px, m in [self._encode(png)] for k in range(px.shape[0])]
        if not crops:
            return {}
        h = max(px.shape[-2] for px, _ in crops)
        w = max(px.shape[-1] for px, _ in crops)
        pixels = torch.zeros(1, len(crops), 3, h, w, dtype=crops[0][0].dtype)
        mask = torch.zeros(1, len(crops), h, w, dtype=torch.bool)
        for i, (px, m) in enumerate(crops):
            pixels[0, i, :, : px.shape[-2], : px.shape[-1]] = px
            mask[0, i, : m.shape[-2], : m.shape[-1]] = m.bool()
        return {"pixel_values": pixels.to(device), "pixel_attention_mask": mask.to(device)}


def check_first_images(env, vision: Vision | None) -> None:
    """The images of the env's first train observation go through the model's processor now, so
    an image it rejects (or any image for a text-only model) is one ``UserError`` line before
    any episode."""
    from turnforge.envs.base import capabilities

    if env is None or not capabilities(env).images:
        return
    env.reset(env.task("train", 0), 0)
    images = tuple(env.observation_images())
    if images and vision is None:
        raise UserError(f"env {env.env_id!r} shows images in its observations but the model is text-only; use a "
                        "vision-language model (model.tiny.vision.enabled=true, or a local VLM directory)")
    for k, png in enumerate(images):
        decode_image(png, f"env {env.env_id!r}: image {k} of its first observation")
        vision.block(png)  # type: ignore[union-attr]


def load_vision(path) -> Vision | None:
    """The ``Vision`` of a model directory whose config has a vision tower (None for a text model)."""
    import json
    from pathlib import Path

    config = json.loads((Path(path) / "config.json").read_text())
    if "vision_config" not in config:
        return None
    if config.get("model_type") not in SUPPORTED:
        raise UserError(f"model directory {str(path)!r} is a {config.get('model_type')!r} vision-language model; turnforge's "
                        f"sampler runs {', '.join(map(repr, SUPPORTED))} models (1-D positions; Qwen2-VL's 3-D M-RoPE "
                        "positions are not supported)")
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"model directory {str(path)!r} has a vision tower but no usable processor "
                        f"(preprocessor/processor config): {str(err).splitlines()[0]}") from None
    if getattr(processor, "image_processor", None) is None:
        raise UserError(f"model directory {str(path)!r} has a vision tower but its processor has no image processor")
    return Vision(processor)


def model_has_vision(model_cfg) -> bool:
    """Whether the configured model (``ModelConfig``) is a vision-language model, before it is built."""
    import json
    from pathlib import Path

    if model_cfg.gguf is not None:
        return False
    if model_cfg.path == "tiny":
        return bool(model_cfg.tiny.vision.enabled)
    config = Path(model_cfg.path) / "config.json"
    return config.exists() and "vision_config" in json.loads(config.read_text())


def check_vision_options(cfg, env, variants: dict[str, bool] | None = None) -> None:
    """One ``UserError`` line, before any work, for an env that shows images to a text-only model
    and for options a vision policy does not take (id-keyed caches and samplers that cannot see
    the pixels, and the losses that re-score without them). ``variants``: the variant choices
    without images (``rollout.context=summarize``, ``rl.advantage=mc_grpo``...: each variant's
    registry declares it; ``turnforge.app.rules`` asks them), each with whether the run makes it."""
    from turnforge.envs.base import capabilities

    vision = model_has_vision(cfg.model)
    if env is not None and capabilities(env).images and not vision:
        raise UserError(f"env {env.env_id!r} shows images in its observations but the model is text-only; use a "
                        "vision-language model (model.tiny.vision.enabled=true, or a local VLM directory)")
    if not vision:
        return
    refused = {
        "rollout.prefix_cache=true": cfg.rollout.prefix_cache,
        "rollout.backend=vllm": cfg.rollout.backend == "vllm",
        "rollout.backend=server": cfg.rollout.backend == "server",
        "rl.kl_mode=reward": cfg.rl.kl_mode == "reward" and cfg.rl.kl_coef > 0,
        "rl.rehearsal_coef>0": cfg.rl.rehearsal_coef > 0,
        "critic.enabled=true": cfg.critic.enabled,
        **(variants or {}),
    }
    bad = [k for k, on in refused.items() if on]
    if bad:
        raise UserError(f"{bad[0]} is not available with a vision-language model (equal token ids may hold different "
                        f"images); unset it (refused for vision models: {', '.join(refused)})")
