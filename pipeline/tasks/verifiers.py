"""Answer checkers for tasks built from data: ``f(prompt, completion, answer) -> float``.

A verifier is a plain function of the prompt text, the decoded completion text and the
gold answer string; it returns the reward (normally 1.0 or 0.0). :class:`DatasetTask
<pipeline.tasks.DatasetTask>` names one by a string, resolved once by
:func:`load_verifier`:

``exact``
    The completion is cut at the first end marker (:data:`END_MARKERS`,
    newline included) and stripped; it must equal ``answer.strip()`` character for
    character. The checker of one-line answers such as the arithmetic task's.

``numeric``
    GSM8K-style numbers. The completion is first cut at the first end-of-turn marker
    (the END_MARKERS other than ``"\\n"``: a chain of thought spans lines, and GSM8K puts
    ``#### 72`` on a line of its own). Its number is the first number after its last
    ``####`` if it has one (none there: 0.0), else the last number in the text. The gold
    answer is read the same way, uncut, so both ``"72"`` and a full GSM8K solution
    ending in ``#### 72`` work. A number is ``[+-]?[$]?digits[.digits][/digits][%]``:

    - thousands separators need groups of three (``1,234`` and ``1,234,567.5``;
      ``1,2`` is the two numbers 1 and 2);
    - a sign counts only when no letter or digit precedes it, so ``7-3`` reads as 7 and
      3, while ``-3``, ``= -3`` and ``(-3)`` read as -3;
    - ``$`` after the sign and a trailing ``%`` are ignored (``50%`` equals ``50``);
      a sentence's final ``.`` is not part of the number (``is 5.`` is 5);
    - ``a/b`` with integer ``b`` is a fraction (``3/4`` equals ``0.75``);
    - no exponents, words (``five``) or LaTeX; use ``math`` for those.

    Two integers must be equal; otherwise the relative difference must be at most 1e-6.
    A completion without a number scores 0.0. A gold answer without a number raises
    ``ValueError`` (DatasetTask counts it as a verifier error: the data is wrong, not the
    completion).

``math``
    The completion (cut at end-of-turn markers as for ``numeric``) must contain
    ``\\boxed{...}``; the last one, with balanced braces, is its answer (none: 0.0). It is
    compared with the gold answer for symbolic equivalence by math-verify (``\\frac{1}{2}``
    equals ``0.5`` and ``1/2``; ``x^2+1`` equals ``1+x^2``). The gold answer may be bare
    LaTeX or a plain expression (``\\frac{1}{2}``, ``1/2``, ``0.5``), wrapped in ``$...$``,
    or boxed (``\\boxed{0.5}``). A gold answer that math-verify cannot parse raises
    ``ValueError``. math-verify's timeouts use ``SIGALRM``, which works only in the main
    thread: there each parse and comparison gets :data:`MATH_TIMEOUT_S` seconds; in any
    other thread (a sampler's worker) they run without a time limit rather than fail.

``package.module:function`` or ``path/to/file.py:function``
    Any callable with the signature above, imported once (a dotted name after the colon
    reaches into a class or object: ``mod:Scorer.score``). A module name is imported from
    ``sys.path``; a path ending in ``.py`` is loaded from that file, so a verifier next to
    the run config needs no package.

Nothing here imports torch; math-verify is imported on the first ``math`` call.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import re
import threading
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from pipeline.errors import UserError

__all__ = [
    "BUILTIN_VERIFIERS",
    "END_MARKERS",
    "MATH_TIMEOUT_S",
    "Verifier",
    "VerifierError",
    "exact",
    "extract_answer",
    "last_boxed",
    "load_verifier",
    "math",
    "numeric",
    "parse_number",
]

Verifier = Callable[[str, str, str], float]

# Strings that end an answer when they appear in the completion text. The samplers
# decode only the tokens before EOS (special tokens skipped), so normally none is
# present; they matter for callers that decode with special tokens, and for general
# HF models whose end-of-turn strings differ. (Defined here, below pipeline.tasks, which
# re-exports them, so that tasks can import verifiers without an import cycle.)
END_MARKERS: tuple[str, ...] = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "\n")

# Seconds math-verify may spend on one parse or one comparison, in the main thread only.
MATH_TIMEOUT_S = 5

# The end-of-turn markers; "\n" is left out because multi-line answers are the point here.
_TURN_END_MARKERS = tuple(m for m in END_MARKERS if m != "\n")


class VerifierError(UserError, ValueError):
    """A verifier spec that cannot be resolved to a callable (one line: the spec and why)."""


def _cut_at_first(text: str, markers: tuple[str, ...]) -> str:
    """`text` before the first occurrence of any of `markers`."""
    positions = [pos for pos in (text.find(m) for m in markers) if pos != -1]
    return text[: min(positions, default=len(text))]


def extract_answer(completion_text: str) -> str:
    """The answer part of a completion: text before the first end marker, whitespace-stripped."""
    return _cut_at_first(completion_text, END_MARKERS).strip()


def _cut_at_turn_end(text: str) -> str:
    return _cut_at_first(text, _TURN_END_MARKERS)


# ----------------------------------------------------------------------------------
# exact
# ----------------------------------------------------------------------------------
def exact(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion's first line, stripped, equals ``answer.strip()``."""
    return 1.0 if extract_answer(completion) == answer.strip() else 0.0


