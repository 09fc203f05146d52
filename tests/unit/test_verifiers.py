"""Unit tests for pipeline.tasks.verifiers: exact, numeric (GSM8K), math (math-verify), load_verifier."""

from __future__ import annotations

import threading
from fractions import Fraction

import pytest

from pipeline import tasks
from pipeline.errors import UserError
from pipeline.tasks.verifiers import (
    END_MARKERS,
    VerifierError,
    exact,
    extract_answer,
    last_boxed,
    load_verifier,
    math,
    numeric,
    parse_number,
)

GSM8K_GOLD = "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 1,234"


# -- exact ------------------------------------------------------------------------------
def test_exact_compares_the_first_line_stripped():
    assert exact("1+1=", " 2 ", "2") == 1.0
    assert exact("1+1=", "2<eos>junk", " 2\n") == 1.0
    assert exact("1+1=", "2\n3", "2") == 1.0
    assert exact("1+1=", "02", "2") == 0.0
    assert exact("1+1=", "", "2") == 0.0


def test_tasks_reexports_the_same_answer_helpers():
    assert tasks.extract_answer is extract_answer
    assert tasks.END_MARKERS is END_MARKERS
    assert tasks.extract_answer(" 12 <eos>3\n4") == "12"


# -- numeric ----------------------------------------------------------------------------
def test_numeric_gsm8k_gold_against_the_last_number_of_a_completion():
    assert numeric("q", "She sold 1000 + 234, so 1234", GSM8K_GOLD) == 1.0
    assert numeric("q", "She sold 1000 + 234, so 1,234.", GSM8K_GOLD) == 1.0
    assert numeric("q", "so 1235", GSM8K_GOLD) == 0.0
    assert numeric("q", "1234 is wrong, it is 1233", GSM8K_GOLD) == 0.0


def test_numeric_takes_the_first_number_after_the_last_hashes():
    assert numeric("q", "first 5\n#### 6\nthen\n#### 72 apples, not 3", "72") == 1.0
    assert numeric("q", "the answer is 72\n#### none", "72") == 0.0  # after #### but no number there


def test_numeric_reads_a_multi_line_chain_of_thought_but_stops_at_end_of_turn():
    assert numeric("q", "48/2 = 24\n48+24 = 72\n#### 72", "72") == 1.0
    assert numeric("q", "so 72<|im_end|>user: 5", "72") == 1.0
    assert numeric("q", "so 72</s>5", "72") == 1.0


@pytest.mark.parametrize(
    ("completion", "gold"),
    [("+5", "5"), ("$1,234,567.50", "1234567.5"), ("It costs $18.", "18"), ("50%", "50"), ("3/4", "0.75"),
     ("0.75", "3/4"), ("x = -3", "-3"), ("(-3)", "-3"), ("7-3+5=9", "9"), ("0.30000000001", "0.3"), ("5.0", "5"),
     ("-0", "0")],
)
def test_numeric_accepts(completion, gold):
    assert numeric("q", completion, gold) == 1.0


@pytest.mark.parametrize(
    ("completion", "gold"),
    [("1000001", "1000000"), ("0.31", "0.3"), ("7-3", "-3"), ("1,2", "12"), ("five", "5"), ("", "5"),
     ("1/0", "1"), ("3", "-3")],
)
def test_numeric_rejects(completion, gold):
    assert numeric("q", completion, gold) == 0.0


def test_parse_number_rules():
    assert parse_number("a 1,234 b") == 1234
    assert parse_number("1,2345") == 2345  # not a thousands group: two numbers
    assert parse_number("7-3") == 3  # a sign after a digit is an operator
    assert parse_number("= -3.") == -3
    assert parse_number("3/4") == Fraction(3, 4)
    assert parse_number("x2") is None
    assert parse_number("no number") is None


def test_numeric_gold_without_a_number_raises():
    with pytest.raises(ValueError, match="no number"):
        numeric("q", "5", "#### unknown")


# -- math -------------------------------------------------------------------------------
def test_math_boxed_fraction_equals_decimal_gold():
    assert math("q", r"so the answer is $\boxed{\frac{1}{2}}$.", "0.5") == 1.0


