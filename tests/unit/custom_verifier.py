"""Verifiers imported by spec in test_verifiers.py and test_dataset_task.py (not a test module)."""

from __future__ import annotations

NOT_CALLABLE = 3


def score(prompt: str, completion: str, answer: str) -> float:
    """Half credit for containing the answer, full credit for being it."""
    text = completion.strip()
    if text == answer:
        return 1.0
    return 0.5 if answer in text else 0.0


class Scorer:
    @staticmethod
    def score(prompt: str, completion: str, answer: str) -> float:
        return 1.0 if completion.strip() == answer else 0.0


def two_args(completion: str, answer: str) -> float:
    return 0.0


def boom(prompt: str, completion: str, answer: str) -> float:
    raise RuntimeError("boom\nsecond line")


def words(prompt: str, completion: str, answer: str) -> str:
    return "correct"


def nan(prompt: str, completion: str, answer: str) -> float:
    return float("nan")


def flag(prompt: str, completion: str, answer: str) -> bool:
    return completion.strip() == answer
