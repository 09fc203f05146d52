"""Unit tests for DatasetTask: loaders, one-line errors, the split by prompt, the train stream,
rewards from verifiers, prompt encoding with and without a chat template, the shipped sums3 data."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyarrow import ipc

from pipeline.errors import UserError
from pipeline.models.tiny import CHARS, build_tokenizer
from pipeline.tasks import (
    ArithmeticTask,
    DatasetError,
    DatasetTask,
    Problem,
    Task,
    make_task,
)
from pipeline.tasks.verifiers import VerifierError

ROOT = Path(__file__).resolve().parents[2]
SUMS3 = ROOT / "heterorl" / "configs" / "data" / "sums3.jsonl"
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}({{ m['content'] }}){% else %}{{ m['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %} {% endif %}"
)


def _records(n: int) -> list[dict]:
    """``n`` distinct arithmetic records whose answers are correct."""
    return [{"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7)} for i in range(n)]


def _write_jsonl(path: Path, records: list, *, blank_every: int = 0) -> Path:
    lines = []
    for i, rec in enumerate(records):
        if blank_every and i % blank_every == 0:
            lines.append("")
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


def _write_saved_dataset(path: Path, records: list[dict], shards: int = 1) -> Path:
    """A directory laid out like ``datasets.Dataset.save_to_disk``: Arrow IPC stream shards,
    state.json listing them in order, dataset_info.json."""
    path.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    size = -(-len(records) // shards)
    for i, name in enumerate(names):
        table = pa.Table.from_pylist(records[i * size:(i + 1) * size])
        with pa.OSFile(str(path / name), "wb") as sink, ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "abc", "_format_columns": None,
             "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
    (path / "state.json").write_text(json.dumps(state))
    info = {"features": {k: {"dtype": "string", "_type": "Value"} for k in records[0]}, "splits": None}
    (path / "dataset_info.json").write_text(json.dumps(info))
    return path


def _task(path: Path, **settings) -> DatasetTask:
    return make_task("dataset", path=str(path), **settings)  # type: ignore[return-value]


def _error(path_or_settings, **settings) -> str:
    """The one-line DatasetError (or VerifierError) message of building a task."""
    with pytest.raises((DatasetError, VerifierError)) as info:
        _task(path_or_settings, **settings)
    message = str(info.value)
    assert "\n" not in message
    assert isinstance(info.value, UserError)
    assert isinstance(info.value, ValueError)
    return message


def _epoch(task: DatasetTask) -> list[Problem]:
    return [task.train_problem(i) for i in range(task.n_train)]


# -- registry and protocol ----------------------------------------------------------------
def test_registered_and_a_task(tmp_path):
    task = _task(_write_jsonl(tmp_path / "d.jsonl", _records(400)))
    assert isinstance(task, Task)
    assert task.name == "dataset"
    with pytest.raises(ValueError, match="prompt_feild"):
        make_task("dataset", path="x.jsonl", prompt_feild="q")


@pytest.mark.parametrize(
    ("settings", "expected"),
    [({"chat_template": "jinja"}, "chat_template"), ({"eval_fraction": 0.0}, "eval_fraction"),
     ({"eval_fraction": 1.0}, "eval_fraction"), ({"eval_size": 0}, "eval_size"), ({"prompt_field": ""}, "prompt_field"),
     ({"system_prompt": 3}, "system_prompt"), ({"seed": "1"}, "seed")],
)
def test_bad_settings_rejected_before_loading(settings, expected):
    assert expected in _error("never-read.jsonl", **settings)


# -- loaders ------------------------------------------------------------------------------
def test_jsonl_parquet_and_saved_dataset_load_the_same_problems(tmp_path):
    records = _records(600)
    jsonl = _task(_write_jsonl(tmp_path / "d.jsonl", records, blank_every=50))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    parquet = _task(tmp_path / "d.parquet")
    saved = _task(_write_saved_dataset(tmp_path / "saved", records, shards=3))
    for task in (parquet, saved):
        assert task.eval_problems() == jsonl.eval_problems()
        assert _epoch(task) == _epoch(jsonl)
    # Ids are the record's index in its file; blank lines do not count.
    by_id = {p.problem_id: p for p in _epoch(jsonl) + jsonl.eval_problems()}
    for row in (0, 1, 49, 50, 599):
        problem = by_id.get(f"data-train-{row}") or by_id[f"data-eval-{row}"]
        assert problem.prompt == records[row]["prompt"]
        assert problem.answer == records[row]["answer"]


def test_saved_dataset_shards_are_read_in_state_json_order(tmp_path):
    records = _records(400)
    path = _write_saved_dataset(tmp_path / "saved", records, shards=2)
    # Swap the shard order in state.json: rows follow it, not the file names.
    state = json.loads((path / "state.json").read_text())
    state["_data_files"].reverse()
    (path / "state.json").write_text(json.dumps(state))
    task = _task(path)
    first_of_second_shard = records[200]
    by_id = {p.problem_id: p for p in _epoch(task) + task.eval_problems()}
    assert (by_id.get("data-train-0") or by_id["data-eval-0"]).prompt == first_of_second_shard["prompt"]


def test_chat_message_prompts_and_numeric_answers(tmp_path):
    records = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{i}+1="}],
                "answer": i + 1} for i in range(400)]
    task = _task(_write_jsonl(tmp_path / "chat.jsonl", records))
    problem = task.train_problem(0)
    assert problem.messages is not None
    assert problem.messages[0] == ("system", "be brief")
    assert problem.prompt == "\n".join(content for _, content in problem.messages)
    assert problem.answer == str(int(problem.messages[1][1][:-3]) + 1)
    hash(problem)  # frozen and hashable
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chat.parquet")  # list<struct<role, content>>
    assert _epoch(_task(tmp_path / "chat.parquet")) == _epoch(task)
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": 2.0}, {"prompt": "1/4=", "answer": 0.25}]),
                   tmp_path / "floats.parquet")
    held_out = _write_jsonl(tmp_path / "held_out.jsonl", [{"prompt": "5+5=", "answer": 10}])
    floats = _task(tmp_path / "floats.parquet", eval_path=str(held_out))
    assert sorted(p.answer for p in _epoch(floats)) == ["0.25", "2"]
    assert [p.answer for p in floats.eval_problems()] == ["10"]


# -- one-line errors ----------------------------------------------------------------------
def test_missing_file(tmp_path):
    message = _error(tmp_path / "nope.jsonl")
    assert str(tmp_path / "nope.jsonl") in message and "no such file" in message


def test_unsupported_extension(tmp_path):
    (tmp_path / "d.csv").write_text("prompt,answer\n1+1=,2\n")
    message = _error(tmp_path / "d.csv")
    assert "'.csv'" in message and ".jsonl" in message and ".parquet" in message


def test_invalid_json_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": \n')
    assert f"{path}:3: invalid JSON" in _error(path)


def test_a_record_that_is_not_an_object(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, ["1+1=", "2"]])
    assert f"{path}:2: a record must be a JSON object, got list" in _error(path)


def test_a_missing_field_names_it_and_lists_the_fields(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1=", "target": "2"}])
    message = _error(path)
    assert f"{path}:1:" in message and "'prompt'" in message and "question, target" in message
    message = _error(path, prompt_field="question")
    assert f"{path}:1:" in message and "'answer'" in message and "answer_field" in message


def test_a_missing_column_in_parquet_names_the_row(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "solution": "2"}]), tmp_path / "d.parquet")
    message = _error(tmp_path / "d.parquet")
    assert f"{tmp_path / 'd.parquet'} row 0" in message and "'answer'" in message and "prompt, solution" in message


@pytest.mark.parametrize("prompt", [7, None, [], [{"role": "user"}], [{"role": "user", "content": ["x"]}], {"a": 1}])
def test_a_prompt_that_is_neither_text_nor_messages(tmp_path, prompt):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": prompt, "answer": "2"}])
    message = _error(path)
    assert f"{path}:2:" in message and "'prompt'" in message and "messages" in message


@pytest.mark.parametrize("answer", [None, True, [2], {"v": 2}])
def test_an_answer_that_is_neither_text_nor_number(tmp_path, answer):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": answer}])
    assert f"{path}:1: field 'answer' must be a string or a number" in _error(path)


def test_empty_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n  \n")
    assert f"{path}: no records" in _error(path)
    pq.write_table(pa.Table.from_pylist([], schema=pa.schema([("prompt", pa.string())])), tmp_path / "e.parquet")
    assert "no records" in _error(tmp_path / "e.parquet")


def test_empty_eval_and_train_sides(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _records(5))
    assert "none of its 5 records fell on the eval side" in _error(path, eval_fraction=1e-9)
    assert "all of its 5 records fell on the eval side" in _error(path, eval_fraction=1 - 1e-9)
    eval_path = _write_jsonl(tmp_path / "e.jsonl", _records(5))
    assert "no train records are left" in _error(path, eval_path=str(eval_path))


def test_verifier_that_fails_to_import(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _records(50))
    message = _error(path, verifier="no_such_module:score")
    assert "'no_such_module:score'" in message


def test_numeric_verifier_checks_gold_answers_at_load(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "q", "answer": "n/a"}])
    assert f"{path}:2: field 'answer'" in _error(path, verifier="numeric")


def test_a_dataset_dict_directory_points_at_a_split(tmp_path):
    root = tmp_path / "dd"
    _write_saved_dataset(root / "train", _records(10))
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    message = _error(root)
    assert "DatasetDict" in message and "train, test" in message and str(root / "train") in message


def test_saved_dataset_state_json_problems(tmp_path):
    path = _write_saved_dataset(tmp_path / "saved", _records(10))
    state = json.loads((path / "state.json").read_text())
    state["_data_files"] = [{"filename": "../elsewhere.arrow"}]
    (path / "state.json").write_text(json.dumps(state))
    assert "not a plain file name" in _error(path)
    state["_data_files"] = [{"filename": "data-00009-of-00010.arrow"}]
    (path / "state.json").write_text(json.dumps(state))
    assert "data-00009-of-00010.arrow" in _error(path)
    (tmp_path / "empty").mkdir()
    assert "save_to_disk" in _error(tmp_path / "empty")


# -- the split ----------------------------------------------------------------------------
def test_split_is_reproducible_disjoint_by_prompt_and_near_the_fraction(tmp_path):
    records = _records(2000)
    records += [dict(r) for r in records[:300]]  # duplicate prompts: must land on one side
    path = _write_jsonl(tmp_path / "d.jsonl", records)
    task = _task(path, eval_fraction=0.2, eval_size=10_000)
    again = _task(path, eval_fraction=0.2, eval_size=10_000, seed=5)  # the seed does not move the split
    assert task.eval_problems() == again.eval_problems()
    train_prompts = {p.prompt for p in _epoch(task)}
    eval_prompts = [p.prompt for p in task.eval_problems()]
    assert len(eval_prompts) == len(set(eval_prompts))  # one eval problem per prompt
    assert not train_prompts & set(eval_prompts)
    assert train_prompts | set(eval_prompts) == {r["prompt"] for r in records}
    assert 300 <= len(eval_prompts) <= 500  # 20% of 2000 distinct prompts, give or take
    assert task.n_train + len(eval_prompts) + sum(
        1 for r in records[2000:] if r["prompt"] in set(eval_prompts)) == len(records)


def test_eval_size_keeps_the_first_in_file_order(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _records(2000))
    full = _task(path, eval_fraction=0.2, eval_size=10_000).eval_problems()
    capped = _task(path, eval_fraction=0.2, eval_size=25).eval_problems()
    assert capped == full[:25]
    rows = [int(p.problem_id.rsplit("-", 1)[1]) for p in full]
    assert rows == sorted(rows)


def test_eval_path_is_the_held_out_split_and_drops_overlapping_train_prompts(tmp_path):
    train_records = _records(100)
    eval_records = [{"prompt": "999+1=", "answer": "1000"}, train_records[10], train_records[20]]
    path = _write_jsonl(tmp_path / "train.jsonl", train_records)
    eval_path = _write_jsonl(tmp_path / "eval.jsonl", eval_records)
    task = _task(path, eval_path=str(eval_path), eval_size=2)
    assert [(p.problem_id, p.prompt) for p in task.eval_problems()] == [("data-eval-0", "999+1="),
                                                                       ("data-eval-1", train_records[10]["prompt"])]
    assert task.n_train == 98  # rows 10 and 20 appear in the eval file
    assert {p.problem_id for p in _epoch(task)} == {f"data-train-{i}" for i in range(100) if i not in (10, 20)}
    assert task.settings()["eval_data_sha256"] == hashlib.sha256(eval_path.read_bytes()).hexdigest()


# -- the train stream ---------------------------------------------------------------------
def test_train_stream_is_epochs_of_a_seeded_shuffle(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _records(500))
    task = _task(path, seed=3)
    n = task.n_train
    stream = [task.train_problem(i) for i in range(3 * n)]
    twin = _task(path, seed=3)
    assert stream == [twin.train_problem(i) for i in range(3 * n)]
    epochs = [stream[k * n:(k + 1) * n] for k in range(3)]
    assert all(sorted(p.problem_id for p in e) == sorted(p.problem_id for p in epochs[0]) for e in epochs)
    assert len({p.problem_id for p in epochs[0]}) == n
    assert epochs[0] != epochs[1]
    assert [task.train_problem(i) for i in (7 + n, 3, 7)] == [stream[7 + n], stream[3], stream[7]]  # random access
    other_seed = _task(path, seed=4)
    other = [other_seed.train_problem(i) for i in range(n)]
    assert other != epochs[0]
    with pytest.raises(ValueError):
        task.train_problem(-1)


# -- settings -----------------------------------------------------------------------------
def test_settings_carry_a_digest_of_the_data(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _records(300))
    settings = _task(path, verifier="numeric").settings()
    assert settings["data_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert settings["eval_data_sha256"] is None
    assert settings["verifier"] == "numeric" and settings["path"] == str(path) and settings["name"] == "dataset"
    records = _records(300)
    records[0]["answer"] = "1"
    _write_jsonl(path, records)
    assert _task(path, verifier="numeric").settings()["data_sha256"] != settings["data_sha256"]
    saved = _task(_write_saved_dataset(tmp_path / "saved", _records(300)))
    assert len(saved.settings()["data_sha256"]) == 64


# -- rewards ------------------------------------------------------------------------------
def test_reward_uses_the_verifier(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _records(300))
    task = _task(path)
    problem = task.train_problem(0)
    assert task.reward(problem, problem.answer + "<eos>") == 1.0
    assert task.reward(problem, problem.answer + "0") == 0.0
    custom = _task(path, verifier="tests.unit.custom_verifier:score")
    assert custom.reward(problem, f"it is {problem.answer}") == 0.5
    assert _task(path, verifier="tests.unit.custom_verifier:flag").reward(problem, problem.answer) == 1.0
    assert custom.verifier_errors == 0


@pytest.mark.parametrize(("spec", "expected"), [("boom", "raised RuntimeError: boom second line"),
                                                ("words", "not a finite number"), ("nan", "not a finite number")])
def test_a_failing_verifier_scores_zero_and_is_counted(tmp_path, spec, expected):
    task = _task(_write_jsonl(tmp_path / "d.jsonl", _records(300)), verifier=f"tests.unit.custom_verifier:{spec}")
    problem = task.train_problem(0)
    assert task.reward(problem, problem.answer) == 0.0
    assert task.reward(problem, "x") == 0.0
    assert task.verifier_errors == 2
    assert expected in task.last_verifier_error
    assert problem.problem_id in task.last_verifier_error
    assert "\n" not in task.last_verifier_error


# -- prompt encoding ----------------------------------------------------------------------
def _templated_tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_encode_prompt_with_a_chat_template(tmp_path):
    tok = _templated_tokenizer()
    task = _task(_write_jsonl(tmp_path / "d.jsonl", _records(300)))
    problem = task.train_problem(0)
    ids = task.encode_prompt(problem, tok)
    assert ids == tok(problem.prompt + " ", add_special_tokens=False)["input_ids"]
    assert ids[0] != tok.bos_token_id  # the template decides about BOS; this one writes none
    with_system = _task(tmp_path / "d.jsonl", system_prompt="1").encode_prompt(problem, tok)
    assert tok.decode(with_system) == f"(1){problem.prompt} "


def test_encode_prompt_of_chat_messages(tmp_path):
    tok = _templated_tokenizer()
    records = [{"prompt": [{"role": "system", "content": "0"}, {"role": "user", "content": f"{i}+1="}],
                "answer": str(i + 1)} for i in range(300)]
    path = _write_jsonl(tmp_path / "chat.jsonl", records)
    problem = _task(path).train_problem(0)
    user = problem.messages[1][1]
    assert tok.decode(_task(path).encode_prompt(problem, tok)) == f"(0){user} "
    # The data's own system message wins over system_prompt.
    assert tok.decode(_task(path, system_prompt="9").encode_prompt(problem, tok)) == f"(0){user} "
    # Without a template the contents are joined by newlines, with the tokenizer's BOS.
    plain = _task(path, chat_template="none").encode_prompt(problem, tok)
    assert plain == tok(f"0\n{user}", add_special_tokens=True)["input_ids"]


def test_encode_prompt_without_a_template_matches_arithmetic(tmp_path):
    tok = build_tokenizer()
    assert not getattr(tok, "chat_template", None)
    task = _task(_write_jsonl(tmp_path / "d.jsonl", _records(300)))
    problem = task.train_problem(0)
    expected = ArithmeticTask().encode_prompt(problem, tok)
    assert expected == tok(problem.prompt, add_special_tokens=True)["input_ids"]
    assert expected[0] == tok.bos_token_id
    assert task.encode_prompt(problem, tok) == expected
    assert _task(tmp_path / "d.jsonl", chat_template="none").encode_prompt(problem, _templated_tokenizer()) == expected
    with_system = _task(tmp_path / "d.jsonl", system_prompt="12").encode_prompt(problem, tok)
    assert with_system == tok(f"12\n{problem.prompt}", add_special_tokens=True)["input_ids"]


def test_arithmetic_encode_prompt_is_the_prompt_with_bos():
    tok = build_tokenizer()
    task = ArithmeticTask()
    problem = task.train_problem(0)
    ids = task.encode_prompt(problem, tok)
    assert isinstance(ids, list)
    assert ids == [tok.bos_token_id] + tok(problem.prompt, add_special_tokens=False)["input_ids"]


# -- the shipped example ------------------------------------------------------------------
def test_shipped_sums3_loads_and_scores(tmp_path):
    assert SUMS3.stat().st_size < 100_000
    task = _task(SUMS3, prompt_field="question", answer_field="target", verifier="numeric")
    problems = _epoch(task) + task.eval_problems()
    assert len(problems) == 2000 and len({p.prompt for p in problems}) == 2000
    assert 50 <= len(task.eval_problems()) <= 150
    for p in problems:
        assert set(p.prompt + p.answer) <= set(CHARS)
        a, op1, b, op2, c = p.prompt[:5]
        assert p.prompt[5:] == "="
        assert int(p.answer) == int(a) + (1 if op1 == "+" else -1) * int(b) + (1 if op2 == "+" else -1) * int(c)
        assert task.reward(p, p.answer) == 1.0
        assert task.reward(p, str(int(p.answer) + 1)) == 0.0
    assert any(p.answer.startswith("-") for p in problems)


def test_sums3_generator_reproduces_the_file(tmp_path):
    spec = importlib.util.spec_from_file_location("make_sums3", SUMS3.with_name("make_sums3.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(tmp_path / "out.jsonl")])
    assert (tmp_path / "out.jsonl").read_bytes() == SUMS3.read_bytes()


def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path):
    """JSON allows U+2028/U+2029/U+0085 unescaped inside strings; only "\\n" ends a JSONL record."""
    path = tmp_path / "seps.jsonl"
    records = [{"prompt": f"q{i}\u2028line two\u0085", "answer": str(i)} for i in range(60)]
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\r\n", encoding="utf-8")
    task = make_task("dataset", path=str(path), eval_fraction=0.2)
    problems = [task.train_problem(i) for i in range(task.n_train)] + task.eval_problems()
    assert sorted(p.prompt for p in problems) == sorted(r["prompt"] for r in records)
