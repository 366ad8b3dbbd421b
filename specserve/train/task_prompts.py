"""Task prompts for draft-head training: instructions of our own wording (writing, role-play, science and
humanities explanations, extraction, reasoning) wrapped around passages and sentences taken from the
permissively licensed prompt sources in ``shared/data``, so that the head sees the target answer kinds of
request those sources hold few of, without training on anything but those sources' text.

Why: the head's acceptance is lowest on open-ended prose (writing, STEM and humanities explanations), the
requests the training prompts (ShareGPT, GPTeacher, GSM8K train, T0 question answering and summarisation)
cover least; the draft learns the target's own answers (EAGLE-3, Li et al., arXiv 2503.01840), so what matters
is that the target is asked for such answers, not who wrote the question. This is the templating idea of
T0 / P3 (Sanh et al., arXiv 2110.08207) applied to open-ended instructions.

Content (every source's licence is in its SOURCE.md; nothing is read from the evaluation sets):

    t0_sum_qa   passages of the T0 templates trained on: AdversarialQA and Quoref (Wikipedia paragraphs),
                ROPES (science backgrounds), CNN/DailyMail (news articles), DuoRC (film plots)
    wmt_ende_opennmt  English source sentences

A record is a ShareGPT-style conversation of user turns only (``train/data.py`` reads it; the target answers
every turn). About ``follow_up_fraction`` of them get a second, generic turn ("summarise your answer in three
bullet points"), so the target also answers about its own earlier answer.

Worked example (``build(data_dir, n=1, seed=0)``)::

    {"conversations": [{"from": "human", "value": "Explain the science behind the following idea in plain
      words, then give two everyday examples of it.\\n\\nPassive transport occurs when a substance passes
      through the cell membrane without needing any energy to pass through."},
     {"from": "human", "value": "Summarise your answer in three bullet points."}],
     "source": "task_prompts:stem:science"}
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
from pathlib import Path

from specserve.train.data import _records

# category -> (template, slot) pairs; the slot names the content (``_content``): a passage kind of
# ``load_passages``, "snippet" (a passage's first sentences) or "sentence" (a WMT sentence)
TEMPLATES: dict[str, list[tuple[str, str]]] = {
    "writing": [
        ("Write a blog post of about 300 words inspired by the following text.\n\n{text}", "snippet"),
        ("Write a short story that opens with this sentence:\n\n{text}", "sentence"),
        ("Write a persuasive letter to the editor of a local newspaper about the issue raised here.\n\n{text}",
         "news"),
        ("Write a poem that captures the mood of this passage.\n\n{text}", "snippet"),
        ("Draft a polite email to a colleague that sums up the news below and proposes two next steps.\n\n{text}",
         "news"),
        ("Write a short speech for a school assembly built around this idea: {text}", "sentence"),
        ("Write a product description for something the following text makes you think of. Be creative.\n\n{text}",
         "sentence"),
        ("Write the opening scene of a screenplay based on this plot. Include stage directions.\n\n{text}", "plot"),
    ],
    "roleplay": [
        ("Imagine you are a museum guide. Describe the following to a group of visitors, in your own words.\n\n"
         "{text}", "wiki"),
        ("Pretend to be a television news anchor reporting live on this story.\n\n{text}", "news"),
        ("You are one of the characters in the plot below. Introduce yourself and say what you want most, and "
         "why.\n\n{text}", "plot"),
        ("Act as a friendly science teacher and explain this to your class of twelve-year-olds.\n\n{text}",
         "science"),
        ("You are a historian being interviewed on a podcast. The host reads you this passage and asks what it "
         "tells us. Answer as the historian.\n\n{text}", "wiki"),
        ("Play the role of a politician answering a journalist who quotes this to you: \"{text}\"", "sentence"),
    ],
    "stem": [
        ("Explain the science behind the following idea in plain words, then give two everyday examples of "
         "it.\n\n{text}", "science"),
        ("What would happen if the process described here stopped working? Reason it through step by step.\n\n"
         "{text}", "science"),
        ("Describe an experiment a student could carry out to test the idea below. List the materials, the "
         "steps and what the result would show.\n\n{text}", "science"),
        ("Which scientific or technical concepts are needed to understand the passage below? Explain each of "
         "them briefly.\n\n{text}", "snippet"),
        ("Explain in detail how the technology, institution or natural phenomenon mentioned below works.\n\n"
         "{text}", "snippet"),
    ],
    "humanities": [
        ("Discuss the historical or cultural significance of the following, in a few paragraphs.\n\n{text}",
         "wiki"),
        ("What are the main arguments for and against the position expressed here?\n\n{text}", "sentence"),
        ("How might the events described below have affected ordinary people at the time? Explain.\n\n{text}",
         "wiki"),
        ("Write a short essay on the ethical questions raised by this news story.\n\n{text}", "news"),
        ("Explain the background someone would need to understand this statement: \"{text}\"", "sentence"),
    ],
    "extraction": [
        ("From the text below, list every person, place and date it mentions. Reply in JSON with three keys: "
         "\"people\", \"places\", \"dates\".\n\n{text}", "wiki"),
        ("Extract the three most important facts from this article as a numbered list.\n\n{text}", "news"),
        ("Read the passage and make a table with two columns, \"term\" and \"meaning\", for its key terms.\n\n"
         "{text}", "science"),
        ("Identify the main characters in this plot and describe each one in one sentence.\n\n{text}", "plot"),
        ("Give a one-sentence headline and three keywords for the following text.\n\n{text}", "snippet"),
    ],
    "reasoning": [
        ("Based on the passage below, what can you infer that is not stated directly? Explain your reasoning."
         "\n\n{text}", "wiki"),
        ("Is the following statement a fact, an opinion or a prediction? Explain how you can tell.\n\n{text}",
         "sentence"),
        ("List the causes and the effects described in this text, and explain how they are connected.\n\n"
         "{text}", "snippet"),
    ],
}

FOLLOW_UPS = [
    "Summarise your answer in three bullet points.",
    "Now rewrite your answer so that a ten-year-old could understand it.",
    "Make it more formal and give it a title.",
    "Give one counterargument to what you wrote, and respond to it.",
    "Turn your answer into a short poem.",
    "What is the most important point you made? Explain why.",
    "Shorten your answer to two sentences.",
    "Add a concrete example to your answer.",
]

T0_DIR = "t0_sum_qa"
WMT_FILE = "wmt_ende_opennmt/src-train.en.txt"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
SNIPPET_KINDS = ("wiki", "news", "science")  # passage kinds a "snippet" slot draws from


def _clip(text: str, max_chars: int) -> str:
    """At most ``max_chars``, cut at a sentence end where there is one."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    end = max(cut.rfind(". "), cut.rfind("? "), cut.rfind("! "))
    return cut[:end + 1] if end > max_chars // 3 else cut


