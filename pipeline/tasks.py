"""Verifiable tasks: an endless train stream, a fixed held-out split, an exact verifier.

A task is anything with ``name``, ``train_problem(index)``, ``eval_problems()`` and
``reward(problem, completion_text)`` (see :class:`Task`). Samplers call
``train_problem`` with consecutive indices and ``reward`` on each decoded completion;
the evaluator calls ``eval_problems``. ``make_task(name, **settings)`` picks one from
the registry, so a config names a task by string and a typo fails at load time.

The built-in task is integer arithmetic (``"arithmetic"``): prompts like ``37+58=``,
completions are the answer digits followed by the model's end-of-sequence token. It is
small enough that a tiny character-level model learns it in seconds on one CPU core,
which is what the end-to-end demo needs. How the held-out split is kept disjoint, and
what the verifier accepts, is documented on :class:`ArithmeticTask` and in
docs/task_and_model.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Problem",
    "Task",
    "ArithmeticTask",
    "TASKS",
    "make_task",
    "extract_answer",
    "END_MARKERS",
]


@dataclass(frozen=True)
class Problem:
    """One verifiable problem. ``problem_id`` is stable across processes and runs."""

    problem_id: str  # e.g. "arith-train-123" / "arith-eval-7"
    prompt: str  # e.g. "37+58="
    answer: str  # canonical answer, e.g. "95"


@runtime_checkable
class Task(Protocol):
    name: str

    def train_problem(self, index: int) -> Problem:
        """Problem ``index`` of the endless train stream; a pure function of (settings, index)."""

    def eval_problems(self) -> list[Problem]:
        """The fixed held-out split; disjoint from every train problem."""

    def reward(self, problem: Problem, completion_text: str) -> float:
        """1.0 if the completion is exactly the answer, else 0.0."""


# Strings that end an answer when they appear in the completion text. The samplers
# decode only the tokens before EOS (special tokens skipped), so normally none is
# present; they matter for callers that decode with special tokens, and for general
# HF models whose end-of-turn strings differ.
END_MARKERS: tuple[str, ...] = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "\n")


def extract_answer(completion_text: str) -> str:
    """The answer part of a completion: text before the first end marker, whitespace-stripped."""
    cut = len(completion_text)
    for marker in END_MARKERS:
        pos = completion_text.find(marker)
        if pos != -1:
            cut = min(cut, pos)
    return completion_text[:cut].strip()


_OPS = ("+", "-", "*")
_COMMUTATIVE = frozenset({"+", "*"})


@dataclass(frozen=True)
class ArithmeticTask:
    """Integer arithmetic ``a<op>b=`` with operands of up to ``digits`` decimal digits.

    Settings (all validated; unknown ones are rejected by :func:`make_task`):

    - ``seed``: orders the train stream. The held-out split does NOT depend on it, so
      runs with different seeds are evaluated on the same problems and a model warmed
      up with one seed never saw another seed's eval problems.
    - ``digits``: operands are drawn uniformly from ``[0, 10**digits - 1]``.
    - ``ops``: string of operators from ``"+-*"``; each problem picks one uniformly.
      ``-`` may give negative answers (written with a leading ``-``).
    - ``eval_size``: number of held-out problems.
    - ``eval_fraction``: fraction of all operand pairs reserved for the held-out pool.

    Disjointness is by construction: a keyed hash of the *unordered* operand pair for
    commutative ops (ordered for ``-``) puts every problem either in the held-out pool
    or in the train pool. Train draws are rejection-sampled from the train pool, eval
    problems are drawn from the held-out pool, so no train problem (nor its commuted
    twin ``b+a``) ever equals an eval problem.

    Verifier: the completion text is cut at the first end marker (:data:`END_MARKERS`;
    normally the sampler already stops at EOS), leading/trailing whitespace is stripped,
    and the rest must equal the canonical answer string exactly: no leading zeros
    (``"095"`` is wrong), no ``+`` sign, no inner spaces, ``-0`` is wrong.
    """

    seed: int = 0
    digits: int = 2
    ops: str = "+"
    eval_size: int = 200
    eval_fraction: float = 0.1
    name: str = dataclasses.field(default="arithmetic", init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not isinstance(self.digits, int) or not 1 <= self.digits <= 6:
            raise ValueError(f"digits must be an int in [1, 6], got {self.digits!r}")
        if not self.ops or any(op not in _OPS for op in self.ops) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops must be distinct characters from {''.join(_OPS)!r}, got {self.ops!r}")
        if not 0.0 < self.eval_fraction < 0.5:
            raise ValueError(f"eval_fraction must be in (0, 0.5), got {self.eval_fraction!r}")
        pool = int(self._n_operands() ** 2 * len(self.ops) * self.eval_fraction)
        if not isinstance(self.eval_size, int) or not 1 <= self.eval_size <= pool // 2:
            raise ValueError(
                f"eval_size must be an int in [1, {pool // 2}] for digits={self.digits}, ops={self.ops!r}, "
                f"eval_fraction={self.eval_fraction} (the held-out pool has about {pool} problems), "
                f"got {self.eval_size!r}"
            )

    # -- settings -------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Everything that defines the task (used as part of model cache keys)."""
        return {
            "name": self.name,
            "seed": self.seed,
            "digits": self.digits,
            "ops": self.ops,
            "eval_size": self.eval_size,
            "eval_fraction": self.eval_fraction,
        }

    # -- split ------------------------------------------------------------------------
    def _n_operands(self) -> int:
        return 10**self.digits

    def is_heldout(self, a: int, op: str, b: int) -> bool:
        """Whether ``a op b`` belongs to the held-out pool (a pure function of the problem)."""
        x, y = (min(a, b), max(a, b)) if op in _COMMUTATIVE else (a, b)
        digest = hashlib.blake2b(f"heterorl-arith|{op}|{x}|{y}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2.0**64 < self.eval_fraction

    def _make(self, problem_id: str, a: int, op: str, b: int) -> Problem:
        if op == "+":
            value = a + b
        elif op == "-":
            value = a - b
        else:
            value = a * b
        return Problem(problem_id=problem_id, prompt=f"{a}{op}{b}=", answer=str(value))

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        n = self._n_operands()
        return rng.randrange(n), rng.choice(self.ops), rng.randrange(n)

    def train_problem(self, index: int) -> Problem:
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be a non-negative int, got {index!r}")
        # String seeds are hashed with SHA-512 by `random`, so this is stable across
        # processes and Python runs (unlike hash()).
        rng = random.Random(f"arith-train|{self.seed}|{index}")
        while True:
            a, op, b = self._draw(rng)
            if not self.is_heldout(a, op, b):
                return self._make(f"arith-train-{index}", a, op, b)

    def eval_problems(self) -> list[Problem]:
        rng = random.Random(f"arith-eval|{self.digits}|{self.ops}|{self.eval_fraction}")
        seen: set[tuple[int, str, int]] = set()
        out: list[Problem] = []
        while len(out) < self.eval_size:
            a, op, b = self._draw(rng)
            if (a, op, b) in seen or not self.is_heldout(a, op, b):
                continue
            seen.add((a, op, b))
            out.append(self._make(f"arith-eval-{len(out)}", a, op, b))
        return out

    # -- verifier ---------------------------------------------------------------------
    def reward(self, problem: Problem, completion_text: str) -> float:
        return 1.0 if extract_answer(completion_text) == problem.answer else 0.0


TASKS: dict[str, type] = {"arithmetic": ArithmeticTask}


def make_task(name: str, **settings: Any) -> Task:
    """Build a registered task. Raises ValueError for an unknown name or setting."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None
    allowed = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown} for task {name!r}; allowed: {sorted(allowed)}")
    return cls(**settings)
