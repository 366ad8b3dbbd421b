"""The tokenizer we build from GGUF metadata matches transformers' GGUF tokenizer; chat templates render
identically; incremental detokenisation reproduces decode() exactly."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specserve.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n",
    "x=[1,2,3];y={'a':1}\n\tprint(f\"{x!r:>10}\")",
    "12345 + 678 = 99999.01, pi ~ 3.14159265358979",
    "1 22 333 4444 55555",
    "  leading  and   trailing   ",
    "\t\ttabs\n\n\nnewlines\r\nand crlf",
    "héllo wörld ñ façade naïve",
    "中文字符 日本語のテキスト 한국어",
    "emoji 😀👍🏽🇫🇷 👨‍👩‍👧",
    "ＡＢＣ１２３ full-width",
    "I'm sure you've seen they'll go, it's HE'S",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>more<file_sep>",
    "",
    " ",
    "a" * 64,
    "🙂" * 5,
]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Why?"}],
    [{"role": "user", "content": "Écris un poème 😀\nsur la mer"}],
]


@pytest.fixture(scope="module")
def ours(smollm2_gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path)


@pytest.fixture(scope="module")
def reference(smollm2_gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent),
                                                      gguf_file=smollm2_gguf_path.name)


def test_metadata(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1 and ours.bos_token == "<|im_start|>"
    assert ours.eos_token_ids == [2]  # <|im_end|>: both the GGUF eos and the template's turn end
    assert ours.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours: Tokenizer, reference, text: str) -> None:
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == reference.encode(text, add_special_tokens=True)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    if "<|" not in text and "<repo" not in text:
        assert ours.decode(ids) == text  # byte-level BPE is lossless


def test_digits_are_split_individually(ours: Tokenizer) -> None:
    ids = ours.encode("2024")
    assert [ours.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_special_tokens_stay_whole(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|>user") == [1, ours.encode("user")[0]]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, reference, conversation,
                                            add_generation_prompt: bool) -> None:
    expected = reference.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_helpers_and_errors(ours: Tokenizer) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
                "{% endif %}{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
                "{{ eos_token }}")
    tok = Tokenizer(ours.backend, bos_token="<s>", eos_token="</s>", chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<s>"é"</s>'
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(HFTokenizer(models.BPE())).apply_chat_template([{"role": "user", "content": "x"}])


def test_save_hf_round_trip(ours: Tokenizer, tmp_path) -> None:
    ours.save_hf(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert loaded.encode(text) == ours.encode(text)
    assert loaded.chat_template == ours.chat_template
    assert loaded.eos_token_ids == ours.eos_token_ids and loaded.bos_token_id == ours.bos_token_id


# ---------------------------------------------------------------------------------------- detokenizer


def _stream(tok: Tokenizer, ids: list[int], cuts: list[int], prompt_ids: list[int] | None = None
            ) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    deltas, start = [], 0
    for cut in sorted(set(cuts)) + [len(ids)]:
        if cut <= start or cut > len(ids):
            continue
        deltas.append(detok.step(ids[start:cut]))
        start = cut
    deltas.append(detok.flush())
    return deltas, detok


def test_multibyte_character_is_held_until_complete(ours: Tokenizer) -> None:
    ids = ours.encode("a😀b")
    assert len(ids) > 3  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(ours)
    deltas = [detok.step([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == "a😀b"
    assert deltas.count("") == len(ids) - 3


def test_prompt_ending_in_an_unfinished_character_does_not_swallow_the_output(ours: Tokenizer) -> None:
    """Found by the property test below: prompt [141] ends in an unfinished UTF-8 sequence and output [111] alone
    decodes to U+FFFD; used as decode context, the prompt merged with it into one unfinished sequence and the
    stream emitted nothing. Also a character split between prompt and output: the output's text is what
    decoding the output alone gives, streamed or not."""
    assert ours.decode([141]).endswith("\ufffd")
    deltas, detok = _stream(ours, [111], [], prompt_ids=[141])
    assert "".join(deltas) == detok.text == ours.decode([111]) == "\ufffd"
    ids = ours.encode("a😀b")  # the emoji spans several byte-level tokens
    split = next(i for i in range(1, len(ids)) if ours.decode(ids[:i]).endswith("\ufffd"))
    deltas, detok = _stream(ours, ids[split:], [1, 2], prompt_ids=ids[:split])
    assert "".join(deltas) == detok.text == ours.decode(ids[split:])


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_token_streams_concatenate_to_decode(ours: Tokenizer, data) -> None:
    ids = data.draw(st.lists(st.integers(0, ours.vocab_size - 1), max_size=40))
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=12))
    prompt = data.draw(st.lists(st.integers(0, ours.vocab_size - 1), max_size=8))
    deltas, detok = _stream(ours, ids, cuts, prompt_ids=prompt)
    assert "".join(deltas) == detok.text == ours.decode(ids)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_characters="\ufffd", blacklist_categories=("Cs",)),
                    max_size=40),
       data=st.data())
def test_text_streams_never_emit_replacement_characters(ours: Tokenizer, text: str, data) -> None:
    ids = ours.encode(text)
    expected = ours.decode(ids)
    # SmolLM2's vocabulary lacks a few bytes (e.g. 0x16, 0xF1): such characters cannot round-trip
    assume("\ufffd" not in expected)
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=12))
    deltas, _ = _stream(ours, ids, cuts)
    assert deltas[-1] == ""  # nothing held back at the end of valid text
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == expected


def test_detokenizer_work_is_linear(ours: Tokenizer) -> None:
    class Counting:
        def __init__(self, inner: Tokenizer) -> None:
            self.inner, self.decoded = inner, 0

        def decode(self, ids, skip_special_tokens=True):
            self.decoded += len(ids)
            return self.inner.decode(ids, skip_special_tokens)

    ids = ours.encode("The quick brown fox jumps over the lazy dog. 😀 " * 40)
    counting = Counting(ours)
    detok = IncrementalDetokenizer(counting)  # type: ignore[arg-type]
    for i in ids:
        detok.step([i])
    assert detok.text == ours.decode(ids)
    assert counting.decoded < 12 * len(ids)  # O(1) tokens decoded per new token, not O(sequence)
