"""Tokenizer: a ``tokenizers.Tokenizer`` built from GGUF metadata or a Hugging Face directory, plus chat
templates and incremental detokenisation for streaming.

GGUF files carry no ``tokenizer.json``: the byte-level BPE vocabulary, merges and token types live in
``tokenizer.ggml.*`` metadata, and ``tokenizer.ggml.pre`` names the pre-tokenizer (the regex that splits
text before BPE) that llama.cpp hard-codes per model family. We rebuild the same pipeline the original
Hugging Face ``tokenizer.json`` describes for each supported family.

Chat templates are rendered the way transformers does: a sandboxed Jinja2 environment with
``trim_blocks``/``lstrip_blocks``, a ``raise_exception`` helper and ``bos_token``/``eos_token`` variables.

Incremental detokenisation follows the prefix/read offset technique (as in vLLM and TGI): decode a short
window of recent tokens and emit only the text past the previously decoded window, holding back text that
ends in an incomplete UTF-8 sequence (decoded as U+FFFD).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:
    import gguf

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL = 3
_USER_DEFINED = 4

# Split regexes of the Hugging Face tokenizer.json files these llama.cpp pre-tokenizer names stand for.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact")
_GPT2 = ("gpt-2", "gpt2")
_LLAMA3 = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")
_QWEN2 = ("qwen2", "deepseek-r1-qwen")

# Tokens that end an assistant turn in common chat templates (added to eos ids when the template uses one).
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """Raised by a chat template's ``raise_exception`` (e.g. roles that do not alternate)."""


