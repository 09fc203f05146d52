"""Unit tests for pipeline.tasks: determinism, disjoint splits, the verifier, the registry."""

from __future__ import annotations

import pytest

from pipeline.tasks import END_MARKERS, ArithmeticTask, Problem, Task, extract_answer, make_task


def _operands(p: Problem) -> tuple[int, str, int]:
    body = p.prompt[:-1]
    assert p.prompt.endswith("=")
    for op in "+*":
        if op in body:
            a, b = body.split(op)
            return int(a), op, int(b)
    a, b = body.split("-", 1)  # operands are non-negative, so the first '-' is the operator
    return int(a), "-", int(b)


def test_registry_and_protocol():
    task = make_task("arithmetic")
    assert isinstance(task, Task)
    assert task.name == "arithmetic"
    with pytest.raises(ValueError, match="arithmetic"):
        make_task("no-such-task")
    with pytest.raises(ValueError, match="digitz"):
        make_task("arithmetic", digitz=3)


@pytest.mark.parametrize(
    "settings",
    [{"digits": 0}, {"digits": 7}, {"ops": "/"}, {"ops": ""}, {"ops": "++"}, {"eval_fraction": 0.0}, {"eval_size": 0},
     {"digits": 1, "eval_size": 500}],
)
def test_bad_settings_rejected(settings):
    with pytest.raises(ValueError):
        make_task("arithmetic", **settings)


def test_train_stream_is_deterministic_and_seeded():
    a = make_task("arithmetic", seed=3)
    b = make_task("arithmetic", seed=3)
    c = make_task("arithmetic", seed=4)
    first = [a.train_problem(i) for i in range(50)]
    assert first == [b.train_problem(i) for i in range(50)]
    # Random access gives the same problem as sequential access.
    assert a.train_problem(37) == first[37]
    assert first != [c.train_problem(i) for i in range(50)]
    assert first[5].problem_id == "arith-train-5"
    with pytest.raises(ValueError):
        a.train_problem(-1)


@pytest.mark.parametrize("ops", ["+", "-", "*", "+-*"])
def test_answers_are_correct(ops):
    task = make_task("arithmetic", digits=2, ops=ops)
    for p in [task.train_problem(i) for i in range(300)] + task.eval_problems():
        a, op, b = _operands(p)
        assert op in ops
        assert 0 <= a < 100 and 0 <= b < 100
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert p.answer == str(expected)
        assert task.reward(p, p.answer) == 1.0


@pytest.mark.parametrize("ops", ["+", "+-*"])
def test_eval_split_is_fixed_and_disjoint_from_train(ops):
    task = make_task("arithmetic", digits=2, ops=ops, eval_size=200, seed=0)
    evals = task.eval_problems()
    assert len(evals) == 200
    assert [p.problem_id for p in evals] == [f"arith-eval-{i}" for i in range(200)]
    assert len({p.prompt for p in evals}) == 200
    # The held-out split does not depend on the seed (comparable across runs).
    assert evals == make_task("arithmetic", digits=2, ops=ops, eval_size=200, seed=99).eval_problems()
    # A smaller eval_size is a prefix of a bigger one.
    assert make_task("arithmetic", digits=2, ops=ops, eval_size=50).eval_problems() == evals[:50]

    held = {_operands(p) for p in evals}
    # Commuted twins of held-out problems count as held out too.
    held |= {(b, op, a) for a, op, b in held if op in "+*"}
    for seed in (0, 1):
        t = make_task("arithmetic", digits=2, ops=ops, seed=seed)
        for i in range(5000):
            p = t.train_problem(i)
            x = _operands(p)
            assert x not in held
            assert not t.is_heldout(*x)
    assert all(task.is_heldout(*_operands(p)) for p in evals)


def test_split_is_by_construction_for_all_problems():
    # Exhaustive for one-digit addition: every problem is in exactly one pool and
    # commuted pairs always land in the same pool.
    task = ArithmeticTask(digits=1, ops="+", eval_size=2, eval_fraction=0.2)
    for a in range(10):
        for b in range(10):
            assert task.is_heldout(a, "+", b) == task.is_heldout(b, "+", a)
    train_prompts = {task.train_problem(i).prompt for i in range(2000)}
    eval_prompts = {p.prompt for p in task.eval_problems()}
    assert train_prompts.isdisjoint(eval_prompts)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("95", 1.0),
        (" 95 ", 1.0),
        ("95\n", 1.0),
        ("\t95", 1.0),
        ("95<eos>", 1.0),
        ("95<eos>12", 1.0),
        ("95</s>", 1.0),
        ("95<|endoftext|>junk", 1.0),
        ("95\n12", 1.0),
        ("095", 0.0),
        ("+95", 0.0),
        ("9 5", 0.0),
        ("95 1", 0.0),
        ("951", 0.0),
        ("9", 0.0),
        ("", 0.0),
        ("<eos>95", 0.0),
        ("95.0", 0.0),
        ("ninety-five", 0.0),
    ],
)
def test_verifier_edge_cases(text, expected):
    task = make_task("arithmetic")
    p = Problem(problem_id="x", prompt="37+58=", answer="95")
    assert task.reward(p, text) == expected


