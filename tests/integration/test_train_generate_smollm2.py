"""Draft-head training data from the real default model (SmolLM2-135M-Instruct, fp32 CPU): the target answers
every user turn itself, multi-turn conversations see their own earlier answers, greedy answers equal plain
generation, sampled ones are reproducible, and the draft vocabulary is built from the answers."""

from __future__ import annotations

import pytest
import torch

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling import SamplingParams
from specserve.train.data import Conversation
from specserve.train.generate import regenerate
from specserve.train.vocab import draft_vocab, token_counts


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    from specserve.models.loader import load_model
    parts = load_model("default", "float32", torch.device("cpu"), 1024)
    return LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=256),
                                  scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=8)), *parts)


CONVERSATIONS = [Conversation(["What is 2 + 3?", "And times 4?"], system="Answer briefly."),
                 Conversation(["Name a colour."]), Conversation(["Say hello in French."])]


def test_regenerated_answers_are_the_targets_own(engine) -> None:
    tok = engine.tokenizer
    samples, stats = regenerate(engine, tok, CONVERSATIONS, max_new_tokens=8, sampled_fraction=0.0,
                                temperature=0.0, progress=False)
    assert stats["samples"] == len(samples) == 4 and stats["generated_tokens"] > 0
    # greedy answers are exactly what plain generation gives for the same rendered prompt
    for s in samples:
        prompt = s.token_ids[:s.num_prompt]
        again = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].output_ids
        assert s.token_ids[s.num_prompt:] == again
    # the second turn's prompt holds the system prompt, both user turns and the target's first answer
    turn2 = next(s for s in samples if "times 4" in tok.decode(s.token_ids[:s.num_prompt]))
    first = next(s for s in samples if tok.decode(s.token_ids[:s.num_prompt]).rstrip().endswith(
        tok.decode(tok.encode(tok.apply_chat_template([{"role": "system", "content": "Answer briefly."},
                                                       {"role": "user", "content": "What is 2 + 3?"}])))
        .rstrip()))
    answer = tok.decode(first.token_ids[first.num_prompt:]).strip()
    context = tok.decode(turn2.token_ids[:turn2.num_prompt])
    assert "Answer briefly." in context and "What is 2 + 3?" in context and answer and answer in context
    ids = draft_vocab(token_counts(samples, engine.model_config.vocab_size), 16)
    answers = {t for s in samples for t in s.token_ids[s.num_prompt:]}
    assert len(ids) == 16 and len(answers & set(ids.tolist())) == min(16, len(answers))


def test_turns_flow_through_at_most_max_in_flight_conversations(engine) -> None:
    """``max_in_flight`` = 2: at most two conversations hold a request in the engine at any step, a
    conversation's next turn follows its previous answer, and the answers are those of a run with room for
    all (greedy: the same tokens, in finishing order)."""
    class Watched:  # the engine, counting the requests it holds at each step
        def __init__(self, inner) -> None:
            self.inner, self.peak = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def step(self):
            self.peak = max(self.peak, len(self.inner.requests))
            return self.inner.step()

    kw = dict(max_new_tokens=6, sampled_fraction=0.0, temperature=0.0, progress=False)
    wide, tight = Watched(engine), Watched(engine)
    full, _ = regenerate(wide, engine.tokenizer, CONVERSATIONS, max_in_flight=8, **kw)
    two, stats = regenerate(tight, engine.tokenizer, CONVERSATIONS, max_in_flight=2, **kw)
    assert (wide.peak, tight.peak) == (3, 2) and stats["answered"] == stats["planned"] == 3
    assert sorted(s.token_ids for s in two) == sorted(s.token_ids for s in full) and len(two) == 4
    second_turn = [s for s in two if "times 4" in engine.tokenizer.decode(s.token_ids[:s.num_prompt])]
    first_answer = next(s for s in two if s.token_ids[:s.num_prompt] == second_turn[0].token_ids[:s.num_prompt])
    assert len(second_turn) == 1 and two.index(first_answer) < two.index(second_turn[0])
    with pytest.raises(ValueError, match="max_in_flight"):
        regenerate(engine, engine.tokenizer, CONVERSATIONS, max_in_flight=0, **kw)


def test_sampled_answers_are_reproducible(engine) -> None:
    runs = [regenerate(engine, engine.tokenizer, CONVERSATIONS[1:], max_new_tokens=12, sampled_fraction=1.0,
                       temperature=1.0, seed=7, progress=False)[0] for _ in range(2)]
    assert [s.token_ids for s in runs[0]] == [s.token_ids for s in runs[1]]


