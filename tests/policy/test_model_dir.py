"""Model directories are checked at load: a missing or broken tokenizer, truncated or
empty weights, a damaged sealed checkpoint, each one line naming the directory."""

from __future__ import annotations

import json
import shutil

import pytest

from turnforge.errors import UserError
from turnforge.paths import seal, verify
from turnforge.policy.model import load_chat_format, load_policy
from turnforge.policy.tiny import build_tiny_model


@pytest.fixture()
def model_copy(tmp_path, tiny_model_dir):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    return path


def test_missing_tokenizer_is_refused_not_a_two_token_vocabulary(model_copy):
    (model_copy / "tokenizer.json").unlink()  # a kill between saving the model and its tokenizer
    for load in (load_policy, load_chat_format):
        with pytest.raises(UserError, match=r"has no tokenizer \(none of tokenizer.json"):
            load(model_copy)


def test_tokenizer_that_cannot_round_trip_is_refused(model_copy):
    """A tokenizer.json whose vocabulary lost its byte tokens encodes text to nothing."""
    data = json.loads((model_copy / "tokenizer.json").read_text())
    data["model"]["vocab"] = {tok["content"]: tok["id"] for tok in data["added_tokens"]}
    data["model"]["merges"] = []
    (model_copy / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"does not round-trip text \('Move up, then left: 12 #@\$ ok.' -> 0 ids"):
        load_policy(model_copy)


@pytest.mark.parametrize("size", [0, 1000])
def test_truncated_or_empty_weights_are_one_line(model_copy, size):
    with open(model_copy / "model.safetensors", "r+b") as f:
        f.truncate(size)
    with pytest.raises(UserError, match=r"cannot load the model weights in .* \(model.safetensors\): "):
        load_policy(model_copy)


def test_sealed_directory_names_the_damaged_file(model_copy):
    seal(model_copy)
    assert verify(model_copy) is None
    (model_copy / "tokenizer.json").write_text((model_copy / "tokenizer.json").read_text().replace("im_end", "im_END"))
    with pytest.raises(UserError, match=r"is damaged: .*tokenizer.json is corrupt \(sha256 differs"):
        load_policy(model_copy)


def test_missing_chat_template_is_refused(model_copy):
    (model_copy / "chat_template.jinja").unlink()
    with pytest.raises(UserError, match="has no chat_template"):
        load_policy(model_copy)


def test_tiny_model_build_replaces_only_tiny_model_directories(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="exists and is not a tiny model directory"):
        build_tiny_model(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