def test_math_wrong_and_missing_boxes_fail():
    assert math("q", r"\boxed{3}", "4") == 0.0
    assert math("q", "the answer is 4", "4") == 0.0
    assert math("q", r"\boxed{}", "4") == 0.0
    assert math("q", r"\boxed{4", "4") == 0.0


@pytest.mark.parametrize("gold", [r"\frac{1}{2}", "1/2", r"$\frac12$", r"\boxed{0.5}", r"$\boxed{\dfrac{1}{2}}$"])
def test_math_gold_forms(gold):
    assert math("q", r"\boxed{\frac{1}{2}}", gold) == 1.0


def test_math_symbolic_equivalence_and_last_box_wins():
    assert math("q", r"\boxed{1+x^2}", "x^2+1") == 1.0
    assert math("q", r"\boxed{2} no wait \boxed{3}", "3") == 1.0
    assert math("q", r"\boxed{3} no wait \boxed{2}", "3") == 0.0
    assert math("q", r"\boxed{3}<|im_end|>\boxed{4}", "3") == 1.0


def test_math_runs_off_the_main_thread():
    results = []
    worker = threading.Thread(target=lambda: results.append(math("q", r"\boxed{\sqrt{4}}", "2")))
    worker.start()
    worker.join(timeout=60)
    assert results == [1.0]


def test_math_unparseable_gold_raises():
    with pytest.raises(ValueError, match="cannot parse"):
        math("q", r"\boxed{1}", "")


def test_last_boxed_balances_braces():
    assert last_boxed(r"a \boxed{\frac{1}{2}} b \boxed{x^{2}}") == "x^{2}"
    assert last_boxed(r"\boxed{\frac{1}{2}} then \boxed{unclosed") == r"\frac{1}{2}"
    assert last_boxed("nothing") is None


# -- load_verifier ----------------------------------------------------------------------
def test_builtins_by_name():
    assert load_verifier("exact") is exact
    assert load_verifier("numeric") is numeric
    assert load_verifier(" math ") is math


def test_custom_verifier_by_module_and_by_file():
    fn = load_verifier("tests.unit.custom_verifier:score")
    assert fn("q", "42", "42") == 1.0
    assert fn("q", "is 42", "42") == 0.5
    assert load_verifier("tests.unit.custom_verifier:Scorer.score")("q", "7", "7") == 1.0
    by_file = load_verifier("tests/unit/custom_verifier.py:score")
    assert by_file("q", "x 42", "42") == 0.5


def _one_line_error(spec: str) -> str:
    with pytest.raises(VerifierError) as info:
        load_verifier(spec)
    message = str(info.value)
    assert "\n" not in message
    assert isinstance(info.value, UserError)
    assert isinstance(info.value, ValueError)
    return message


def test_a_module_that_does_not_import_names_the_spec():
    message = _one_line_error("no_such_package.scoring:score")
    assert "'no_such_package.scoring:score'" in message
    assert "ModuleNotFoundError" in message


def test_a_module_that_raises_on_import(tmp_path):
    bad = tmp_path / "bad_verifier.py"
    bad.write_text("raise RuntimeError('broken\\nover two lines')\n")
    message = _one_line_error(f"{bad}:score")
    assert str(bad) in message
    assert "RuntimeError: broken over two lines" in message


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("tests.unit.custom_verifier:nope", "no attribute 'nope'"),
     ("tests.unit.custom_verifier:NOT_CALLABLE", "not a callable"),
     ("tests.unit.custom_verifier:two_args", "f(prompt, completion, answer)"),
     ("tests/unit/missing_file.py:score", "no such file"),
     ("regex", "unknown verifier 'regex'"),
     (":score", "unknown verifier"),
     ("tests.unit.custom_verifier:", "unknown verifier")],
)
def test_bad_specs(spec, expected):
    message = _one_line_error(spec)
    assert repr(spec) in message
    assert expected in message


def test_a_non_string_spec():
    assert "non-empty string" in _one_line_error(None)  # type: ignore[arg-type]
