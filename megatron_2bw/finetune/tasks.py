"""The downstream tasks' files, read into examples.

Formats (what a user has once the data sets are downloaded):

- **Sentence pairs** (MNLI and any GLUE-style pair task): GLUE's TSV with a header row,
  text in the `sentence1` / `sentence2` columns (or `premise` / `hypothesis`) and the label
  in `gold_label` (or `label`); or JSON lines with `premise`, `hypothesis`, `label` (or
  the GLUE names). Rows whose gold label is `-` (no annotator majority) are skipped, as
  Megatron-LM's MNLI reader does.
- **Multiple choice** (RACE): RACE's JSON objects, `article`, `questions`, `options`
  (one list per question) and `answers` (letters): one file per article as RACE ships
  them, a directory of them (searched recursively), or JSON lines of such objects.
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from ..training.errors import UserError


@dataclass(frozen=True)
class PairExample:
    text_a: str
    text_b: str
    label: int


@dataclass(frozen=True)
class ChoiceExample:
    context: str
    question: str
    options: tuple[str, ...]
    label: int


@dataclass(frozen=True)
class TaskSpec:
    """A task: "classification" of sentence pairs, or "multiple_choice"."""

    kind: str
    labels: Optional[tuple[str, ...]] = None  # None: the sorted labels of the training data
    num_choices: int = 0


TASKS = {
    # Megatron-LM's MNLI label order (tasks/glue/mnli.py)
    "MNLI": TaskSpec("classification", ("contradiction", "entailment", "neutral")),
    "PAIRS": TaskSpec("classification"),
    "RACE": TaskSpec("multiple_choice", num_choices=4),
}
FIRST = ("sentence1", "premise", "text_a")
SECOND = ("sentence2", "hypothesis", "text_b")
LABEL = ("gold_label", "label")


def _pick(row: dict, names: Sequence[str], path: str) -> str:
    for name in names:
        if name in row:
            return row[name]
    raise UserError(f"{path} has none of the fields {', '.join(names)}", path,
                    "give GLUE's TSV with a header row, or JSON lines with premise, "
                    "hypothesis and label")


def _rows(path: str) -> Iterator[dict]:
    """GLUE TSV rows (header names as keys) or JSON lines."""
    if path.endswith(".tsv"):
        with open(path, encoding="utf-8", newline="") as f:
            yield from csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        return
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(f"{path} line {number} is not JSON ({err.msg})", path,
                                    "one JSON object per line, or a .tsv file") from err


def read_pair_rows(path: str) -> list[tuple[str, str, str]]:
    """(first text, second text, label name) of each usable row of `path`."""
    _exists(path)
    out = []
    for row in _rows(path):
        label = str(_pick(row, LABEL, path)).strip()
        if label == "-":
            continue
        out.append((_pick(row, FIRST, path), _pick(row, SECOND, path), label))
    return out


def _race_objects(path: str) -> Iterator[dict]:
    """RACE's article objects from a file (one object, or JSON lines) or a directory."""
    if os.path.isdir(path):
        for root, _, files in sorted(os.walk(path)):
            for name in sorted(files):
                if name.endswith((".txt", ".json", ".jsonl")):
                    yield from _race_objects(os.path.join(root, name))
        return
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        yield json.loads(text)
    except json.JSONDecodeError:
        yield from _rows(path)


def read_race(path: str, num_choices: int) -> list[ChoiceExample]:
    """One example per question: the article, the question, its options, the answer."""
    _exists(path)
    out = []
    for obj in _race_objects(path):
        try:
            for q, opts, ans in zip(obj["questions"], obj["options"], obj["answers"],
                                    strict=True):
                if len(opts) != num_choices:
                    raise ValueError(f"a question has {len(opts)} options, not {num_choices}")
                out.append(ChoiceExample(obj["article"], q, tuple(opts), "ABCDEFGH".index(ans)))
        except (KeyError, ValueError, TypeError) as err:
            raise UserError(f"{path}: not a RACE article ({err})", path,
                            "RACE's JSON: article, questions, options, answers") from err
    return out


def _exists(path: str) -> None:
    if not os.path.exists(path):
        raise UserError(f"no such file: {path}", path, "give an existing task file")


def label_names(spec: TaskSpec, rows: list[tuple[str, str, str]]) -> tuple[str, ...]:
    """The task's labels: fixed (MNLI), else the training data's, sorted."""
    return spec.labels or tuple(sorted({label for _, _, label in rows}))


def pair_examples(rows: list[tuple[str, str, str]], labels: Sequence[str],
                  path: str) -> list[PairExample]:
    index = {name: i for i, name in enumerate(labels)}
    unknown = sorted({label for _, _, label in rows} - set(index))
    if unknown:
        raise UserError(f"{path} has labels {unknown} outside the task's {list(labels)}",
                        path, "use the task's label names (--task PAIRS takes the "
                        "training data's)")
    return [PairExample(a, b, index[label]) for a, b, label in rows]
