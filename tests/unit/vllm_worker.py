"""Runs a VllmEngine in a process of its own for the vLLM tests (tests/unit/test_generation.py,
tests/unit/test_real_model.py).

vLLM sets up torch.distributed and thread settings in the process that starts it; a fresh
process keeps them away from the DeepSpeed tests that share the pytest process.

    python -m tests.unit.vllm_worker SETTINGS_JSON MODEL_DIR [MODEL_DIR ...]

Installs each model directory in turn into one engine and samples PROMPTS after each
install (text, encoded with the tokenizer's special tokens, or lists of token ids, kept),
then prints one JSON object: the groups sampled after the last install (`groups`), after
each install (`groups_after`), and whether every install went into the same engine.

    python -m tests.unit.vllm_worker '{"runs": [SETTINGS_JSON + {"model_dirs": [...]}, ...]}'

runs several engines one after the other in this one process (vLLM's start-up is paid once)
and prints `{"runs": [one object as above per run]}`.
"""

import json
import sys
from pathlib import Path

import torch

from pipeline.sampling.generation import SamplingSettings, VllmEngine


def serve(spec: dict, model_dirs: list[str]) -> dict:
    engine = VllmEngine(SamplingSettings(**spec["settings"]), torch.device("cpu"),
                        precision=spec.get("precision", "fp32"), kv_cache_gib=0.25,
                        max_model_len=spec.get("max_model_len"))
    engines, groups_after = [], []
    for model_dir in model_dirs:
        engine.install(engine.prepare(Path(model_dir)))
        engines.append(id(engine.llm))
        prompts = [engine.tokenizer(p)["input_ids"] if isinstance(p, str) else p for p in spec["prompts"]]
        groups = engine.sample(prompts, group_size=spec["group_size"], seed=spec["seed"])
        groups_after.append([{"prompt_ids": g.prompt_ids, "completion_ids": g.completion_ids,
                              "sampler_logps": g.sampler_logps} for g in groups])
    out = {"same_engine": len(set(engines)) == 1, "eos": engine.tokenizer.eos_token_id,
           "groups": groups_after[-1], "groups_after": groups_after}
    engine.close()
    return out


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    if "runs" in spec:
        out = {"runs": [serve(run, run["model_dirs"]) for run in spec["runs"]]}
    else:
        out = serve(spec, argv[1:])
    print("VLLM_WORKER_RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