def _byte_level_pipeline(pre: str) -> tuple[Any, Any]:
    """(normalizer, pre_tokenizer) matching the HF tokenizer.json of a llama.cpp ``tokenizer.ggml.pre``."""
    if pre in _DIGITS_THEN_GPT2:
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _GPT2:
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _LLAMA3 or pre in _QWEN2:
        split = _LLAMA3_SPLIT if pre in _LLAMA3 else _QWEN2_SPLIT
        normalizer = normalizers.NFC() if pre in _QWEN2 else None
        return normalizer, pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    supported = ", ".join(_DIGITS_THEN_GPT2 + _GPT2 + _LLAMA3 + _QWEN2)
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {supported})")


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """Encode/decode text, render chat templates; wraps a ``tokenizers.Tokenizer``."""

    def __init__(self, backend: HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 eos_token_ids: Iterable[int] = (), chat_template: str | None = None,
                 add_bos_token: bool = False) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        ids: list[int] = []
        candidates = list(eos_token_ids)
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            candidates.append(backend.token_to_id(eos_token))
        for tok in _TURN_END_TOKENS:
            if chat_template and tok in chat_template and backend.token_to_id(tok) is not None:
                candidates.append(backend.token_to_id(tok))
        for i in candidates:
            if i not in ids:
                ids.append(int(i))
        self.eos_token_ids: list[int] = ids
        self._compiled_template: jinja2.Template | None = None

    # ---------------------------------------------------------------------------------------------- build

    @classmethod
    def from_gguf(cls, reader_or_path: gguf.GGUFReader | str | Path) -> Tokenizer:
        """Rebuild the tokenizer from ``tokenizer.ggml.*`` metadata (byte-level BPE, ``gpt2`` model)."""
        import gguf as _gguf

        from specserve.models.gguf_loader import field_value

        reader = reader_or_path
        if not isinstance(reader, _gguf.GGUFReader):
            reader = _gguf.GGUFReader(str(reader_or_path))
        model = field_value(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {model!r} "
                             "(supported: gpt2, i.e. byte-level BPE)")
        tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
        types: list[int] = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges", [])]
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(tok, i)
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        normalizer, pre = _byte_level_pipeline(field_value(reader, "tokenizer.ggml.pre", "gpt2"))
        if normalizer is not None:
            backend.normalizer = normalizer
        backend.pre_tokenizer = pre
        backend.decoder = decoders.ByteLevel()
        # control tokens (<|im_start|>) are special: matched whole, skipped by decode(skip_special_tokens);
        # user-defined ones (<think>) are matched whole but are ordinary text, as in HF tokenizer.json files
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED])

        def token(key: str) -> str | None:
            i = field_value(reader, key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
        if add_bos:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
        extra_eos = [field_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
        eos_ids = [vocab[eos]] if eos is not None else []
        eos_ids += [i for i in extra_eos if i is not None]
        return cls(backend, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids,
                   chat_template=field_value(reader, "tokenizer.chat_template"), add_bos_token=add_bos)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ generation_config/config eos ids)."""
        path = Path(path)
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        eos_ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            value = _read_json(path / name).get("eos_token_id")
            if value is not None:
                eos_ids = [value] if isinstance(value, int) else list(value)
                break
        return cls(backend, bos_token=_token_content(cfg.get("bos_token")),
                   eos_token=_token_content(cfg.get("eos_token")), eos_token_ids=eos_ids,
                   chat_template=template, add_bos_token=bool(cfg.get("add_bos_token", False)))

    def save_hf(self, out_dir: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (loadable by transformers)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out_dir / "tokenizer.json"))
        eos = self.eos_token
        if eos is None and self.eos_token_ids:
            eos = self.backend.id_to_token(self.eos_token_ids[0])
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": eos,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    # ------------------------------------------------------------------------------------------- encode

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def special_token_ids(self) -> set[int]:
        """Ids of the control tokens (``<|im_start|>``, ``<|im_end|>``, ...), which ``decode`` skips by default."""
        return {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) stay whole."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -------------------------------------------------------------------------------------------- chat

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template (extra kwargs become template variables)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain completion request instead")
        if self._compiled_template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._compiled_template = env.from_string(self.chat_template)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


class IncrementalDetokenizer:
    """Turn a growing list of generated token ids into text deltas for streaming.

    Keeps two offsets into its id window: text of ``ids[prefix_offset:read_offset]`` was already emitted;
    each step decodes ``ids[prefix_offset:]`` and emits what lies past the prefix text, unless it ends in
    U+FFFD (an incomplete UTF-8 sequence, completed by a later token). Each call decodes only the last
    emitted chunk plus held-back and new tokens, so the cost is O(new tokens), not O(sequence).

    Worked example (byte-level BPE, "é" split over two tokens ``t1 = 0xC3``, ``t2 = 0xA9``):
    ``step([hi])`` -> "hi"; ``step([t1])`` -> "" (decodes "\\ufffd", held); ``step([t2])`` -> "é".
    """

    _PROMPT_CONTEXT = 6  # prompt tokens kept as decode context (spacing of SentencePiece-style decoders)

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list((prompt_ids or [])[-self._PROMPT_CONTEXT:])
        if context and tokenizer.decode(context, skip_special_tokens).endswith("\ufffd"):
            # The prompt ends in an unfinished UTF-8 sequence: as context, its bytes would merge with the first
            # generated bytes and hide them, though the output alone decodes to text (prompt [0xE2], output [0x82]:
            # decode(output) is "\ufffd", but prompt + output is still one unfinished "\ufffd" and nothing is emitted).
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def step(self, new_ids: list[int]) -> str:
        """Append generated ids; return the newly completed text (possibly "")."""
        self._ids.extend(new_ids)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        full_text = self._tokenizer.decode(self._ids[self._prefix_offset:], self._skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._compact()
        self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of generation: emit held-back text even if it ends in U+FFFD."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        full_text = self._tokenizer.decode(self._ids[self._prefix_offset:], self._skip)
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._compact()
        if delta:
            self._chunks.append(delta)
        return delta

    def _compact(self) -> None:
        """Drop ids before the prefix window so memory stays O(window)."""
        if self._prefix_offset > 0:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
