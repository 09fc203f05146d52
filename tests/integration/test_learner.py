"""The learner against real servers: the max-delay boundary, malformed messages, resumable offsets."""

import json
import uuid
from pathlib import Path

import pytest

from heterorl.config_files import builtin_config
from pipeline.config import load_config
from pipeline.clients.topics import TopicWriter, ensure_topic
from pipeline.wire.rollout import Rollout
from pipeline.weights.store import current as current_pointer

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def crafted_group(tokenizer, version: int, tag: str) -> Rollout:
    prompt = tokenizer("12+34=", add_special_tokens=True)["input_ids"]
    right = tokenizer("46", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    wrong = tokenizer("47", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Rollout(prompt_id=tag, task="arithmetic", sampler_id="test", policy_version=version,
                   prompt_ids=prompt, completion_ids=[right, wrong, wrong, right],
                   sampler_logps=[[-1.0] * len(right), [-2.0] * len(wrong), [-2.5] * len(wrong), [-0.5] * len(right)],
                   rewards=[1.0, 0.0, 0.0, 1.0], sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                                           "max_new_tokens": 4})


UNSIGNED = ["security.require_signatures=false", "security.rescore_rewards=false", "security.check_logprobs=false"]
"""These tests craft their own unsigned groups (made-up prompts, log-probs) and checkpoints: the
checks of signatures and content are tests/*/test_trust.py's and test_screening.py's."""


def test_drop_rule_at_the_boundary_and_malformed_messages(local_stack_env, tmp_path):
    from consumers.learner import run_learner
    from pipeline.models.tiny import build_tokenizer
    from pipeline.runtime import connect_run

    run = f"boundary-{uuid.uuid4().hex[:6]}"
    cfg = load_config(builtin_config("smoke"), [
        f"run.name={run}", "learner.max_delay_steps=1", "learner.groups_per_step=1", "learner.max_steps=3",
        f"services.data_dir={tmp_path / 'data'}", *UNSIGNED])
    tok = build_tokenizer()
    ensure_topic(local_stack_env.kafka_bootstrap, cfg.run.topic)
    sink = TopicWriter(local_stack_env.kafka_bootstrap, cfg.run.topic)
    # Learner versions when each is read: 0, 1, 2, 2, 2 (it steps after every kept group).
    first = crafted_group(tok, 0, "tau0")
    sink.send(first)                                # τ = 0      -> used, learner v1
    sink.send(crafted_group(tok, 0, "tau1"))        # τ = 1 = max -> used, learner v2
    sink.send(crafted_group(tok, 0, "tau2"))        # τ = 2 = max+1 -> dropped
    sink.send_raw(b"\x00definitely not msgpack")    # malformed -> counted, skipped
    sink.send(crafted_group(tok, 2, "fresh"))       # τ = 0      -> used, learner v3 = max_steps
    sink.close()

    assert run_learner(cfg, tmp_path / "run") == 0

    summary = json.loads((tmp_path / "run" / "learner_summary.json").read_text())
    assert summary["groups_consumed"] == 5
    assert summary["groups_used"] == 3
    assert summary["groups_dropped"] == 1
    assert summary["dropped_by_reason"] == {"too_stale_steps": 1}
    assert summary["malformed"] == 1
    assert summary["max_staleness_used"] == 1
    assert summary["offsets"] == {"0": 5}
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["staleness_max"] for s in steps if s["kind"] == "learner"] == [0, 1, 0]

    handles = connect_run(cfg)
    version, manifest_key = current_pointer(handles.state)
    assert version == 3
    # Every version is published or, when a newer one came while it waited, skipped (the
    # publisher is still starting while these tiny steps are taken); the first and last never are.
    published = handles.store.list_versions()  # keep_checkpoints = 3, plus the base v0
    assert published[0] == 0 and published[-1] == 3
    assert sorted(published[1:] + summary["versions_skipped"]) == [1, 2, 3]
    described = {v: handles.store.read_manifest(handles.store.manifest_key(v)).extra["weights"] for v in published}
    # fp32 weights under Adam change almost everywhere: a delta is ~70 % of a full copy here, so
    # a keyframe comes whenever the chain would outweigh one (bf16 deltas: docs/weights.md); a
    # delta is against the version published before it; the last version is a keyframe.
    assert described[0]["kind"] == "keyframe" and described[3]["kind"] == "keyframe"
    assert all(described[v]["base_version"] == before for before, v in zip(published, published[1:])
               if described[v]["kind"] == "delta")
    # The recovery state (written at the end: state_every_steps is 10) holds what a restarted
    # learner needs; no policy version carries any of it.
    from pipeline.weights.recovery import latest_state, recovery_store
    states = recovery_store(handles.store)
    state = latest_state(states)
    assert states.list_versions() == [3] and state.extra["policy_version"] == 3 and state.extra["step"] == 3
    assert state.extra["offsets"] == {"0": 5}  # a restarted learner resumes after everything it consumed
    assert sorted(f["path"] for f in state.files if f["path"].startswith("learner_state/")) == [
        "learner_state/optimizer.safetensors", "learner_state/state.json"]
    files = [f["path"] for v in handles.store.list_versions()
             for f in handles.store.read_manifest(handles.store.manifest_key(v)).files]
    assert not [f for f in files if f.startswith("learner_state/")]
    # No pickle in anything published: the learner state is safetensors and JSON.
    assert not [f for f in files + [f["path"] for f in state.files] if f.endswith((".pt", ".pth", ".bin", ".pkl"))]

    # The update log accounts for every offset once: used in a step, dropped, or set aside.
    from pipeline.records.update_log import read_entries_file, read_update_log
    entries = read_entries_file(tmp_path / "run" / "updates.jsonl")
    assert entries == read_update_log(local_stack_env.kafka_bootstrap, cfg.run.topic, None).entries
    assert [(e.step, [(g.offset, g.staleness, g.weight) for g in e.used]) for e in entries] == [
        (1, [(0, 0, 1.0)]), (2, [(1, 1, 1.0)]), (3, [(4, 0, 1.0)])]
    assert [(d.offset, d.staleness, d.reason) for d in entries[2].dropped] == [(2, 2, "too_stale_steps")]
    assert [m.offset for m in entries[2].malformed] == [3]
    assert entries[0].used[0].rollout_id == first.rollout_id
    assert {e.topic for e in entries} == {cfg.run.topic}

    # The poison message was set aside on the dead-letter topic: where it is, its size, hash and reason.
    import hashlib
    from pipeline.clients.topics import read_topic
    from pipeline.records.dead_letters import read_dead_letters
    dead = read_dead_letters(local_stack_env.kafka_bootstrap, cfg.run.topic, None)
    poison = b"\x00definitely not msgpack"
    assert [(d.source_topic, d.partition, d.offset, d.size, d.sha256) for d in dead.letters] == [
        (cfg.run.topic, 0, 3, len(poison), hashlib.sha256(poison).hexdigest())]
    assert dead.letters[0].reason.startswith("not msgpack") and not dead.refused

    # A learner killed after publishing v4 but before its next recovery state: its v4 and its
    # logged step 4 are lost. The restarted learner resumes from the state of step 3 at offset 5,
    # publishes those weights as v5 (v4 is never reused), and reads only what came after.
    from pipeline.records.update_log import UpdateEntry
    from pipeline.weights.policy import PolicyWriter, fetch_policy
    orphan, _, _ = fetch_policy(handles.store, manifest_key, tmp_path / "orphan")
    PolicyWriter(handles.store).write(4, orphan, {"step": 4}, parent_version=3)
    lost = UpdateEntry(step=4, policy_version=4, loss_type="gepo", time=0.0, attempt="killed", topic=cfg.run.topic)
    from pipeline.records.update_log import updates_topic
    log_sink = TopicWriter(local_stack_env.kafka_bootstrap, updates_topic(cfg.run.topic))
    log_sink.send_raw(lost.to_json().encode(), key=b"4")
    log_sink.close()
    sink = TopicWriter(local_stack_env.kafka_bootstrap, cfg.run.topic)
    sink.send(crafted_group(tok, 5, "after-restart-1"))
    sink.send(first)  # a producer retry's second copy, arriving after the checkpoint: ignored
    too_long = crafted_group(tok, 5, "too-long")
    too_long.completion_ids[0] = too_long.completion_ids[0] * 3  # past sampler.max_new_tokens = 4
    too_long.sampler_logps[0] = too_long.sampler_logps[0] * 3
    sink.send(too_long)  # poison: dead-lettered
    sink.send(crafted_group(tok, 5, "after-restart-2"))
    sink.close()
    cfg = load_config(builtin_config("smoke"), [
        f"run.name={run}", "learner.max_delay_steps=1", "learner.groups_per_step=1", "learner.max_steps=5",
        f"services.data_dir={tmp_path / 'data'}", *UNSIGNED])
    assert run_learner(cfg, tmp_path / "run2") == 0
    resumed = json.loads((tmp_path / "run2" / "learner_summary.json").read_text())
    assert resumed["start_policy_version"] == 5 and resumed["final_policy_version"] == 7
    assert resumed["final_step"] == 5
    assert resumed["groups_consumed"] == 4 and resumed["groups_used"] == 2
    assert resumed["duplicates_ignored"] == 1 and resumed["malformed"] == 1
    assert resumed["offsets"] == {"0": 9}
    dead = read_dead_letters(local_stack_env.kafka_bootstrap, cfg.run.topic, None)
    assert "exceeds sampler.max_new_tokens" in dead.letters[-1].reason
    assert current_pointer(handles.state)[0] == 7
    assert handles.store.read_manifest(handles.store.manifest_key(5)).parent_version == 3
    from pipeline.weights.policy import KEYFRAME, link_of
    # the resumed learner's first version starts a chain of its own: a keyframe, never skipped
    assert link_of(handles.store.read_manifest(handles.store.manifest_key(5))).kind == KEYFRAME
    after = [v for v in handles.store.list_versions() if v > 5]  # v6 may have been overtaken by v7
    assert after[-1] == 7 and all(handles.store.read_manifest(handles.store.manifest_key(v)).parent_version == v - 1
                                  for v in after)
    # The effective log: steps 1-5 once each, the lost step 4 replaced by the redone one.
    log = read_update_log(local_stack_env.kafka_bootstrap, cfg.run.topic, None).entries
    assert [(e.step, e.policy_version) for e in log] == [(1, 1), (2, 2), (3, 3), (4, 6), (5, 7)]
    assert [g.staleness for e in log[3:] for g in e.used] == [0, 1]  # v5's groups, at learner v5 then v6

    # The restart carried the optimizer state on: replaying the five logged steps from v0
    # in one go gives the weights `heterorl weights fetch` rebuilds from v7's deltas.
    from safetensors.torch import load_file

    from consumers.replay import run_replay
    replay = run_replay(cfg, f"kafka://{local_stack_env.kafka_bootstrap}/{cfg.run.topic}",
                        handles.store.uri(0), tmp_path / "replay", exact_batches=True, progress=False)
    final, manifest, report = fetch_policy(handles.store, handles.store.manifest_key(7), tmp_path / "v7")
    assert report.path[0] >= 5 and report.path[-1] == 7  # the rewind started a new chain: v5 is a keyframe
    a = load_file(str(final / "model.safetensors"))
    b = load_file(str(Path(replay["final_checkpoint"]) / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