def test_further_answers_per_conversation_are_sampled_after_every_first_answer(engine) -> None:
    """``answers_per_conversation`` = 2: the first pass is the one-answer run (greedy here), the second answers
    every turn again, sampled (reproducibly, and not the greedy answer), each conversation's second pass seeing
    its own sampled earlier answers."""
    tok = engine.tokenizer
    kw = dict(max_new_tokens=12, sampled_fraction=0.0, temperature=1.0, seed=3, progress=False)
    once, _ = regenerate(engine, tok, CONVERSATIONS, **kw)
    twice, stats = regenerate(engine, tok, CONVERSATIONS, answers_per_conversation=2, **kw)
    again, _ = regenerate(engine, tok, CONVERSATIONS, answers_per_conversation=2, **kw)
    assert stats["samples"] == len(twice) == 2 * len(once) == 8
    assert (stats["planned"], stats["answered"], stats["sampled"]) == (6, 6, 3)
    first = [s.token_ids for s in once]
    extra = [s.token_ids for s in twice if s.token_ids not in first]
    assert sorted(s.token_ids for s in twice if s.token_ids in first) == sorted(first)
    assert len(extra) == 4 and extra == [s.token_ids for s in again if s.token_ids not in first]
    # the second pass's prompts are the first pass's for first turns (same rendering, other answer)
    prompts = {tuple(s.token_ids[:s.num_prompt]) for s in once}
    firsts = [s for s in twice if s.token_ids in extra and tuple(s.token_ids[:s.num_prompt]) in prompts]
    assert len(firsts) == 3


def test_answer_counts_per_conversation_follow_the_prompt_file(engine) -> None:
    """``answers_per_source``: conversations of files whose name matches get that many answers (the largest
    match), the others ``answers_per_conversation``; one count per conversation reaches ``regenerate``, and a
    conversation's further answers do not depend on the other conversations' counts."""
    from specserve.config import TrainDraftConfig
    cfg = TrainDraftConfig(answers_per_source="sharegpt=3, gpt=2", sampling_temperature=1.0)
    assert [cfg.answers_for(s) for s in ("sharegpt_first.json", "codegpt.json", "gsm8k.jsonl")] == [3, 2, 1]
    convs = [Conversation(["Name a colour."], source="sharegpt_first.json"),
             Conversation(["Say hello in French."], source="gsm8k.jsonl")]
    kw = dict(max_new_tokens=8, sampled_fraction=0.0, temperature=1.0, seed=5, progress=False)
    mixed, stats = regenerate(engine, engine.tokenizer, convs, answers_per_conversation=[cfg.answers_for(c.source)
                                                                                          for c in convs], **kw)
    assert (stats["planned"], stats["answered"], stats["sampled"], len(mixed)) == (4, 4, 2, 4)
    both, _ = regenerate(engine, engine.tokenizer, convs, answers_per_conversation=3, **kw)
    colour = [s.token_ids for s in mixed if b"colour" in engine.tokenizer.decode(s.token_ids).encode()]
    assert len(colour) == 3 and colour == [s.token_ids for s in both
                                           if b"colour" in engine.tokenizer.decode(s.token_ids).encode()]
    with pytest.raises(ValueError, match="answers_per_source"):
        TrainDraftConfig(answers_per_source="sharegpt")
    with pytest.raises(ValueError, match="answers_per_conversation"):
        regenerate(engine, engine.tokenizer, convs, answers_per_conversation=[1], **kw)


def test_dataset_answers_follow_the_prompt_regeneration_would_use(engine) -> None:
    from specserve.train.generate import dataset_samples, render_prompt

    tok = engine.tokenizer
    conv = Conversation(["What is 2 + 3?", "And times 4?"], system="Answer briefly.",
                        answers=["5.", "It is 20, because four times five is twenty, as anyone can check."])
    samples, stats = dataset_samples(tok, [conv, Conversation(["No answer in the file."])], 1024)
    assert stats["samples"] == len(samples) == 2 and stats["skipped_template"] == 0
    for turn, s in enumerate(samples):
        # the prompt is what regeneration renders (the file's earlier answers as history) ...
        assert s.token_ids[:s.num_prompt] == render_prompt(tok, conv, conv.answers, turn)
        # ... and the answer is the file's own text, closed as the chat template closes a turn
        answer = tok.decode(s.token_ids[s.num_prompt:], skip_special_tokens=False)
        assert answer.startswith(conv.answers[turn] + "<|im_end|>")
    max_len = samples[1].num_prompt + 18
    assert len(samples[1].token_ids) > max_len
    cut, _ = dataset_samples(tok, [conv], max_len)  # the long answer is cut at max_len, the short one kept
    assert [len(s.token_ids) for s in cut] == [len(samples[0].token_ids), max_len]


