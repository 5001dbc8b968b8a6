"""``turnforge merge`` on real tiny-model checkpoints: the written directory loads with
transformers and holds exactly the method's weights; LoRA adapters are read merged into the base;
the sparsity report counts what each checkpoint changed; a dare merge repeats bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import run_main
from safetensors.torch import load_file

from turnforge.errors import UserError
from turnforge.merge.checkpoints import merge_checkpoints
from turnforge.merge.methods import MergeSpec
from turnforge.paths import verify


def _derive(base, out, seed: int, share: float):
    """A copy of ``base`` with ``share`` of its weights moved (seeded), tokenizer files copied."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.rand(p.shape, generator=g) < share) * torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(out, safe_serialization=True)
    for f in base.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy2(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def family(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    base = shutil.copytree(tiny_model_dir, root / "base")
    return base, _derive(base, root / "a", 1, 0.1), _derive(base, root / "b", 2, 0.1)


def test_linear_writes_a_sealed_model_that_loads(family, tmp_path):
    from transformers import AutoModelForCausalLM

    base, a, b = family
    result = merge_checkpoints([a, b], tmp_path / "m", MergeSpec("linear", (0.25, 0.75)))
    assert verify(tmp_path / "m") is None and result.sparsity == []
    wa, wb, wm = (load_file(str(d / "model.safetensors")) for d in (a, b, tmp_path / "m"))
    assert set(wm) == set(wa) and all(torch.allclose(wm[k], 0.25 * wa[k] + 0.75 * wb[k], atol=1e-7) for k in wa)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")  # an HF directory like a checkpoint
    assert torch.equal(dict(model.named_parameters())["model.norm.weight"], wm["model.norm.weight"])
    record = json.loads((tmp_path / "m" / "merge.json").read_text())
    assert record["spec"]["method"] == "linear" and record["parents"] == [str(a.resolve()), str(b.resolve())]
    assert (tmp_path / "m" / "chat_template.jinja").read_bytes() == (a / "chat_template.jinja").read_bytes()
    assert not (tmp_path / "m.tmp").exists()


def test_ram_keeps_what_one_checkpoint_changed_and_reports_sparsity(family, tmp_path):
    base, a, b = family
    result = merge_checkpoints([a, b], tmp_path / "m", MergeSpec("ram", (1.0, 1.0)), base=base)
    w0, wa, wb, wm = (load_file(str(d / "model.safetensors")) for d in (base, a, b, tmp_path / "m"))
    for k in w0:
        da, db = wa[k] != w0[k], wb[k] != w0[k]
        assert torch.equal(wm[k][da & ~db], wa[k][da & ~db]) and torch.equal(wm[k][db & ~da], wb[k][db & ~da])
        assert torch.allclose(wm[k][da & db], ((wa[k] + wb[k]) / 2)[da & db], atol=1e-7)
        assert torch.equal(wm[k][~da & ~db], w0[k][~da & ~db])
    n = sum(t.numel() for t in w0.values())
    changed_a = sum(int((wa[k] != w0[k]).sum()) for k in w0)
    both = sum(int(((wa[k] != w0[k]) & (wb[k] != w0[k])).sum()) for k in w0)
    sp = result.sparsity[0]
    assert sp.params == n and sp.changed["0.0"] == changed_a / n and 0.08 < sp.changed["0.0"] < 0.12
    assert sp.shared == both / changed_a  # ~10%: independent changes rarely overlap


def test_dare_repeats_bit_for_bit_and_depends_on_the_seed(family, tmp_path):
    base, a, b = family
    for out, seed in (("m1", 0), ("m2", 0), ("m3", 1)):
        merge_checkpoints([a, b], tmp_path / out, MergeSpec("dare", (1.0, 1.0), density=0.5, seed=seed), base=base)
    read = lambda d: (tmp_path / d / "model.safetensors").read_bytes()  # noqa: E731
    assert read("m1") == read("m2") and read("m1") != read("m3")


def test_a_lora_adapter_is_read_merged_into_the_base(family, tmp_path):
    peft = pytest.importorskip("peft", reason="LoRA adapters need peft (the [lora] extra)")
    from transformers import AutoModelForCausalLM

    base, a, _ = family
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(tmp_path / "adapter")
    expected = {k: v for k, v in model.merge_and_unload().state_dict().items()}
    with pytest.raises(UserError, match="is a LoRA adapter: give --base"):
        merge_checkpoints([tmp_path / "adapter", a], tmp_path / "m", MergeSpec("linear", (0.5, 0.5)))
    merge_checkpoints([tmp_path / "adapter", a], tmp_path / "m", MergeSpec("linear", (1.0, 0.0)), base=base)
    wm = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert all(torch.allclose(wm[k], expected[k], atol=1e-6) for k in wm)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(wm[q], load_file(str(base / "model.safetensors"))[q])  # the adapter's delta is in


def test_the_command_prints_the_sparsity_report(family, tmp_path, monkeypatch, capsys):
    base, a, b = family
    code, out, err = run_main(["merge", str(a), str(b), "--base", str(base), "--method", "ties", "--out", str(tmp_path / "m")],
                              tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "task vectors against --base" in out and "merged 2 checkpoints (ties, weights [1.0, 1.0]" in out
    assert verify(tmp_path / "m") is None


def test_a_soup_averages_the_weights_a_run_kept(tmp_path, monkeypatch, capsys):
    """keep_checkpoints=2 keeps the last 2 saves (3 RL iterations, one checkpoint each: the first is
    dropped, the last is the final policy); `merge --soup RUN` averages them."""
    from helpers import NO_FLYWHEEL

    from turnforge.app.config import load_config
    from turnforge.app.run import train
    from turnforge.train.run_dir.checkpoint import kept_checkpoints

    run = tmp_path / "run"
    train(load_config("frozenlake-tiny", [*NO_FLYWHEEL, "bc.num_demos=48", "bc.epochs=3", "eval.episodes=2", "check_env=false",
                                          "rl.iterations=3", "rl.tasks_per_iteration=4", "rl.group_size=4", "checkpoint_every=1",
                                          "keep_checkpoints=2"]), run, live=False)
    kept = kept_checkpoints(run)
    assert [p.name for p in kept] == ["kept-002-rl-2", "kept-003-rl-3"] and all(verify(p) is None for p in kept)
    w2, w3, final = (load_file(str(d / "model.safetensors")) for d in (*kept, run / "checkpoints" / "final"))
    assert all(torch.equal(w3[k], final[k]) for k in final) and any(not torch.equal(w2[k], w3[k]) for k in w2)
    code, _, err = run_main(["merge", "--soup", run, "--out", tmp_path / "soup"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    soup = load_file(str(tmp_path / "soup" / "model.safetensors"))
    assert all(torch.allclose(soup[k], 0.5 * w2[k] + 0.5 * w3[k], atol=1e-7) for k in soup)
    code, _, err = run_main(["merge", "--soup", run, "--last", "3", "--out", tmp_path / "soup3"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "the run kept 2 weights, a soup of 3 needs more; train with keep_checkpoints=K" in err
