"""The tokenizer that re-counts streamed text: none, a Hugging Face directory, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from specserve.bench.tokens import resolve_token_counter


def test_none_and_auto_for_another_model() -> None:
    assert resolve_token_counter("none", "anything") == (None, "none")
    counter, desc = resolve_token_counter("auto", "some-other-model")
    assert counter is None and desc.startswith("none")


def test_hf_directory(tmp_path: Path) -> None:
    backend = HFTokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    counter, desc = resolve_token_counter(str(tmp_path), "m")
    assert desc == str(tmp_path)
    assert counter("a b a zzz") == 4 and counter("") == 0


def test_bad_tokenizer_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_token_counter(str(tmp_path), "m")
