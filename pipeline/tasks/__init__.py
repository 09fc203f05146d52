"""Verifiable tasks: an endless train stream, a fixed held-out split, a verifier.

A task is anything with ``name``, ``train_problem(index)``, ``eval_problems()``,
``reward(problem, completion_text)`` and ``encode_prompt(problem, tokenizer)`` (see
:class:`Task`). Samplers call ``train_problem`` with consecutive indices, feed the model
``encode_prompt`` and call ``reward`` on each decoded completion; the evaluator calls
``eval_problems``. ``make_task(name, **settings)`` picks one from the registry, so a
config names a task by string and a typo fails at load time.

Three tasks are built in:

- ``"arithmetic"`` (:class:`ArithmeticTask`): integer arithmetic, prompts like
  ``37+58=``, completions are the answer digits followed by the model's end-of-sequence
  token. It is small enough that a tiny character-level model learns it in seconds on
  one CPU core, which is what the end-to-end demo needs. How the held-out split is kept
  disjoint, and what the verifier accepts, is documented on the class and in
  docs/task_and_model.md.
- ``"scratchpad_sum"`` (:class:`ScratchpadSumTask`): the sum of several numbers,
  ``12+47+30+85+9=``, with a written scratchpad of partial sums in any order
  (``12+85=97 97+30=127 ...``), about 40 tokens long; only the final number is checked.
  The reasoning task of the paper-claims study (docs/results/long_study/).
- ``"dataset"`` (:class:`DatasetTask`): problems read from a file of records (JSON
  lines, Parquet, or a ``datasets.save_to_disk`` directory), each with a prompt (text or
  chat messages) and a gold answer, checked by a verifier from
  :mod:`pipeline.tasks.verifiers` (``exact``, ``numeric``, ``math`` or your own function).
  The held-out split is a file of its own or a hash-by-prompt slice of the one file.
  heterorl/configs/data/sums3.jsonl is a worked example the tiny model can learn.

Errors in a dataset or its settings raise :class:`DatasetError`, one line naming the
file and the line or row; a verifier that cannot be imported raises
:class:`pipeline.tasks.verifiers.VerifierError`. Both are ``UserError`` and ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

from pipeline.errors import UserError
from pipeline.tasks.verifiers import (
    BUILTIN_VERIFIERS,
    END_MARKERS,
    Verifier,
    exact,
    extract_answer,
    load_verifier,
    numeric,
    parse_number,
)

__all__ = [
    "END_MARKERS",
    "TASKS",
    "ArithmeticTask",
    "DatasetError",
    "DatasetTask",
    "Problem",
    "ScratchpadSumTask",
    "Task",
    "extract_answer",
    "make_task",
]


@dataclass(frozen=True)
class Problem:
    """One verifiable problem. ``problem_id`` is stable across processes and runs."""

    problem_id: str  # e.g. "arith-train-123" / "arith-eval-7"
    prompt: str  # e.g. "37+58="; for a chat prompt, the messages' contents joined by "\n"
    answer: str  # canonical answer, e.g. "95"
    # A chat prompt as ((role, content), ...), or None for a plain-text prompt.
    messages: tuple[tuple[str, str], ...] | None = None
    # One worked solution ending in the answer, the target of the built-in model's
    # supervised warm-up (None: the answer alone). Never shown to the policy in RL.
    solution: str | None = None


@runtime_checkable
class Task(Protocol):
    name: str

    def train_problem(self, index: int) -> Problem:
        """Problem ``index`` of the endless train stream; a pure function of (settings, index)."""

    def train_problem_by_id(self, problem_id: str) -> Problem:
        """The train problem a rollout names (the learner re-scores with it); KeyError if none."""

    def eval_problems(self) -> list[Problem]:
        """The fixed held-out split; disjoint from every train problem."""

    def reward(self, problem: Problem, completion_text: str) -> float:
        """The completion's reward (1.0 correct, 0.0 wrong for the built-in verifiers)."""

    def encode_prompt(self, problem: Problem, tokenizer: Any) -> list[int]:
        """The prompt token ids the sampler, evaluator and warm-up feed the model."""

    def settings(self) -> dict[str, Any]:
        """Everything that defines the task (part of the model cache's and stored evaluations' keys)."""