def test_shards_answer_disjoint_parts_and_an_earlier_held_out_split_is_kept(engine, tmp_path) -> None:
    """``generate_data`` with ``shard = (i, 2)``: the two shards' samples together are the one-process run's
    (greedy, so identical), only shard 0 answers the held-out conversations. ``held_out_from``: the earlier
    run's held-out samples come back as the held-out split, their conversations are not trained on, and every
    other conversation is (also those the earlier run's split held out of another file set)."""
    import json

    from specserve.config import TrainDraftConfig
    from specserve.train.pipeline import generate_data

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "completion": "x"}) + "\n" for p in (
        "Name a colour.", "Say hello in French.", "What is 2 + 3?", "Name a fruit.", "Count to three.",
        "Name a planet.", "Spell cat.", "Name a month.", "Say yes.", "Name a tree.")))
    cfg = TrainDraftConfig(max_new_tokens=4, sampled_fraction=0.0, held_out_fraction=0.2)
    parts = (engine.runner.model, engine.model_config, engine.tokenizer)
    run = lambda **kw: generate_data(parts, cfg, [prompts], torch.device("cpu"), None, 256, 8, 0.05,  # noqa: E731
                                     progress=False, **kw)
    train, held, _ = run()
    assert (len(train), len(held)) == (8, 2)
    ids = lambda samples: sorted(s.token_ids for s in samples)  # noqa: E731
    (train0, held0, stats0), (train1, held1, _) = run(shard=(0, 2)), run(shard=(1, 2))
    assert ids(train0 + train1) == ids(train) and ids(held0) == ids(held) and held1 == []
    assert len(train0) == len(train1) == 4 and stats0["shard"] == [0, 2]
    with pytest.raises(ValueError, match="shard"):
        run(shard=(2, 2))
    earlier = held[:1]  # one conversation held out by an earlier run
    kept, kept_held, stats = run(held_out_from=earlier)
    prompt = lambda s: tuple(s.token_ids[:s.num_prompt])  # noqa: E731
    assert kept_held == earlier and stats["dropped_as_held_out"] == 1 and len(kept) == 9
    assert prompt(earlier[0]) not in {prompt(s) for s in kept}
    assert ids(kept) == ids(train + held[1:])


def test_the_target_writes_requests_that_train_like_any_prompt(engine, tmp_path) -> None:
    """Self-written prompts (Magpie): the pre-query ids are the chat template up to the user's text; requests
    come back reproducibly from their seeds, each the text the target wrote before its end-of-turn token; and
    ``generate_data`` answers them as training conversations (none held out)."""
    from specserve.config import TrainDraftConfig
    from specserve.train.pipeline import generate_data
    from specserve.train.self_prompts import SOURCE, Decontaminator, pre_query_ids, request_text, select, synthesize

    tok = engine.tokenizer
    pre = pre_query_ids(tok)
    for text in ("Plan a trip to Kyoto.", "What is 2 + 3?"):
        full = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=False))
        assert full[:len(pre)] == pre and tok.decode(full[len(pre):]).startswith(text)
    runs = [synthesize(engine, tok, 6, max_tokens=48, seed=11) for _ in range(2)]
    (convs, stats), (again, _) = runs
    assert [c.user_turns for c in convs] == [c.user_turns for c in again] and convs
    assert stats["generated"] == 6 and stats["kept"] == len(convs) and stats["generated_tokens"] > 0
    raw = engine.generate([pre] * 6, [SamplingParams(max_tokens=48, temperature=1.0, top_p=0.95, seed=11 + i)
                                      for i in range(6)])
    assert [c.user_turns[0] for c in convs] == select([(r.output_text, r.finish_reason) for r in raw])[0]
    # a control token inside a request is seen (decode would drop it silently) and the request dropped
    body = tok.encode("Tell me a story <|endoftext|> about rain")
    eot = tok.eos_token_ids[0]
    text = request_text(tok, body + [eot], "stop")
    assert text == "Tell me a story <|endoftext|> about rain" and request_text(tok, body, "length") == text
    assert select([(text, "stop")], markup=[tok.decode([i], skip_special_tokens=False)
                                            for i in tok.special_token_ids])[1]["markup"] == 1
    assert all(c.source == SOURCE and len(c.user_turns) == 1 for c in convs)
    # a request equal to an evaluation prompt is dropped
    dropped, dstats = synthesize(engine, tok, 6, max_tokens=48, seed=11,
                                 decontaminator=Decontaminator([convs[0].user_turns[0]]))
    assert dstats["contaminated"] >= 1 and convs[0].user_turns[0] not in [c.user_turns[0] for c in dropped]
    cfg = TrainDraftConfig(self_prompts=6, max_new_tokens=8, sampled_fraction=0.0)
    parts = (engine.runner.model, engine.model_config, tok)
    train, held, gstats = generate_data(parts, cfg, [], torch.device("cpu"), None, 1024, 8, 0.05)
    assert held == [] and gstats["self_prompts"]["kept"] == len(train) > 0
    prompts = {tok.decode(s.token_ids[:s.num_prompt]) for s in train}
    assert all(any(text in p for p in prompts) for text in gstats["self_prompts"]["examples"])
