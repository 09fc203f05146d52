"""Write sums3.jsonl, the worked example of a task from data: ``a±b±c=`` with single digits.

Run ``python heterorl/configs/data/make_sums3.py`` (or pass an output path); the output
is the same bytes every time. Every combination of three operands 0-9 and two operators
from ``+-`` (4,000 problems) is shuffled with a fixed seed, and the first ``COUNT`` are
written, one JSON object per line: ``{"question": "7-3+5=", "target": "9"}``. Negative
results are written with a leading ``-``. Every character is one the tiny model's
tokenizer knows (``pipeline.models.tiny.CHARS``).

The fields are deliberately not called prompt/answer; a config reads the file with::

    task: {name: dataset, path: heterorl/configs/data/sums3.jsonl,
           prompt_field: question, answer_field: target, verifier: numeric}
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

COUNT = 2000
SEED = "heterorl-sums3"
OUT = Path(__file__).resolve().parent / "sums3.jsonl"


def records() -> list[dict[str, str]]:
    """The ``COUNT`` records, in file order."""
    out = []
    for a, op1, b, op2, c in itertools.product(range(10), "+-", range(10), "+-", range(10)):
        value = a + (b if op1 == "+" else -b)
        value += c if op2 == "+" else -c
        out.append({"question": f"{a}{op1}{b}{op2}{c}=", "target": str(value)})
    random.Random(SEED).shuffle(out)
    return out[:COUNT]


def main(argv: list[str]) -> None:
    path = Path(argv[0]) if argv else OUT
    text = "".join(json.dumps(rec) + "\n" for rec in records())
    path.write_text(text, encoding="utf-8", newline="\n")
    print(f"wrote {COUNT} records to {path} ({len(text.encode())} bytes)")


if __name__ == "__main__":
    main(sys.argv[1:])
