"""The scratchpad-sum task: long worked completions, any order, only the final number checked;
held-out split disjoint under reordering; usable through the dataset path; warm-up targets."""

from __future__ import annotations

import json
import random

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.models.tiny import _supervised_batch, _target, build_tokenizer
from pipeline.tasks import DatasetError, Problem, ScratchpadSumTask, make_task, scratchpad


def _check_scratchpad(problem: Problem) -> None:
    """Every step of the problem's solution is true arithmetic and uses each term once."""
    terms = [int(t) for t in problem.prompt.rstrip("=").split("+")]
    used, total = [], None
    for step in problem.solution.split(" "):
        lhs, result = step.split("=")
        a, b = (int(x) for x in lhs.split("+"))
        assert a + b == int(result)
        if total is None:
            used += [a, b]
        else:
            assert a == total  # the running total carries on
            used.append(b)
        total = int(result)
    assert sorted(used) == sorted(terms) and str(total) == problem.answer


def test_problems_worked_solutions_and_lengths():
    task = make_task("scratchpad_sum", seed=3)
    tok = build_tokenizer()
    problems = [task.train_problem(i) for i in range(300)]
    for p in problems[:50]:
        _check_scratchpad(p)
        assert task.reward(p, p.solution) == 1.0
    lengths = [len(tok(p.solution, add_special_tokens=False)["input_ids"]) + 1 for p in problems]  # + EOS
    assert 30 <= sum(lengths) / len(lengths) <= 120, sum(lengths) / len(lengths)
    assert max(len(task.encode_prompt(p, tok)) for p in problems) + max(lengths) <= 96  # the study's max_positions
    # many paths: the solutions of one problem's reorderings are drawn independently
    orders = {scratchpad((12, 47, 30, 85, 9), random.Random(k)).split(" ")[0] for k in range(40)}
    assert len(orders) > 5


def test_only_the_final_number_counts():
    task = ScratchpadSumTask()
    p = Problem("pad-train-0", "12+47+30+85+9=", "183")
    assert task.reward(p, "12+85=97 97+30=127 127+9=136 136+47=183") == 1.0
    assert task.reward(p, "47+12=59 59+9=68 68+85=153 153+30=183") == 1.0  # another order
    assert task.reward(p, "183") == 1.0  # no scratchpad: still the right answer
    assert task.reward(p, "12+85=97 97+30=127 127+9=136 136+47=184") == 0.0
    assert task.reward(p, "12+85=97 97+30=127 127+9=136") == 0.0  # stopped early
    assert task.reward(p, "wrong steps 1+1=3 183") == 1.0  # the scratchpad itself is not graded


def test_held_out_split_is_disjoint_under_reordering_and_seed_independent():
    a, b = ScratchpadSumTask(seed=0), ScratchpadSumTask(seed=99)
    held = [p.prompt for p in a.eval_problems()]
    assert held == [p.prompt for p in b.eval_problems()] and len(set(held)) == 200
    held_sets = {tuple(sorted(int(t) for t in s.rstrip("=").split("+"))) for s in held}
    for i in range(3000):
        terms = tuple(sorted(int(t) for t in a.train_problem(i).prompt.rstrip("=").split("+")))
        assert terms not in held_sets and not a.is_heldout(terms)
    assert a.train_problem(5) != b.train_problem(5)
    assert a.train_problem_by_id("pad-train-17") == a.train_problem(17)
    for bad in ("pad-train-017", "pad-eval-1", "arith-train-1"):
        with pytest.raises(KeyError):
            a.train_problem_by_id(bad)


@pytest.mark.parametrize("settings, message", [
    ({"terms": 1}, "terms"), ({"terms": 9}, "terms"), ({"digits": 4}, "digits"), ({"eval_fraction": 0.6}, "eval_fraction"),
])
def test_bad_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        ScratchpadSumTask(**settings)


def test_config_selects_it_and_an_out_of_range_setting_names_the_field():
    cfg = load_config(None, ["task.name=scratchpad_sum", "task.terms=4"])
    assert cfg.task.task_settings() == {"seed": cfg.task.seed, "terms": 4, "digits": 2, "eval_size": 200}
    with pytest.raises(ConfigError, match="task.terms"):
        load_config(None, ["task.name=scratchpad_sum", "task.terms=12"])


def test_warmup_learns_the_worked_solution_not_the_bare_answer():
    tok = build_tokenizer()
    task = ScratchpadSumTask()
    p = task.train_problem(0)
    assert _target(p) == p.solution and _target(Problem("x", "1+1=", "2")) == "2"
    ids, _, labels = _supervised_batch(tok, task, [p])
    taught = [t for t in labels[0].tolist() if t != -100]
    assert taught == tok(p.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_through_the_dataset_path_with_a_solution_field(tmp_path):
    task = ScratchpadSumTask()
    path = tmp_path / "pads.jsonl"
    with path.open("w") as f:
        for i in range(400):
            p = task.train_problem(i)
            f.write(json.dumps({"question": p.prompt, "final": p.answer, "worked": p.solution}) + "\n")
    data = make_task("dataset", path=str(path), prompt_field="question", answer_field="final",
                     solution_field="worked", verifier="numeric", eval_fraction=0.1)
    p = data.train_problem(0)
    assert p.solution.endswith("=" + p.answer) and data.reward(p, p.solution) == 1.0
    assert all(q.solution is None for q in data.eval_problems())  # held-out problems carry no solution
    with pytest.raises(DatasetError, match="'worked'.*solution_field"):
        path.write_text(json.dumps({"question": "1+2=", "final": "3", "worked": 3}) + "\n")
        make_task("dataset", path=str(path), prompt_field="question", answer_field="final", solution_field="worked",
                  verifier="numeric", eval_fraction=0.1)
