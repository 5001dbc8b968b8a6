"""Vision-language policies: images in observations, sampled and re-scored token-exactly."""

from __future__ import annotations

import io

import pytest
import torch

from helpers import assert_rescores, inline_engine, solid_png
from turnforge.config import RolloutConfig, TinyVisionConfig, TrainConfig
from turnforge.envs.base import Env, capabilities
from turnforge.envs.tasks import TaskGenerator
from turnforge.errors import UserError
from turnforge.policy.generate import pad_right, token_logprobs
from turnforge.policy.vision import image_key as vision_key
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.types import StepResult

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}


png = solid_png


class ColourEnv(Env):
    """Test env: each turn shows a coloured image; answer its colour (episode of ``length`` turns)."""

    env_id = "test-colour"
    instructions = "Name the colour of the image: red, green or blue."
    tasks = TaskGenerator(lambda rng: {"colours": [rng.choice(sorted(COLOURS)) for _ in range(6)]})

    def __init__(self, length: int = 3) -> None:
        self.length = length

    def reset(self, task, seed):
        self.colours, self.t = list(task.data["colours"]), 0
        return "What colour is it?"

    def observation_images(self):
        return (png(COLOURS[self.colours[self.t % len(self.colours)]]),)

    action_names = tuple(sorted(COLOURS))

    def step(self, action):
        if action.strip().lower() not in COLOURS:
            return StepResult("Answer red, green or blue.", 0.0, False, False, invalid_action=True)
        right = action.strip().lower() == self.colours[self.t % len(self.colours)]
        self.t += 1
        done = self.t >= self.length
        return StepResult("And now?", float(right), done, False, success=done)

    def expert_action(self):
        return self.colours[self.t % len(self.colours)]


@pytest.fixture()
def vlm(tiny_vlm_dir):
    from turnforge.policy.model import load_policy

    return load_policy(tiny_vlm_dir)


def _play(policy, cfg, n=4, length=3, seed=0):
    engine = inline_engine(policy, [ColourEnv(length) for _ in range(n)], cfg)
    reqs = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{i}") for i in range(n)]
    return engine.play(reqs, PolicyActor(policy, cfg.max_new_tokens, 1.0, torch.Generator().manual_seed(seed)))


def test_image_block_is_the_processors_expansion(vlm):
    from PIL import Image

    image = png(COLOURS["red"])
    out = vlm.vision.processor(text=["<image>"], images=[[Image.open(io.BytesIO(image)).convert("RGB")]], return_tensors="pt")
    block = vlm.vision.block(image)
    assert list(block) == out["input_ids"][0].tolist()
    assert block.count(vlm.vision.image_token_id) == 4  # (56 / 14 / 2)^2 image tokens
    assert capabilities(ColourEnv()).images