def test_verifier_negative_and_zero_answers():
    task = make_task("arithmetic", ops="-")
    neg = Problem("x", "3-15=", "-12")
    assert task.reward(neg, "-12") == 1.0
    assert task.reward(neg, "12") == 0.0
    assert task.reward(neg, "- 12") == 0.0
    zero = Problem("y", "7-7=", "0")
    assert task.reward(zero, "0") == 1.0
    assert task.reward(zero, "-0") == 0.0
    assert task.reward(zero, "00") == 0.0


def test_extract_answer_cuts_at_first_marker():
    assert extract_answer(" 12 <eos>3\n4") == "12"
    assert all(extract_answer("7" + m + "8") == "7" for m in END_MARKERS)


def test_settings_roundtrip():
    task = make_task("arithmetic", seed=5, digits=3, ops="+-", eval_size=100)
    s = task.settings()
    assert s["name"] == "arithmetic"
    rebuilt = make_task("arithmetic", **{k: v for k, v in s.items() if k != "name"})
    assert rebuilt == task


# -- questions in words, for instruct models ----------------------------------------------
def test_question_style_asks_the_same_problems_in_words():
    equations = make_task("arithmetic", ops="+-")
    questions = make_task("arithmetic", ops="+-", style="question")
    for i in range(50):
        e, q = equations.train_problem(i), questions.train_problem(i)
        a, op, b = _operands(e)
        assert q.prompt == f"What is {a} {op} {b}? Reply with just the number."
        assert (q.problem_id, q.answer) == (e.problem_id, e.answer)
        assert questions.train_problem_by_id(q.problem_id) == q
    assert [p.answer for p in questions.eval_problems()] == [p.answer for p in equations.eval_problems()]
    assert questions.settings()["style"] == "question" and questions.verifier == "numeric"
    assert equations.verifier == "exact"


@pytest.mark.parametrize(("completion", "reward"), [
    ("9", 1.0), ("47 - 38 = 9", 1.0), ("The answer is 9.", 1.0), ("9\nbecause 47 - 38 = 9", 1.0),
    ("47 - 38 = 19", 0.0), ("9 or 10", 0.0), ("nine", 0.0), ("", 0.0), ("-9", 0.0),
])
def test_a_question_is_scored_by_the_last_number_of_the_answer(completion, reward):
    task = make_task("arithmetic", ops="-", style="question")
    problem = Problem("arith-train-0", "What is 47 - 38? Reply with just the number.", "9")
    assert task.reward(problem, completion) == reward
    negative = Problem("arith-train-1", "What is 23 - 58? Reply with just the number.", "-35")
    assert task.reward(negative, "23 - 58 = -35") == 1.0 and task.reward(negative, "35") == 0.0


def test_question_prompts_go_through_the_chat_template():
    from tests.unit.test_dataset_task import _templated_tokenizer

    tok = _templated_tokenizer()  # renders (system)user followed by a space (letters are <unk> to it)
    task = make_task("arithmetic", style="question")
    problem = task.train_problem(0)

    def ids(text, special=False):
        return tok(text, add_special_tokens=special)["input_ids"]

    assert task.encode_prompt(problem, tok) == ids(f"{problem.prompt} ")
    with_system = make_task("arithmetic", style="question", system_prompt="1")
    assert with_system.encode_prompt(problem, tok) == ids(f"(1){problem.prompt} ")
    plain = make_task("arithmetic", style="question", chat_template="none")
    assert plain.encode_prompt(problem, tok) == ids(problem.prompt, special=True)


@pytest.mark.parametrize("settings", [{"style": "essay"}, {"verifier": "math"}, {"chat_template": "always"},
                                      {"system_prompt": 3}])
def test_bad_question_settings_are_rejected(settings):
    with pytest.raises(ValueError, match=next(iter(settings))):
        make_task("arithmetic", **settings)


def test_the_tiny_model_cannot_be_asked_in_words():
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="task.prompt_style=question needs a real model"):
        load_config(None, ["task.prompt_style=question"], env={})
    with pytest.raises(ConfigError, match="task.verifier=math is for datasets"):
        load_config(None, ["task.verifier=math"], env={})
    cfg = load_config(None, ["task.prompt_style=question", "model.base=smollm2-135m-instruct"], env={})
    assert make_task(cfg.task.name, **cfg.task.task_settings()).verifier == "numeric"
