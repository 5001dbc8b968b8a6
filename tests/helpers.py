"""Test helpers shared by several test modules (not fixtures, so not in conftest.py)."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys

#: The shape of the tiny test model (built once per session by the ``tiny_model_dir`` fixture).
TINY_TEST_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)

#: Overrides that turn the default recipe's data flywheel (and its BC evaluations at several
#: temperatures, and its pass@k measurements) off: runs of the tests that exercise the GRPO stage
#: are BC -> GRPO only (pass@k is tested in tests/train/test_boundary.py and tests/golden).
NO_FLYWHEEL = ["flywheel.rounds=0", "eval.bc_temperatures=[]", "eval.pass_at_k_samples=0"]


def inline_engine(policy, env, cfg, n: int = 1, **env_kwargs):
    """A rollout engine on in-process envs: ``env`` is a registered id (``n`` envs made with
    ``env_kwargs``) or a list of env objects."""
    from turnforge.envpool import InlineEnvs
    from turnforge.envs import make
    from turnforge.rollout.engine import RolloutEngine

    if isinstance(env, str):
        return RolloutEngine(InlineEnvs(env, n, env_kwargs), cfg, policy, make(env, **env_kwargs))
    return RolloutEngine(InlineEnvs.from_envs(env), cfg, policy, env[0])


def play(policy, env: str, cfg, n: int = 6, seed: int = 0):
    """The samples of ``n`` train episodes of registered env ``env`` that ``policy`` plays at T = 1."""
    import torch

    from turnforge.rollout.actors import PolicyActor
    from turnforge.rollout.engine import EpisodeRequest

    engine = inline_engine(policy, env, cfg, n=n)
    reqs = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{i}") for i in range(n)]
    trajs, _ = engine.play(reqs, PolicyActor(policy, cfg.max_new_tokens, 1.0, torch.Generator().manual_seed(seed)))
    return [s for t in trajs for s in t.samples]


def run_main(args, cwd, monkeypatch, capsys):
    """``turnforge.cli.main()`` with ``args`` in ``cwd``, in this process: (exit code, stdout,
    stderr). The same code as ``python -m turnforge.cli``, without a process's ~4 s of imports;
    a few cases per module still go through a real process (the entry point itself)."""
    import pytest

    from turnforge import cli, errors

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(errors, "current_run_dir", [])
    monkeypatch.setattr(sys, "argv", ["turnforge", *map(str, args)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def assert_rescores(policy, samples, atol: float = 1e-4) -> None:
    """Every sampled token of ``samples`` (``versions >= 0``) re-scores under ``policy``'s model
    to the logprob recorded when it was sampled, within ``atol`` (token-exactness)."""
    import numpy as np
    import torch

    from turnforge.policy.generate import pad_right, token_logprobs

    ids, attn = pad_right([s.token_ids for s in samples], policy.pad_id)
    vision = policy.vision.inputs([s.images for s in samples]) if policy.vision is not None else None
    with torch.no_grad():
        lp, _ = token_logprobs(policy.model, ids, attn, vision=vision)
    for i, s in enumerate(samples):
        sampled = s.versions >= 0
        np.testing.assert_allclose(lp[i, : len(s)][torch.from_numpy(sampled)].numpy(), s.logprobs[sampled], atol=atol)


def solid_png(rgb, size=(40, 28)) -> bytes:
    """PNG bytes of a ``size`` image of colour ``rgb`` with a white mark in its top-left corner."""
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, rgb)
    ImageDraw.Draw(img).rectangle([3, 3, 12, 9], fill=(255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


class WrittenCalls:
    """The policy's actor, except that some calls of some rollouts (by rollout id, in call order;
    None: the model samples that call) get written answers, teacher-forced: their logprobs are
    the model's own at the sampling temperature, so they train and re-score like sampled ones."""

    def __init__(self, actor, policy, script: dict[str, list[str | None]]) -> None:
        self.actor, self.policy, self.script = actor, policy, {k: list(v) for k, v in script.items()}
        self.temperature, self.version, self.needs_tokens = actor.temperature, actor.version, True

    def generate(self, prompts, keys, *, max_new_tokens=None, temperature=None, **kwargs):
        import torch

        from turnforge.policy.generate import Generation, token_logprobs

        written = {i: self.script[k].pop(0) for i, k in enumerate(keys) if self.script.get(k)}
        written = {i: text for i, text in written.items() if text is not None}
        rest = [i for i in range(len(prompts)) if i not in written]
        sampled = self.actor.generate([prompts[i] for i in rest], [keys[i] for i in rest], max_new_tokens=max_new_tokens,
                                      temperature=temperature, **kwargs) if rest else []
        out = dict(zip(rest, sampled))
        tok, t = self.policy.tokenizer, self.actor.temperature if temperature is None else temperature
        for i, text in written.items():
            ids = tuple(tok.encode(text, add_special_tokens=False)) + (self.policy.stop_ids[0],)
            full = torch.tensor([list(prompts[i]) + list(ids)])
            with torch.no_grad():
                lp, _ = token_logprobs(self.policy.model, full, torch.ones_like(full), temperature=t)
            out[i] = Generation(ids, tuple(lp[0, len(prompts[i]):].tolist()), True)
        return [out[i] for i in range(len(prompts))]


@functools.cache
def bwrap_unusable() -> str | None:
    """Why bubblewrap cannot run here, checked with a plain bwrap command (not turnforge's code), or None."""
    path = shutil.which("bwrap")
    if path is None:
        return "bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap"
    probe = [path, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--", "true"]
    done = subprocess.run(probe, check=False, capture_output=True, text=True, timeout=30)
    return f"bubblewrap cannot create namespaces here: {done.stderr.strip()}" if done.returncode else None
