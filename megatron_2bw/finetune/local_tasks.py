"""Two small downstream tasks made from local text, in the formats of MNLI and RACE.

MNLI and RACE cannot be downloaded here, so the finetuning path is exercised (and the
flush and 2BW models compared) on tasks built from the embedded corpus, or any loose
JSON corpus:

- **next sentence** (`--task PAIRS`, sentence pairs as JSON lines): a sentence and the
  one after it in its document, label `next`; or a sentence and one from another
  document, label `random`. Half of each.
- **which sentence follows** (`--task RACE`, RACE's JSON): the article is a few
  consecutive sentences, the question asks what follows, the four options are the true
  next sentence and three from other documents, in a seeded order.

Documents are split into training and validation by position (the last `dev_fraction`
of them are validation), so the two share no document.
"""
from __future__ import annotations

import json
import os
import random
from typing import Iterator, Optional

from ..data.sentences import SimpleSplitter

QUESTION = "Which sentence comes next?"


def documents(corpus: str, key: str = "text") -> list[list[str]]:
    """Each document of a loose JSON corpus as its sentences (three or more words each)."""
    splitter = SimpleSplitter()
    docs = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                sentences = [s.strip() for s in splitter.split(json.loads(line)[key])]
                sentences = [s for s in sentences if len(s.split()) >= 3]
                if len(sentences) >= 2:
                    docs.append(sentences)
    return docs


def _other(docs: list[list[str]], skip: int, rng: random.Random) -> str:
    """A sentence from a document other than `skip`."""
    while True:
        d = rng.randrange(len(docs))
        if d != skip:
            return rng.choice(docs[d])


def pair_items(docs: list[list[str]], count: int, rng: random.Random) -> Iterator[dict]:
    for n in range(count):
        d = rng.randrange(len(docs))
        i = rng.randrange(len(docs[d]) - 1)
        follows = n % 2 == 0
        second = docs[d][i + 1] if follows else _other(docs, d, rng)
        yield {"premise": docs[d][i], "hypothesis": second,
               "label": "next" if follows else "random"}


def choice_items(docs: list[list[str]], count: int, rng: random.Random,
                 context: int = 3) -> Iterator[dict]:
    """RACE objects, one question each."""
    usable = [d for d, sentences in enumerate(docs) if len(sentences) > context]
    for _ in range(count):
        d = rng.choice(usable)
        i = rng.randrange(len(docs[d]) - context)
        options = [docs[d][i + context]] + [_other(docs, d, rng) for _ in range(3)]
        order = list(range(4))
        rng.shuffle(order)
        yield {"article": " ".join(docs[d][i:i + context]), "questions": [QUESTION],
               "options": [[options[j] for j in order]],
               "answers": ["ABCD"[order.index(0)]]}


def _write(path: str, items: Iterator[dict]) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
            n += 1
    return n


def write_local_tasks(corpus: str, output: str, train: int, dev: int, seed: int = 1234,
                      dev_fraction: float = 0.2, choice_train: Optional[int] = None
                      ) -> dict[str, str]:
    """Both tasks' training and validation files under `output` (`choice_train`: the
    multiple-choice task's training items, default `train`); returns their paths."""
    docs = documents(corpus)
    cut = int(len(docs) * (1 - dev_fraction))
    if cut < 2 or len(docs) - cut < 2:
        raise ValueError(f"{corpus}: {len(docs)} usable documents are too few to split")
    os.makedirs(output, exist_ok=True)
    paths = {}
    for name, make in (("pairs", pair_items), ("choice", choice_items)):
        items = choice_train if name == "choice" and choice_train is not None else train
        for split, part, count in (("train", docs[:cut], items), ("dev", docs[cut:], dev)):
            path = os.path.join(output, f"{name}_{split}.jsonl")
            _write(path, make(part, count, random.Random(f"{seed}:{name}:{split}")))
            paths[f"{name}_{split}"] = path
    return paths