_OPS = ("+", "-", "*")
_COMMUTATIVE = frozenset({"+", "*"})
_STYLES = {"equation": "exact", "question": "numeric"}
"""The arithmetic task's prompt styles and the verifier each uses unless one is set."""
QUESTION = "What is {a} {op} {b}? Reply with just the number."
"""The arithmetic task's `question` prompt (SmolLM2-135M-Instruct answers it greedily in 18 %
of two-digit sums and differences; without the second sentence it explains, and is cut off)."""


_CHAT_TEMPLATE_MODES = ("auto", "none")


def encode_messages(tokenizer: Any, messages: Sequence[tuple[str, str]], chat_template: str = "auto",
                    system_prompt: str | None = None) -> list[int]:
    """The prompt token ids of chat `messages` ((role, content), ...); every task encodes
    its prompts here.

    A ``system_prompt`` becomes a leading system message unless the messages already start
    with one. With ``chat_template="auto"`` and a tokenizer that has a chat template, they
    are rendered by ``apply_chat_template(..., add_generation_prompt=True)`` and that text is
    encoded without special tokens (the template writes its own BOS). Otherwise (``"none"``,
    or no template, as with the tiny model's tokenizer) the contents, the system prompt
    first, are joined by newlines and encoded with the tokenizer's special tokens: a plain
    prompt ``37+58=`` becomes ``<bos>37+58=``.
    """
    messages = list(messages)
    if system_prompt and messages[0][0] != "system":
        messages.insert(0, ("system", system_prompt))
    if chat_template == "auto" and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": role, "content": content} for role, content in messages],
            add_generation_prompt=True,
            tokenize=False,
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n".join(content for _, content in messages)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def _check_prompt_format(chat_template: Any, system_prompt: Any) -> None:
    if chat_template not in _CHAT_TEMPLATE_MODES:
        raise ValueError(f"chat_template must be one of {', '.join(_CHAT_TEMPLATE_MODES)}, got {chat_template!r}")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"system_prompt must be a string or null, got {type(system_prompt).__name__}")


