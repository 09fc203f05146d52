"""`heterorl status`: where the servers are and what one run is doing. Never prints secrets."""

from __future__ import annotations

from typing import Optional

from pipeline.config import load_config
from pipeline.services import require_services


def collect_status(data_dir: str, run: Optional[str] = None) -> dict:
    from pipeline.checkpoints import CheckpointStore, connect_s3
    from pipeline.kafka_io import end_offsets
    from pipeline.redis_state import RunState, connect_redis, latest_run

    cfg = load_config(None, [f"services.data_dir={data_dir}"])
    services = require_services(cfg.services)
    redis_client = connect_redis(services.redis_url, timeout_s=cfg.services.connect_timeout_s)
    run = run or latest_run(redis_client)
    status = {**services.public(), "local_stack": services.from_local_stack, "run": run,
              "rollout_topic": None, "policy_version": None, "checkpoints": [], "samplers": {},
              "learner": {}, "topic_end_offsets": {}}
    if run is None:
        return status
    state = RunState(redis_client, run)
    meta = state.meta()
    status["rollout_topic"] = meta.get("rollout_topic", f"{run}.rollouts")
    status["policy_version"] = state.policy_version()
    status["checkpoints"] = CheckpointStore(connect_s3(services), services.bucket, run).list_versions()
    status["samplers"] = state.live_samplers()
    status["learner"] = state.learner_progress()
    status["topic_end_offsets"] = end_offsets(services.kafka_bootstrap, status["rollout_topic"])
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
    lines.append(f"samplers   {len(s['samplers'])} live")
    for sid, info in sorted(s["samplers"].items()):
        lines.append(f"  {sid}: v{info.get('policy_version')} groups {info.get('groups')} "
                     f"({info.get('rollouts_per_min')}/min) on {info.get('host')}")
    return "\n".join(lines)