def _detokenize(line: str) -> str:
    """WMT sentences come tokenized (``word , word &apos;s``): undo the common cases."""
    line = line.replace("&apos;", "'").replace("&quot;", '"').replace("&amp;", "&")
    line = re.sub(r" ([,.;:!?)'])", r"\1", line)
    return re.sub(r"([(]) ", r"\1", line).replace(" ' s ", "'s ").strip()


def load_passages(data_dir: str | Path, max_chars: int = 1500) -> dict[str, list[str]]:
    """Unique passages by kind from the T0 templates trained on: ``wiki`` (AdversarialQA, Quoref), ``science``
    (ROPES backgrounds), ``news`` (CNN/DailyMail), ``plot`` (DuoRC); sorted, each clipped to ``max_chars``."""
    t0 = Path(data_dir) / T0_DIR
    found: dict[str, set[str]] = {"wiki": set(), "science": set(), "news": set(), "plot": set()}

    def add(kind: str, text: str) -> None:
        text = text.strip()
        if len(text) >= 80:
            found[kind].add(_clip(text, max_chars))

    for path in sorted(t0.glob("adversarial_qa_*_based_on.jsonl")):
        for r in _records(path):
            add("wiki", r["prompt"].split("Context: ", 1)[-1])
    for path in sorted(t0.glob("quoref_Guess_Title_For_Context.jsonl")):
        for r in _records(path):
            body = r["prompt"].split("Given the below context:\n\n", 1)[-1]
            add("wiki", body.rsplit("\n\nGuess a valid title", 1)[0])
    for path in sorted(t0.glob("ropes_*.jsonl")):
        for r in _records(path):
            m = re.search(r"background: (.*?)\n\nNow, I have a new situation", r["prompt"], re.S)
            if m:
                add("science", m.group(1))
    for path in sorted(t0.glob("cnn_dailymail_*.jsonl")):
        for r in _records(path):
            if "Article: " in r["prompt"]:
                add("news", r["prompt"].split("Article: ", 1)[1])
    for path in sorted(t0.glob("duorc_*.jsonl")):
        for r in _records(path):
            if "movie plot: " in r["prompt"]:
                add("plot", r["prompt"].split("movie plot: ", 1)[1])
    return {kind: sorted(texts) for kind, texts in found.items()}