def _train_index(problem_id: str, prefix: str) -> int:
    """The index in `prefix<index>` (canonical digits only), else KeyError."""
    index = problem_id[len(prefix):]
    if not problem_id.startswith(prefix) or not index.isdigit() or index != str(int(index)):
        raise KeyError(f"no train problem {problem_id!r}")
    return int(index)


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
    - ``style``: ``"equation"`` asks ``37+58=`` (the tiny model's task); ``"question"`` asks
      in words, ``What is 37 + 58? Reply with just the number.``, for an instruct model
      (:data:`QUESTION`).
    - ``verifier``: ``"exact"`` (the default for equations) or ``"numeric"`` (the default for
      questions: the completion's last number, so ``37 + 58 = 95`` scores 1), from
      :mod:`pipeline.tasks.verifiers`.
    - ``chat_template`` (``"auto"``) and ``system_prompt`` (None): how the prompt is encoded,
      :func:`encode_messages` (the tiny tokenizer has no template: plain text).

    Disjointness is by construction: a keyed hash of the *unordered* operand pair for
    commutative ops (ordered for ``-``) puts every problem either in the held-out pool
    or in the train pool. Train draws are rejection-sampled from the train pool, eval
    problems are drawn from the held-out pool, so no train problem (nor its commuted
    twin ``b+a``) ever equals an eval problem.

    The ``exact`` verifier: the completion text is cut at the first end marker
    (:data:`END_MARKERS`; normally the sampler already stops at EOS), leading/trailing
    whitespace is stripped, and the rest must equal the canonical answer string exactly: no
    leading zeros (``"095"`` is wrong), no ``+`` sign, no inner spaces, ``-0`` is wrong.
    """

    seed: int = 0
    digits: int = 2
    ops: str = "+"
    eval_size: int = 200
    eval_fraction: float = 0.1
    style: str = "equation"
    verifier: str | None = None
    chat_template: str = "auto"
    system_prompt: str | None = None
    name: str = dataclasses.field(default="arithmetic", init=False)

    def __post_init__(self) -> None:
        if self.style not in _STYLES:
            raise ValueError(f"style must be one of {', '.join(_STYLES)}, got {self.style!r}")
        if self.verifier is None:
            object.__setattr__(self, "verifier", _STYLES[self.style])
        if self.verifier not in ("exact", "numeric"):
            raise ValueError(f"verifier must be exact or numeric for the arithmetic task, got {self.verifier!r}")
        _check_prompt_format(self.chat_template, self.system_prompt)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")  # noqa: TRY004 (make_task promises ValueError)
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
            "style": self.style,
            "verifier": self.verifier,
            "chat_template": self.chat_template,
            "system_prompt": self.system_prompt,
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
        prompt = f"{a}{op}{b}=" if self.style == "equation" else QUESTION.format(a=a, op=op, b=b)
        return Problem(problem_id=problem_id, prompt=prompt, answer=str(value))

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

    def train_problem_by_id(self, problem_id: str) -> Problem:
        return self.train_problem(_train_index(problem_id, "arith-train-"))

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
        return BUILTIN_VERIFIERS[self.verifier](problem.prompt, completion_text, problem.answer)

    def encode_prompt(self, problem: Problem, tokenizer: Any) -> list[int]:
        return encode_messages(tokenizer, [("user", problem.prompt)], self.chat_template, self.system_prompt)


@dataclass(frozen=True)
class ScratchpadSumTask:
    """The sum of ``terms`` numbers of up to ``digits`` digits, worked out on a scratchpad.

    The prompt is the sum, ``12+47+30+85+9=``. A worked solution adds one term at a time to
    a running total, each step written out, in any order of the terms::

        12+85=97 97+30=127 127+9=136 136+47=183

    Every order is a valid reasoning path (5 terms: 60 left-to-right folds, more with other
    groupings), and the reward looks only at the **final number** of the completion
    (:func:`pipeline.tasks.verifiers.numeric`): ``183`` alone scores 1, so does any path that ends
    in it. A completion is 30–50 tokens with the defaults, so a sequence's probability is a
    product of dozens of token probabilities, as in chain-of-thought RL (a 3-token answer
    is not; see docs/results/long_study/).

    Settings (all validated; unknown ones are rejected by :func:`make_task`):

    - ``seed``: orders the train stream (the held-out split does not depend on it);
    - ``terms`` (5): numbers per problem, 2–8;
    - ``digits`` (2): each term is drawn uniformly from ``[0, 10**digits - 1]``, 1–3;
    - ``eval_size`` (200) and ``eval_fraction`` (0.1): as for the arithmetic task.

    Disjointness: a keyed hash of the *sorted* terms puts a problem (and every reordering of
    it) either in the held-out pool or in the train pool; train draws are rejection-sampled
    from the train pool. ``Problem.solution`` is one worked solution, its order drawn from
    the problem id: the warm-up target of the built-in model (docs/task_and_model.md).
    """

    seed: int = 0
    terms: int = 5
    digits: int = 2
    eval_size: int = 200
    eval_fraction: float = 0.1
    name: str = dataclasses.field(default="scratchpad_sum", init=False)

    def __post_init__(self) -> None:
        for key, lo, hi in (("terms", 2, 8), ("digits", 1, 3)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{key} must be an int in [{lo}, {hi}], got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not 0.0 < self.eval_fraction < 0.5:
            raise ValueError(f"eval_fraction must be in (0, 0.5), got {self.eval_fraction!r}")
        if isinstance(self.eval_size, bool) or not isinstance(self.eval_size, int) or not 1 <= self.eval_size <= 5000:
            raise ValueError(f"eval_size must be an int in [1, 5000], got {self.eval_size!r}")

    def settings(self) -> dict[str, Any]:
        """Everything that defines the task (used as part of model cache keys)."""
        return {"name": self.name, "seed": self.seed, "terms": self.terms, "digits": self.digits,
                "eval_size": self.eval_size, "eval_fraction": self.eval_fraction}

    def is_heldout(self, terms: tuple[int, ...]) -> bool:
        """Whether these terms (in any order) belong to the held-out pool."""
        key = ",".join(map(str, sorted(terms)))
        digest = hashlib.blake2b(f"heterorl-scratchpad|{key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2.0**64 < self.eval_fraction

    def _draw(self, rng: random.Random) -> tuple[int, ...]:
        return tuple(rng.randrange(10**self.digits) for _ in range(self.terms))

    def _make(self, problem_id: str, terms: tuple[int, ...]) -> Problem:
        return Problem(problem_id=problem_id, prompt="+".join(map(str, terms)) + "=", answer=str(sum(terms)),
                       solution=scratchpad(terms, random.Random(f"scratchpad-solution|{problem_id}")))

    def train_problem(self, index: int) -> Problem:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be a non-negative int, got {index!r}")
        rng = random.Random(f"scratchpad-train|{self.seed}|{index}")
        while True:
            terms = self._draw(rng)
            if not self.is_heldout(terms):
                return self._make(f"pad-train-{index}", terms)

    def train_problem_by_id(self, problem_id: str) -> Problem:
        return self.train_problem(_train_index(problem_id, "pad-train-"))

    def eval_problems(self) -> list[Problem]:
        rng = random.Random(f"scratchpad-eval|{self.terms}|{self.digits}|{self.eval_fraction}")
        seen: set[tuple[int, ...]] = set()
        out: list[Problem] = []
        while len(out) < self.eval_size:
            terms = self._draw(rng)
            if tuple(sorted(terms)) in seen or not self.is_heldout(terms):
                continue
            seen.add(tuple(sorted(terms)))
            out.append(self._make(f"pad-eval-{len(out)}", terms))
        return out

    def reward(self, problem: Problem, completion_text: str) -> float:
        """1.0 when the completion's final number is the sum (the scratchpad is not checked)."""
        return numeric(problem.prompt, completion_text, problem.answer)

    def encode_prompt(self, problem: Problem, tokenizer: Any) -> list[int]:
        return encode_messages(tokenizer, [("user", problem.prompt)], "none")


def scratchpad(terms: Sequence[int], rng: random.Random) -> str:
    """A worked sum of `terms`: the running total plus one term at a time, in an order drawn
    from `rng`, each step ``total+term=new`` and the steps separated by spaces."""
    order = list(terms)
    rng.shuffle(order)
    total, steps = order[0], []
    for term in order[1:]:
        steps.append(f"{total}+{term}={total + term}")
        total += term
    return " ".join(steps)


# ----------------------------------------------------------------------------------
# Tasks from data
# ----------------------------------------------------------------------------------
class DatasetError(UserError, ValueError):
    """A dataset file or DatasetTask setting that cannot be used; one line naming where and why."""


SUPPORTED_FORMATS = ".jsonl, .parquet, or a directory written by datasets' save_to_disk"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {_one_line(exc.strerror or exc)}") from exc


def _jsonl_rows(path: Path, data: bytes) -> list[tuple[str, Any]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text (byte {exc.start}); a .jsonl file is UTF-8 JSON lines") from None
    rows = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append((f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None
    return rows


def _table_rows(path: Path, table: Any) -> list[tuple[str, Any]]:
    return [(f"{path} row {i}", rec) for i, rec in enumerate(table.to_pylist())]


def _parquet_rows(path: Path, data: bytes) -> list[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: not a readable Parquet file: {_one_line(exc)}") from None
    return _table_rows(path, table)


def _arrow_rows(path: Path, data: bytes) -> list[tuple[str, Any]]:
    import pyarrow as pa
    from pyarrow import ipc

    # save_to_disk writes the Arrow IPC stream format; accept the file format as well.
    try:
        table = ipc.open_stream(pa.BufferReader(data)).read_all()
    except (pa.ArrowException, OSError):
        try:
            table = ipc.open_file(pa.BufferReader(data)).read_all()
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(f"{path}: not a readable Arrow IPC stream: {_one_line(exc)}") from None
    return _table_rows(path, table)


def _saved_dataset_files(path: Path) -> list[Path]:
    """The Arrow shards of a ``save_to_disk`` directory, in the order state.json lists them."""
    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():
        try:
            splits = [str(s) for s in json.loads(dict_file.read_text())["splits"]]
        except (OSError, ValueError, KeyError, TypeError):
            splits = []
        example = path / (splits[0] if splits else "train")
        raise DatasetError(
            f"{path}: is a DatasetDict (splits: {', '.join(splits) or '?'}); set the path to one split's "
            f"directory, e.g. {example}"
        )
    state_file = path / "state.json"
    if not state_file.is_file():
        # Not written by save_to_disk, but a directory of Arrow shards reads the same way.
        files = sorted(path.glob("*.arrow"))
        if not files:
            raise DatasetError(f"{path}: a directory must be a datasets save_to_disk directory (state.json and "
                               f"*.arrow files); found neither (supported: {SUPPORTED_FORMATS})")
        return files
    try:
        state = json.loads(state_file.read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{state_file}: not a datasets state.json with a _data_files list ({_kind(exc)})") from None
    if state.get("_indices_data_files"):
        raise DatasetError(f"{path}: saved with an indices mapping (an old datasets version); re-save it with "
                           "ds.flatten_indices().save_to_disk(...)")
    files = []
    for name in names:
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise DatasetError(f"{state_file}: data file {name!r} is not a plain file name")
        if not (path / name).is_file():
            raise DatasetError(f"{path}: state.json lists {name} but the file is missing")
        files.append(path / name)
    if not files:
        raise DatasetError(f"{path}: no records (state.json lists no data files)")
    return files


def _load_rows(path: Path) -> tuple[list[tuple[str, Any]], str]:
    """``(location, record)`` for every record of ``path``, in file order, and a sha256 of its bytes.

    The location is ``file:line`` for JSON lines, ``file row N`` for Parquet and Arrow.
    For a directory the digest covers each shard's name and bytes, in load order.
    """
    if path.is_dir():
        digest = hashlib.sha256()
        rows: list[tuple[str, Any]] = []
        for shard in _saved_dataset_files(path):
            data = _read_bytes(shard)
            digest.update(f"{shard.name}\0{hashlib.sha256(data).hexdigest()}\n".encode())
            rows.extend(_arrow_rows(shard, data))
        return rows, digest.hexdigest()
    if not path.exists():
        raise DatasetError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise DatasetError(f"{path}: unsupported dataset format {suffix or '(no extension)'!r}; "
                           f"supported: {SUPPORTED_FORMATS}")
    data = _read_bytes(path)
    rows = _jsonl_rows(path, data) if suffix == ".jsonl" else _parquet_rows(path, data)
    return rows, hashlib.sha256(data).hexdigest()


def _prompt_of(loc: str, field: str, value: Any) -> tuple[str, tuple[tuple[str, str], ...] | None]:
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        messages = tuple((m["role"], m["content"]) for m in value)
        return "\n".join(content for _, content in messages), messages
    raise DatasetError(f"{loc}: field {field!r} must be a string or a non-empty list of {{role, content}} "
                       f"messages with string role and content, got {_kind(value)}")


def _answer_of(loc: str, field: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DatasetError(f"{loc}: field {field!r} must be a string or a number, got {_kind(value)}")
    if isinstance(value, numbers.Integral) or (math.isfinite(value) and float(value).is_integer()):
        return str(int(value))
    return repr(float(value))


@dataclass(eq=False)
class DatasetTask:
    """Problems read from a file of records, each a prompt and a gold answer.

    Settings (all validated; unknown ones are rejected by :func:`make_task`):

    - ``path``: the records. ``.jsonl`` (one JSON object per line, blank lines skipped),
      ``.parquet``, or a directory written by ``datasets``' ``Dataset.save_to_disk``
      (its Arrow shards are read with pyarrow, in the order state.json lists them; a
      ``DatasetDict`` directory is refused with a hint to pick a split). Records are read
      once, at construction, and kept in memory.
    - ``eval_path``: a second file of records, the held-out split. Train records whose
      prompt text also appears in it are dropped, so the splits stay disjoint.
    - ``eval_fraction`` (0.05): without ``eval_path``, the share of *prompts* held out.
      A keyed hash of the prompt text decides, so the split is the same in every process
      and run, ignores ``seed`` and record order, and puts duplicate prompts on one side.
    - ``eval_size`` (200): at most this many held-out problems, the first in file order
      (one per distinct prompt text).
    - ``prompt_field`` ("prompt"), ``answer_field`` ("answer"): the record fields to
      read. A prompt is a string or a list of ``{"role", "content"}`` messages (other
      keys are dropped); an answer is a string or a number (an integral number is written
      without a decimal point: ``42.0`` becomes ``"42"``).
    - ``solution_field`` (None): a record field holding a worked solution that ends in the
      answer (a chain of thought). Only the built-in model's supervised warm-up reads it
      (its target instead of the bare answer); the policy never sees it.
    - ``verifier`` ("exact"): a name or import spec for
      :func:`pipeline.tasks.verifiers.load_verifier`, resolved at construction. With ``numeric``
      every gold answer must hold a number, checked at load time.
    - ``chat_template`` ("auto" | "none") and ``system_prompt`` (None): see
      :meth:`encode_prompt`.
    - ``seed`` (0): orders the train stream, epochs of a seeded shuffle of the train
      records; ``train_problem(index)`` is a pure function of the settings, the data
      and ``index``.

    Problem ids are ``data-train-<row>`` and ``data-eval-<row>``, where row is the
    record's index in its file (blank lines not counted), stable across runs; a train
    problem has the same id in every epoch.

    ``reward`` never raises: a verifier that raises, or returns something that is not a
    finite number, scores 0.0 and is counted in ``verifier_errors`` (the last message in
    ``last_verifier_error``). Everything else a verifier returns is passed on as is.
    """

    path: str
    eval_path: str | None = None
    eval_fraction: float = 0.05
    eval_size: int = 200
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    solution_field: str | None = None
    verifier: str = "exact"
    chat_template: str = "auto"
    system_prompt: str | None = None
    seed: int = 0
    name: str = dataclasses.field(default="dataset", init=False)
    verifier_errors: int = dataclasses.field(default=0, init=False)
    last_verifier_error: str | None = dataclasses.field(default=None, init=False)
    data_sha256: str = dataclasses.field(default="", init=False)
    eval_data_sha256: str | None = dataclasses.field(default=None, init=False)
    _verify: Verifier = dataclasses.field(default=exact, init=False, repr=False)
    _train: tuple[Problem, ...] = dataclasses.field(default=(), init=False, repr=False)
    _by_id: dict = dataclasses.field(default_factory=dict, init=False, repr=False)
    _eval: tuple[Problem, ...] = dataclasses.field(default=(), init=False, repr=False)
    _order: tuple[int, list[int]] | None = dataclasses.field(default=None, init=False, repr=False)
    _lock: Any = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_settings()
        self._verify = load_verifier(self.verifier)
        records, self.data_sha256 = self._load(self.path)
        if self.eval_path is None:
            side = [_heldout(r[2], self.eval_fraction) for r in records]
            train = [r for r, is_held in zip(records, side) if not is_held]
            held = [r for r, is_held in zip(records, side) if is_held]
            if not held:
                raise DatasetError(f"{self.path}: none of its {len(records)} records fell on the eval side "
                                   f"(eval_fraction={self.eval_fraction}); raise eval_fraction or set eval_path")
            if not train:
                raise DatasetError(f"{self.path}: all of its {len(records)} records fell on the eval side "
                                   f"(eval_fraction={self.eval_fraction}); lower eval_fraction")
        else:
            held, self.eval_data_sha256 = self._load(self.eval_path)
            held_prompts = {r[2] for r in held}
            train = [r for r in records if r[2] not in held_prompts]
            if not train:
                raise DatasetError(f"{self.path}: every record's prompt also appears in eval_path "
                                   f"{self.eval_path}, so no train records are left")
        self._train = tuple(Problem(f"data-train-{row}", prompt, answer, msgs, solution)
                            for row, _, prompt, answer, msgs, solution in train)
        seen: set[str] = set()
        eval_problems = []
        for row, _, prompt, answer, msgs, _solution in held:
            if prompt in seen:
                continue
            seen.add(prompt)
            eval_problems.append(Problem(f"data-eval-{row}", prompt, answer, msgs))
            if len(eval_problems) == self.eval_size:
                break
        self._eval = tuple(eval_problems)

    def _check_settings(self) -> None:
        if not isinstance(self.path, (str, Path)) or not str(self.path):
            raise DatasetError(f"path must be a file or directory path, got {self.path!r}")
        if self.eval_path is not None and (not isinstance(self.eval_path, (str, Path)) or not str(self.eval_path)):
            raise DatasetError(f"eval_path must be a file or directory path or null, got {self.eval_path!r}")
        if isinstance(self.eval_fraction, bool) or not isinstance(self.eval_fraction, (int, float)) \
                or not 0.0 < self.eval_fraction < 1.0:
            raise DatasetError(f"eval_fraction must be a number in (0, 1), got {self.eval_fraction!r}")
        if isinstance(self.eval_size, bool) or not isinstance(self.eval_size, int) or self.eval_size < 1:
            raise DatasetError(f"eval_size must be an int >= 1, got {self.eval_size!r}")
        for key in ("prompt_field", "answer_field"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise DatasetError(f"{key} must be a non-empty string, got {value!r}")
        if self.solution_field is not None and (not isinstance(self.solution_field, str) or not self.solution_field):
            raise DatasetError(f"solution_field must be a non-empty string or null, got {self.solution_field!r}")
        try:
            _check_prompt_format(self.chat_template, self.system_prompt)
        except ValueError as e:
            raise DatasetError(str(e)) from None
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise DatasetError(f"seed must be an int, got {self.seed!r}")

    def _load(self, path: str) -> tuple[list[tuple[int, str, str, str, Any, str | None]], str]:
        """``(row, location, prompt, answer, messages, solution)`` per record of ``path``, and its sha256."""
        rows, digest = _load_rows(Path(path))
        if not rows:
            raise DatasetError(f"{path}: no records (the dataset is empty)")
        check_number = self._verify is numeric
        out = []
        for row, (loc, rec) in enumerate(rows):
            if not isinstance(rec, dict):
                raise DatasetError(f"{loc}: a record must be a JSON object, got {_kind(rec)}")
            for key in (self.prompt_field, self.answer_field):
                if key not in rec:
                    setting = "prompt_field" if key == self.prompt_field else "answer_field"
                    raise DatasetError(f"{loc}: record has no field {key!r} (its fields: "
                                       f"{', '.join(map(str, rec)) or 'none'}); set {setting}")
            prompt, messages = _prompt_of(loc, self.prompt_field, rec[self.prompt_field])
            answer = _answer_of(loc, self.answer_field, rec[self.answer_field])
            if check_number and parse_number(answer) is None:
                raise DatasetError(f"{loc}: field {self.answer_field!r} ({answer[-40:]!r}) holds no number "
                                   "for the numeric verifier")
            solution = None
            if self.solution_field is not None:
                if not isinstance(rec.get(self.solution_field), str):
                    raise DatasetError(f"{loc}: field {self.solution_field!r} (solution_field) must be text, got "
                                       f"{_kind(rec.get(self.solution_field))}")
                solution = rec[self.solution_field]
            out.append((row, loc, prompt, answer, messages, solution))
        return out, digest

    # -- settings -------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Everything that defines the task, with digests of the data (part of model cache keys).

        ``name``, ``data_sha256`` and ``eval_data_sha256`` are not ``make_task`` settings.
        """
        return {
            "name": self.name,
            "path": str(self.path),
            "eval_path": None if self.eval_path is None else str(self.eval_path),
            "eval_fraction": self.eval_fraction,
            "eval_size": self.eval_size,
            "prompt_field": self.prompt_field,
            "answer_field": self.answer_field,
            "solution_field": self.solution_field,
            "verifier": self.verifier,
            "chat_template": self.chat_template,
            "system_prompt": self.system_prompt,
            "seed": self.seed,
            "data_sha256": self.data_sha256,
            "eval_data_sha256": self.eval_data_sha256,
        }

    # -- problems -------------------------------------------------------------------
    @property
    def n_train(self) -> int:
        """Number of train records (one epoch of the train stream)."""
        return len(self._train)

    def _epoch_order(self, epoch: int) -> list[int]:
        cached = self._order
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order = list(range(len(self._train)))
        # String seeds are hashed with SHA-512 by `random`: stable across processes.
        random.Random(f"data-train|{self.seed}|{epoch}").shuffle(order)
        self._order = (epoch, order)  # one assignment, so concurrent readers see a whole pair
        return order

    def train_problem(self, index: int) -> Problem:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be a non-negative int, got {index!r}")
        epoch, pos = divmod(index, len(self._train))
        return self._train[self._epoch_order(epoch)[pos]]

    def train_problem_by_id(self, problem_id: str) -> Problem:
        if not self._by_id:
            self._by_id.update((p.problem_id, p) for p in self._train)
        try:
            return self._by_id[problem_id]
        except KeyError:
            raise KeyError(f"no train problem {problem_id!r}") from None

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    # -- verifier -------------------------------------------------------------------
    def reward(self, problem: Problem, completion_text: str) -> float:
        try:
            value = self._verify(problem.prompt, completion_text, problem.answer)
        except Exception as exc:  # noqa: BLE001 (a verifier's bug must cost one reward, not the sampler)
            self._verifier_failed(problem, f"raised {type(exc).__name__}: {_one_line(exc)}")
            return 0.0
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            self._verifier_failed(problem, f"returned {value!r:.80}, not a finite number")
            return 0.0
        return float(value)

    def _verifier_failed(self, problem: Problem, what: str) -> None:
        with self._lock:
            self.verifier_errors += 1
            self.last_verifier_error = f"verifier {self.verifier!r} {what} (problem {problem.problem_id})"

    # -- prompt -----------------------------------------------------------------------
    def encode_prompt(self, problem: Problem, tokenizer: Any) -> list[int]:
        """The prompt token ids: the problem's chat messages, or one user message holding its
        text, through :func:`encode_messages` with this task's ``chat_template`` and
        ``system_prompt``. For a plain prompt without a system prompt and no template, that is
        exactly what :class:`ArithmeticTask` feeds."""
        messages = list(problem.messages) if problem.messages else [("user", problem.prompt)]
        return encode_messages(tokenizer, messages, self.chat_template, self.system_prompt)


def _heldout(prompt: str, fraction: float) -> bool:
    """Whether a prompt belongs to the held-out side (a keyed hash of its text)."""
    digest = hashlib.blake2b(f"heterorl-data|{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < fraction


TASKS: dict[str, type] = {"arithmetic": ArithmeticTask, "scratchpad_sum": ScratchpadSumTask,
                          "dataset": DatasetTask}


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