# ----------------------------------------------------------------------------------
# numeric
# ----------------------------------------------------------------------------------
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-+]?)\$?"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/(?P<den>\d+))?%?"
)


def _to_fraction(match: re.Match[str]) -> Fraction | None:
    value = Fraction(match["num"].replace(",", ""))
    if match["den"] is not None:
        den = int(match["den"])
        if den == 0:
            return None
        value /= den
    return -value if match["sign"] == "-" else value


def parse_number(text: str) -> Fraction | None:
    """The final number of ``text`` as the ``numeric`` verifier reads it, or None.

    The first number after the last ``####`` if there is one, else the last number.
    """
    _, sep, tail = text.rpartition("####")
    if sep:
        first = _NUMBER.search(tail)
        return _to_fraction(first) if first else None
    matches = list(_NUMBER.finditer(text))
    return _to_fraction(matches[-1]) if matches else None


def _numbers_equal(a: Fraction, b: Fraction) -> bool:
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    return abs(a - b) <= Fraction(1, 10**6) * max(abs(a), abs(b))


def numeric(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion's final number equals the gold answer's (see module doc).

    Raises ValueError when the gold answer has no number.
    """
    gold = parse_number(answer)
    if gold is None:
        raise ValueError(f"gold answer {answer[-80:]!r} has no number")
    got = parse_number(_cut_at_turn_end(completion))
    return 1.0 if got is not None and _numbers_equal(got, gold) else 0.0


# ----------------------------------------------------------------------------------
# math
# ----------------------------------------------------------------------------------
_BOXED = "\\boxed"


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` in ``text`` (balanced braces), or None."""
    start = text.rfind(_BOXED + "{")
    while start != -1:
        depth = 0
        for i in range(start + len(_BOXED), len(text)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len(_BOXED) + 1 : i]
        # Unclosed: an earlier box may still be complete.
        start = text.rfind(_BOXED + "{", 0, start)
    return None


def _timeout() -> int | None:
    # SIGALRM-based timeouts raise ValueError off the main thread; run unbounded there.
    return MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout: int | None) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    text = answer.strip()
    if _BOXED not in text and not text.startswith("$"):
        text = f"${text}$"
    return parse(
        text,
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=timeout,
    )


def math(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the last ``\\boxed{}`` of the completion is equivalent to the gold answer.

    Raises ValueError when math-verify cannot parse the gold answer.
    """
    boxed = last_boxed(_cut_at_turn_end(completion))
    if boxed is None or not boxed.strip():
        return 0.0
    from math_verify import LatexExtractionConfig, parse, verify

    timeout = _timeout()
    gold = _parse_gold(answer, timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the gold answer {answer[-80:]!r}")
    pred = parse(
        f"{_BOXED}{{{boxed}}}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        parsing_timeout=timeout,
    )
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


# ----------------------------------------------------------------------------------
# load_verifier
# ----------------------------------------------------------------------------------
BUILTIN_VERIFIERS: dict[str, Verifier] = {"exact": exact, "numeric": numeric, "math": math}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _import_module(spec: str, module_name: str):
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise VerifierError(f"verifier {spec!r}: no such file {str(path)!r}")
        mod_spec = importlib.util.spec_from_file_location(f"heterorl_verifier_{path.stem}", path)
        if mod_spec is None or mod_spec.loader is None:
            raise VerifierError(f"verifier {spec!r}: cannot load {str(path)!r} as a module")
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as exc:  # any failure in user code is reported as the cause
            raise VerifierError(f"verifier {spec!r}: importing {str(path)!r} failed: {_one_line(exc)}") from exc
        return module
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # any failure in user code is reported as the cause
        hint = ""
        if isinstance(exc, ModuleNotFoundError):
            hint = " (is it on PYTHONPATH? a file can be named as path/to/file.py:function)"
        raise VerifierError(
            f"verifier {spec!r}: cannot import module {module_name!r}: {_one_line(exc)}{hint}"
        ) from exc


def load_verifier(spec: str) -> Verifier:
    """The verifier named by ``spec``: ``exact``, ``numeric``, ``math``, ``module:function``
    or ``path/to/file.py:function``.

    Raises VerifierError (one line naming the spec and the cause) when the spec is not a
    built-in name, its module fails to import, the attribute is missing, or it is not a
    callable that accepts ``(prompt, completion, answer)``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise VerifierError(f"verifier must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in BUILTIN_VERIFIERS:
        return BUILTIN_VERIFIERS[spec]
    module_name, sep, attr_path = spec.rpartition(":")
    if not sep or not module_name or not attr_path:
        raise VerifierError(
            f"unknown verifier {spec!r}; use one of {', '.join(BUILTIN_VERIFIERS)} "
            "or 'package.module:function' or 'path/to/file.py:function'"
        )
    obj = _import_module(spec, module_name)
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise VerifierError(f"verifier {spec!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise VerifierError(f"verifier {spec!r}: {attr_path!r} is a {type(obj).__name__}, not a callable")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins have no signature; trust them
        signature = None
    if signature is not None:
        try:
            signature.bind("prompt", "completion", "answer")
        except TypeError as exc:
            raise VerifierError(
                f"verifier {spec!r}: {attr_path}{signature} cannot be called as "
                f"f(prompt, completion, answer): {_one_line(exc)}"
            ) from None
    return obj