@pytest.mark.parametrize("context,window", [("window", 0), ("window", 2), ("full_history", 0)])
def test_rescored_logprobs_match_sampling_with_images(vlm, context, window):
    cfg = RolloutConfig(context=context, history_window=window, max_turns=4, max_new_tokens=4, max_context_tokens=1024)
    trajs, _ = _play(vlm, cfg)
    samples = [s for t in trajs for s in t.samples]
    per_block = vlm.vision.block(png(COLOURS["red"])).count(vlm.vision.image_token_id)
    for s in samples:
        assert s.images and int((s.token_ids == vlm.vision.image_token_id).sum()) == per_block * len(s.images)
        assert (s.loss_mask[s.token_ids == vlm.vision.image_token_id] == 0).all()  # image tokens are context
    if context == "window" and window == 0:
        assert all(len(s.images) == 1 for s in samples)
    if context == "full_history":
        assert [len(s.images) for s in samples] == [t.num_turns for t in trajs]
    assert_rescores(vlm, samples, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (model.device=cuda); this machine's torch sees none")
def test_rescored_logprobs_match_sampling_with_images_on_a_gpu(tiny_vlm_dir):
    from turnforge.policy.model import load_policy

    vlm = load_policy(tiny_vlm_dir, device="cuda")
    cfg = RolloutConfig(context="full_history", max_turns=4, max_new_tokens=4, max_context_tokens=1024)
    trajs, _ = _play(vlm, cfg)
    samples = [s for t in trajs for s in t.samples]
    assert vlm.device.type == "cuda" and all(s.images for s in samples)
    assert_rescores(vlm, samples, atol=1e-4)  # pixels collated on the CPU, the forward on the GPU


class PlaceholderTextEnv(ColourEnv):
    """ColourEnv whose observations show the image placeholder's text, as a page could."""

    def reset(self, task, seed):
        super().reset(task, seed)
        return "The page says <image> and <fake_token_around_image>. What colour is it?"


def test_an_observation_showing_the_placeholder_text_gets_no_image_tokens(vlm):
    """Only an image's own block holds image tokens: with the text tokenized as specials the
    forward pass would fail ("Image features and image tokens do not match")."""
    cfg = RolloutConfig(context="window", history_window=0, max_turns=2, max_new_tokens=4, max_context_tokens=1024)
    engine = inline_engine(vlm, [PlaceholderTextEnv(2) for _ in range(2)], cfg)
    reqs = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{i}") for i in range(2)]
    trajs, _ = engine.play(reqs, PolicyActor(vlm, cfg.max_new_tokens, 1.0, torch.Generator().manual_seed(0)))
    samples = [s for t in trajs for s in t.samples]
    per_block = vlm.vision.block(png(COLOURS["red"])).count(vlm.vision.image_token_id)
    assert all(int((s.token_ids == vlm.vision.image_token_id).sum()) == per_block * len(s.images) for s in samples)
    assert_rescores(vlm, samples, atol=1e-4)


def test_the_model_sees_the_pixels(vlm):
    """Re-scoring with other images gives other logprobs: the pixels reach the forward pass."""
    cfg = RolloutConfig(context="window", history_window=0, max_turns=2, max_new_tokens=4, max_context_tokens=1024)
    trajs, _ = _play(vlm, cfg, n=2)
    samples = [s for t in trajs for s in t.samples]
    ids, attn = pad_right([s.token_ids for s in samples], vlm.pad_id)
    other = [tuple(png((0, 0, 0)) for _ in s.images) for s in samples]
    with torch.no_grad():
        lp_true, _ = token_logprobs(vlm.model, ids, attn, vision=vlm.vision.inputs([s.images for s in samples]))
        lp_other, _ = token_logprobs(vlm.model, ids, attn, vision=vlm.vision.inputs(other))
    assert not torch.allclose(lp_true, lp_other)


def test_the_processed_image_cache_keeps_the_most_recent(vlm):
    vlm.vision.cache_images = 2  # model.image_cache
    red, green, blue = (png(COLOURS[c]) for c in ("red", "green", "blue"))
    before = vlm.vision.inputs([[red], [green]])["pixel_values"]
    vlm.vision.inputs([[blue], [red]])  # green is the least recently used: dropped
    assert list(vlm.vision._cache) == [vision_key(blue), vision_key(red)]
    torch.testing.assert_close(vlm.vision.inputs([[red], [green]])["pixel_values"], before)  # re-encoded alike


def test_checkpoint_keeps_the_processor(vlm, tmp_path):
    from turnforge.policy.model import load_policy
    from turnforge.runs import RunDir
    from turnforge.train.run_dir.checkpoint import save_model

    again = load_policy(save_model(RunDir(tmp_path), vlm, RunDir(tmp_path).checkpoint("final")))
    image = png(COLOURS["blue"])
    assert again.vision.block(image) == vlm.vision.block(image)
    cfg = RolloutConfig(context="window", max_turns=2, max_new_tokens=3, max_context_tokens=1024)
    samples = [s for t in _play(vlm, cfg, n=2)[0] for s in t.samples]
    assert_rescores(again, samples, atol=1e-5)


def test_text_model_refuses_an_image_env(tiny_policy):
    cfg = RolloutConfig(context="window", max_turns=2, max_new_tokens=3)
    with pytest.raises(UserError, match="shows images in its observations but the model is text-only"):
        inline_engine(tiny_policy, [ColourEnv()], cfg)


def test_an_image_the_processor_rejects_is_one_line(vlm):
    with pytest.raises(UserError, match="not an image the processor can read"):
        vlm.vision.block(b"not a png")


@pytest.mark.parametrize("override,bad", [
    ({"rollout": {"prefix_cache": True}}, "rollout.prefix_cache=true"),
    ({"rl": {"rehearsal_coef": 0.1}}, "rl.rehearsal_coef>0"),
    ({"critic": {"enabled": True}, "rl": {"advantage": "gae"}}, "critic.enabled=true"),
])
def test_options_a_vision_policy_refuses(override, bad):
    from turnforge.policy.vision import check_vision_options

    cfg = TrainConfig.model_validate({"model": {"tiny": {"vision": {"enabled": True}}}, **override})
    with pytest.raises(UserError, match=bad.replace("+", r"\+")):
        check_vision_options(cfg, ColourEnv())


def test_a_text_model_on_an_image_env_is_refused_before_any_work():
    from turnforge.policy.vision import check_vision_options

    with pytest.raises(UserError, match="text-only"):
        check_vision_options(TrainConfig(), ColourEnv())


def test_vision_grid_must_divide():
    with pytest.raises(ValueError, match="multiple of patch_size"):
        TinyVisionConfig(enabled=True, image_size=50, patch_size=14)


def test_parquet_names_each_samples_images_and_keeps_them_once(vlm, tmp_path):
    import pyarrow.parquet as pq

    from turnforge.data.store import read_image, write_trajectories
    from turnforge.policy.vision import image_key

    cfg = RolloutConfig(context="full_history", max_turns=3, max_new_tokens=3, max_context_tokens=1024)
    trajs, _ = _play(vlm, cfg, n=3)
    path = tmp_path / "trajectories" / "rl_00000.parquet"
    write_trajectories(path, trajs, stage="rl", iteration=0)
    rows = pq.read_table(path).to_pylist()
    samples = [s for t in trajs for s in t.samples]
    assert [r["image_sha256"] for r in rows] == [[image_key(p) for p in s.images] for s in samples]
    for r, s in zip(rows, samples):
        assert tuple(read_image(path, k) for k in r["image_sha256"]) == s.images
    distinct = {image_key(p) for s in samples for p in s.images}
    assert len(list((tmp_path / "trajectories" / "images").iterdir())) == len(distinct)


def test_check_env_compares_images_and_rejects_bad_ones():
    from turnforge.envs.checker import EnvCheckError, check_env

    check_env(ColourEnv(), allow_no_actions=True)

    class Unseeded(ColourEnv):
        shown = 0

        def observation_images(self):
            Unseeded.shown += 1
            return (png((Unseeded.shown % 250, 0, 0)),)

    class Broken(ColourEnv):
        def observation_images(self):
            return (b"not an image",)

    with pytest.raises(EnvCheckError, match="different observations"):
        check_env(Unseeded(), allow_no_actions=True)
    with pytest.raises(EnvCheckError, match="not an image PIL can read"):
        check_env(Broken(), allow_no_actions=True)


def test_sincos_positions_by_hand():
    import math

    from turnforge.policy.tiny import sincos_2d

    pe = sincos_2d(2, 4)  # one frequency (1.0): [sin(row), cos(row), sin(col), cos(col)], patches row-major
    expected = [[0, 1, 0, 1], [0, 1, math.sin(1), math.cos(1)], [math.sin(1), math.cos(1), 0, 1],
                [math.sin(1), math.cos(1), math.sin(1), math.cos(1)]]
    torch.testing.assert_close(pe, torch.tensor(expected, dtype=torch.float32))
    with pytest.raises(UserError, match="multiple of 4"):
        sincos_2d(2, 6)


def test_the_tiny_vlm_tells_blank_patches_apart_by_position(vlm):
    """With sin-cos positions the image features of a blank screen differ from patch to patch."""
    blank = png((255, 255, 255), size=(56, 56))
    v = vlm.vision.inputs([[blank]])
    with torch.no_grad():
        out = vlm.model.model.get_image_features(v["pixel_values"], v["pixel_attention_mask"]).pooler_output
    feats = torch.cat(out) if isinstance(out, (list, tuple)) else out
    assert (feats[0] - feats[-1]).norm() > 0.3 * feats[0].norm()


def test_image_tokens_are_never_sampled_and_the_scores_agree(vlm):
    """The image-block tokens get SUPPRESSED_LOGIT in every forward pass (sampling and re-scoring
    alike), so a sampled action never holds an <image> the next forward would choke on."""
    from turnforge.policy.vision import IMAGE_TOKENS, SUPPRESSED_LOGIT

    ids = [vlm.tokenizer.convert_tokens_to_ids(t) for t in IMAGE_TOKENS]
    prompt = list(vlm.chat.encode("What colour is it?"))
    with torch.no_grad():
        logits = vlm.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    others = [i for i in range(len(logits)) if i not in ids]
    assert (logits[ids] == SUPPRESSED_LOGIT).all() and (logits[others] > -1e3).all()
    seq = torch.tensor([prompt + [ids[0]]])
    with torch.no_grad():
        lp, ent = token_logprobs(vlm.model, seq, torch.ones_like(seq), with_entropy=True)
    assert lp[0, -1] < -1e8 and torch.isfinite(ent).all()  # never sampled; entropies stay finite


def test_image_statistics_by_hand():
    from turnforge.policy.tiny import SIGLIP_MEAN_STD, image_stats

    from PIL import Image

    def plain(rgb):
        out = io.BytesIO()
        Image.new("RGB", (4, 4), rgb).save(out, format="PNG")
        return out.getvalue()

    red, white = plain((255, 0, 0)), plain((255, 255, 255))
    mean, std = image_stats([red, white, white, white])
    # R: 1 everywhere (std 0, floored at 0.05); G and B: 0 on a quarter of the pixels: mean 0.75, std sqrt(0.75 * 0.25)
    assert mean == (1.0, 0.75, 0.75) and std == (0.05, 0.433, 0.433)
    assert image_stats([]) == SIGLIP_MEAN_STD


def test_the_tiny_vlm_normalises_by_its_corpus_screenshots(tmp_path):
    """model.tiny.vision.normalize=corpus (the default): the processor's mean and std are the corpus
    envs' screenshots' (gui-click: mostly white), not SigLIP's 0.5 / 0.5."""
    import json

    from turnforge.config import TinyModelConfig
    from turnforge.policy.tiny import build_tiny_model

    def built(normalize):
        vision = TinyVisionConfig(enabled=True, image_size=56, patch_size=14, hidden_size=32, intermediate_size=64,
                                  normalize=normalize)
        tiny = TinyModelConfig(hidden_size=32, intermediate_size=64, vocab_size=400, corpus_envs=("gui-click",),
                               corpus_episodes=8, vision=vision)
        out = build_tiny_model(tmp_path / normalize, tiny)
        return json.loads((out / "processor_config.json").read_text())["image_processor"]

    corpus, siglip = built("corpus"), built("siglip")
    assert siglip["image_mean"] == [0.5] * 3 and siglip["image_std"] == [0.5] * 3
    assert all(m > 0.8 for m in corpus["image_mean"]) and all(0.05 <= s < 0.3 for s in corpus["image_std"])


@pytest.mark.parametrize("override, bad", [
    ({"rollout": {"context": "summarize"}}, "rollout.context=summarize"),
    ({"rl": {"advantage": "mc_grpo"}}, "rl.advantage=mc_grpo"),
])
def test_variants_that_declare_no_images_are_refused_for_a_vision_policy(override, bad):
    from turnforge.app.rules import _vision  # the start check asks each variant's registry (with_images, takes_images)

    cfg = TrainConfig.model_validate({"model": {"tiny": {"vision": {"enabled": True}}}, **override})
    with pytest.raises(UserError, match=f"{bad} is not available with a vision-language model"):
        _vision(cfg, ColourEnv())
