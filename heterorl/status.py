"""`heterorl status`: where the servers are and what one run is doing. Never prints secrets."""

from __future__ import annotations

import time
from typing import Optional

from heterorl.stack import resolved_services
from pipeline.weights.store import CheckpointStore, PolicyPointer, connect_s3
from pipeline.config import load_config
from pipeline.clients.topics import end_offsets
from pipeline.clients.run_state import RunState, connect_redis, latest_run
from pipeline.clients.services import require_services


RECENTLY_GONE_S = 3600.0  # samplers whose lease ended within this window are listed as gone


def collect_status(data_dir: str, run: Optional[str] = None) -> dict:
    cfg = load_config(None, [f"services.data_dir={data_dir}"])
    services = resolved_services(cfg) or require_services(cfg.services)  # the latter names what is missing
    redis_client = connect_redis(services.redis_url, timeout_s=cfg.services.connect_timeout_s,
                                 security=services.security)
    run = run or latest_run(redis_client)
    status = {**services.public(), "local_stack": services.from_local_stack, "run": run,
              "rollout_topic": None, "policy_version": None, "checkpoints": [], "samplers": {},
              "expired_samplers": {}, "claims": {}, "learner": {}, "topic_end_offsets": {}, "quarantined": {},
              "validators": {}}
    if run is None:
        return status
    state = RunState(redis_client, run)
    meta = state.meta()
    status["rollout_topic"] = meta.get("rollout_topic", f"{run}.rollouts")
    status["policy_version"] = PolicyPointer(state).version()
    status["checkpoints"] = CheckpointStore(connect_s3(services), services.bucket, run).list_versions()
    status["samplers"] = state.live_samplers()
    status["expired_samplers"] = state.expired_samplers(within_s=RECENTLY_GONE_S)
    status["claims"] = state.claim_stats()
    status["learner"] = state.learner_progress()
    status["quarantined"] = state.quarantines()
    status["topic_end_offsets"] = end_offsets(services.kafka_bootstrap, status["rollout_topic"], security=services.security)
    holders = state.partition_holders(sorted(int(p) for p in status["topic_end_offsets"]))
    status["validators"] = {vid: {**info, "partitions": sorted(p for p, h in holders.items() if h == vid)}
                            for vid, info in state.live_validators().items()}
    return status


def format_status(s: dict) -> str:
    lines = [f"kafka      {s['kafka_bootstrap']}", f"redis      {s['redis_url']}",
             f"s3         {s['s3_endpoint']} (bucket {s['bucket']})"
             + ("  [local stack]" if s["local_stack"] else "")]
    if s["run"] is None:
        lines.append("run        (none yet)")
        return "\n".join(lines)
    logged = sum(s["topic_end_offsets"].values()) if s["topic_end_offsets"] else 0
    lines += [f"run        {s['run']}", f"topic      {s['rollout_topic']} ({logged} messages)",
              f"policy     v{s['policy_version']}",
              f"checkpoints {', '.join(f'v{v}' for v in s['checkpoints']) or '(none)'}"]
    learner = s["learner"]
    if learner:
        lines.append(f"learner    step {learner.get('step')} used {learner.get('groups_used')} "
                     f"dropped {learner.get('groups_dropped')} malformed {learner.get('malformed')}")
    lines += _sampler_lines(s)
    lines += _validator_lines(s.get("validators") or {})
    lines += _quarantine_lines(s.get("quarantined") or {})
    if s.get("claims"):
        lines.append(_claims_line(s["claims"]))
    return "\n".join(lines)


def _sampler_lines(s: dict, now: Optional[float] = None) -> list[str]:
    """Live samplers, then those gone recently: a crash (lease expired) reads differently
    from a clean stop (released), which is what an operator needs to know first."""
    now = time.time() if now is None else now
    gone = s.get("expired_samplers") or {}
    lines = [f"samplers   {len(s['samplers'])} live, {len(gone)} recently gone"]
    for sid, info in sorted(s["samplers"].items()):
        paused = f", paused {info['paused_s']}s" if info.get("paused_s") not in (None, "") else ""
        load = (f", weights loaded in {float(info['weight_load_s']):.2f}s"
                if info.get("weight_load_s") not in (None, "") else "")
        lines.append(f"  {sid}: v{info.get('policy_version')} groups {info.get('groups')} "
                     f"({info.get('rollouts_per_min')}/min{paused}) on {info.get('host')}, "
                     f"{info.get('backend') or '?'} backend{load}")
    for sid, info in sorted(gone.items(), key=lambda item: -(item[1].get("ended_at") or 0)):
        lines.append(f"  {sid}: gone {_ago(now, info.get('ended_at'))} ({_how_ended(info)}; last heartbeat "
                     f"{_ago(now, info.get('last_heartbeat_at'))}) v{info.get('policy_version')} "
                     f"groups {info.get('groups')} on {info.get('host')}")
    return lines


def _validator_lines(validators: dict) -> list[str]:
    """Live validators (docs/security.md "Validators") and the rollout partitions each checks."""
    if not validators:
        return []
    lines = [f"validators {len(validators)} live"]
    for vid, info in sorted(validators.items()):
        held = ", ".join(map(str, info.get("partitions") or [])) or "none yet"
        lines.append(f"  {vid}: checking partitions {held}")
    return lines


def _quarantine_lines(quarantined: dict) -> list[str]:
    """Sampler keys the learner stopped trusting, and why (pipeline.trust.StrikePolicy)."""
    if not quarantined:
        return []
    lines = [f"quarantined {len(quarantined)} sampler key(s): their rollouts are not used"]
    for key_id, q in sorted(quarantined.items(), key=lambda item: item[1].get("at", 0)):
        lines.append(f"  {q.get('sampler_id')} (key {key_id}): {q.get('reason')}; after {q.get('groups_seen')} "
                     f"of its groups, {q.get('dropped_in_flight')} in-flight dropped")
    return lines


def _how_ended(info: dict) -> str:
    if info.get("ended") == "released":
        return f"released: {info.get('release_reason') or 'stopped'}"
    return "expired: lease not renewed - crashed or cut off"


def _ago(now: float, then: Optional[float]) -> str:
    if then is None:
        return "? ago"
    seconds = max(0.0, now - float(then))
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def _claims_line(c: dict) -> str:
    epoch = f" (epoch {c['epoch']} of size {c['epoch_size']})" if c.get("epoch_size") else ""
    return (f"prompts    cursor {c['cursor']}{epoch}, outstanding {c['outstanding']}, "
            f"completed {c.get('completed', 0)}, reissue queue {c['reissue_queue']}, "
            f"reissued {c['reissued']}, late completions {c['late_completions']}")