def load_sentences(data_dir: str | Path, min_words: int = 8, max_words: int = 40) -> list[str]:
    """English WMT source sentences of ``min_words`` to ``max_words`` words, detokenized, unique, in file order."""
    seen: dict[str, None] = {}
    with open(Path(data_dir) / WMT_FILE, encoding="utf-8") as f:
        for line in f:
            words = line.split()
            if min_words <= len(words) <= max_words:
                seen.setdefault(_detokenize(line), None)
    return list(seen)


def _content(slot: str, passages: dict[str, list[str]], sentences: list[str], rng: random.Random) -> tuple[str, str]:
    """(text, origin) for one slot: a passage of a kind, a passage's first sentences (``snippet``), or a
    WMT sentence."""
    if slot == "sentence":
        return rng.choice(sentences), "wmt"
    if slot == "snippet":
        kind = rng.choice([k for k in SNIPPET_KINDS if passages[k]])
        parts = _SENTENCE_END.split(rng.choice(passages[kind]))
        return " ".join(parts[:rng.randint(1, 3)]), kind
    if slot == "science":  # short backgrounds: the first two sentences carry the idea
        return " ".join(_SENTENCE_END.split(rng.choice(passages[slot]))[:2]), slot
    return rng.choice(passages[slot]), slot


def build(data_dir: str | Path, n: int, seed: int = 0, follow_up_fraction: float = 0.5) -> list[dict]:
    """Up to ``n`` conversations with distinct first turns, categories in turn (``TEMPLATES`` order), a random
    template and content each; deterministic in ``seed``. Templates whose content kind is missing are skipped."""
    passages = load_passages(data_dir)
    sentences = load_sentences(data_dir)
    available = {"sentence": bool(sentences), "snippet": any(passages[k] for k in SNIPPET_KINDS),
                 **{k: bool(v) for k, v in passages.items()}}
    usable = {cat: [t for t in ts if available[t[1]]] for cat, ts in TEMPLATES.items()}
    categories = [c for c, ts in usable.items() if ts]
    if not categories:
        raise ValueError(f"task prompts: no passages or sentences under {data_dir}")
    rng = random.Random(seed)
    records: dict[str, dict] = {}
    for _ in range(20 * n):  # a repeated first turn (few science passages) is skipped, not answered twice
        if len(records) == n:
            break
        category = categories[len(records) % len(categories)]
        template, slot = rng.choice(usable[category])
        text, origin = _content(slot, passages, sentences, rng)
        turns = [{"from": "human", "value": template.format(text=text)}]
        if rng.random() < follow_up_fraction:
            turns.append({"from": "human", "value": rng.choice(FOLLOW_UPS)})
        records.setdefault(turns[0]["value"],
                           {"conversations": turns, "source": f"task_prompts:{category}:{origin}"})
    return list(records.values())


def write(records: list[dict], path: str | Path) -> None:
    """JSON lines (gzipped when ``path`` ends in .gz)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", required=True, help="the shared data folder (t0_sum_qa, wmt_ende_opennmt)")
    ap.add_argument("--out", required=True, help="JSON lines to write (.gz: gzipped)")
    ap.add_argument("-n", type=int, default=6000, help="conversations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--follow-up-fraction", type=float, default=0.5)
    args = ap.parse_args(argv)
    records = build(args.data_dir, args.n, args.seed, args.follow_up_fraction)
    write(records, args.out)
    print(f"{len(records)} conversations -> {args.out}")


if __name__ == "__main__":
    main()
