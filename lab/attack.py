"""`heterorl attack`: a training run with honest samplers and one adversary of each kind,
then an audit of what the defences did (docs/security.md).

The run gets a local stack of its own (in OUT/data), keys the run mints for its honest
samplers, one invite (OUT/invite.txt) with which every adversarial sampler joins as a stranger
does (`heterorl join`: a key of its own, admitted by the learner; OUT/adversaries/KIND holds
it), and `minutes` of training. Then the samplers stop, the learner drains, and
OUT/attack_audit.json says:

- `forged_used_in_updates`: used groups from an adversary, or copies the replayer sent
  (target 0);
- per adversary: groups it produced, groups used, and for those the learner can attribute
  (a valid signature on bad data), whether and after how many of its groups it was
  quarantined (target: within 20; the log-prob forger within 2 of its groups of
  staleness 0, the fresh data checked against the learner's own weights);
- honest samplers quarantined (target: none);
- per adversarial sampler, the key it signed with: admitted under the attack's invite, never
  the run's own (target: every one);
- the checkpoints the tamperer rewrote and how often samplers refused them;
- held-out accuracy before and after (it should still rise);
- with `--validators K` (the checks done by K validators, docs/security.md "Validators"):
  the forged verdicts the `VerdictForger` sent, by kind, and the learner's refusals of
  them (target: every one refused, none let a group in);
- `stranger`: the holder of an invite of its own (OUT/stranger-invite.txt) tries, with its
  credentials alone, every row of issue 77's table against the servers (`lab.stranger`), and is
  revoked at `STRANGER_REVOKED_AT` of the run (target: no row accepted; Kafka, Redis and S3 all
  refuse it within 30 s of the revocation). `--no-stranger` leaves it out (a baseline for the
  honest samplers' pace).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from lab.adversaries import (FORGED_VERDICT_REFUSALS, SAMPLER_KINDS, ManifestTamperer, Replayer, VerdictForger,
                             forgeries_in_topic, message_digest, prober_record)
from lab.stranger import Stranger
from heterorl.invites import join_home, make_run_invite, revoke_invite, write_invite_file
from heterorl.keys import provision_local, run_registry
from heterorl.processes import Processes, child_env
from heterorl.stack import as_role, services_for_run, with_services
from consumers.screening import forged_used_bound
from pipeline.clients.topics import read_topic
from pipeline.records.audit import audit_topic
from pipeline.records.update_log import read_update_log
from pipeline.config import HeteroConfig, dump_config
from pipeline.trust.invites import read_invite
from pipeline.trust.keyring import init_keys, key_paths, trusted_learner
from pipeline.trust.verdicts import verdicts_topic
from pipeline.runtime import (connect_run, evaluate_base, evaluate_final_state, make_task_from_config,
                              resolve_base_model, setup_logging)
from pipeline.weights.store import PolicyPointer, current as current_pointer

QUARANTINE_WITHIN = 20
"""Groups within which each attributable adversary must be quarantined."""
FRESH_WITHIN = {"noisy_logprobs": 2}
"""Groups of staleness 0 (checked against the learner's own weights every time) within which
these must be quarantined; their stale groups are only checked at
`security.stale_check_fraction`."""
UNATTRIBUTABLE = {"bad_signature", "replay", "tampered_manifest"}
"""Adversaries whose messages prove nothing about who sent them: refused one by one, never quarantined."""
PROBES = {"stale_prober"}
"""Adversaries honest at first: their used groups are not all forged (`_prober` counts those)."""
INVITE_HOURS = 1.0
"""How long the adversaries' invite admits new keys: they ask as the attack starts."""
STRANGER_REVOKED_AT = 0.6
"""When, as a share of the run, the operator revokes the stranger's invite."""
ATTACKER_STOP_S = 60.0
"""How long the attack waits for an attacker's current pass to end before the learner drains
(a pass reads the topics, which takes longer as they grow; the verdict forger stops mid-pass)."""


def run_attack(cfg: HeteroConfig, out: Path, minutes: float, honest: int, validators: int = 0,
               stranger: bool = True) -> int:
    log = setup_logging("attack")
    started = time.time()
    run_name = f"{cfg.run.name}-attack-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    base = resolve_base_model(cfg).resolve()  # from the usual model cache, before the data dir moves to OUT
    task = make_task_from_config(cfg)
    cfg = cfg.model_copy(update={
        "run": cfg.run.model_copy(update={"name": run_name, "rollout_topic": None}),
        "services": cfg.services.model_copy(update={"data_dir": str(out / "data"), "kafka_bootstrap": None,
                                                    "redis_url": None, "s3_endpoint": None}),
        "learner": cfg.learner.model_copy(update={"max_steps": 10**9}),
        "model": cfg.model.model_copy(update={"base": str(base)}),
        "validators": cfg.validators.model_copy(update={"enabled": validators > 0}),
        # An audit: the honest samplers' groups are checked too, so that "0 honest quarantined"
        # measures the checks' false alarms (their keys are the run's own, trusted otherwise).
        "security": cfg.security.model_copy(update={"trust_local_samplers": False}),
    })
    if validators > cfg.run.topic_partitions:  # one partition each, so that every validator works
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"topic_partitions": validators})})
    with services_for_run(cfg, keep=False) as (cfg, services, _):
        init_keys(key_paths(cfg))
        handles = connect_run(cfg)
        honest_ids = [f"{run_name}-s{i}" for i in range(honest)]
        adversary_ids = {kind: f"{run_name}-adv-{kind}" for kind in SAMPLER_KINDS}
        validator_ids = [f"{run_name}-v{i}" for i in range(validators)]
        provision_local(cfg, handles.state.client, honest_ids, validator_ids)
        # The adversaries are strangers: one invite for all of them, each joining with a key of its own.
        sampler_cfg = with_services(cfg, as_role(services, cfg.services.data_dir, "sampler"))
        invite_text, grant, _ = make_run_invite(cfg, sampler_cfg, len(adversary_ids), INVITE_HOURS)
        invite_file, homes = out / "invite.txt", {kind: out / "adversaries" / kind for kind in adversary_ids}
        write_invite_file(invite_file, invite_text)
        before = evaluate_base(cfg, base, task)
        log.info("held-out accuracy before: %.3f", before["accuracy_sampled"])
        config_file = out / "config.yaml"
        config_file.write_text(dump_config(cfg))
        procs = Processes(out, child_env(as_role(services, cfg.services.data_dir, "sampler")))
        common = ["--config", str(config_file), "--data-dir", cfg.services.data_dir]
        replayer = Replayer(services.kafka_bootstrap, cfg.run.topic, seed=cfg.run.seed)
        tamperer = ManifestTamperer(handles.store, handles.state, every_s=min(10.0, minutes * 60 / 8))
        forger = (VerdictForger(services.kafka_bootstrap, cfg.run.topic, run_name, set(adversary_ids.values()),
                                join_home(homes["forged_rewards"], read_invite(invite_text)) / "sampler.key")
                  if validators else None)
        intruder = _stranger(cfg, sampler_cfg, out, honest_ids[0], handles.state.client, minutes) if stranger else None
        attackers = [a for a in (replayer, tamperer, forger, intruder) if a is not None]
        try:
            procs.start("learner", ["learner", *common, "--out", str(out)],
                        env=child_env(as_role(services, cfg.services.data_dir, "learner")))
            for i, sampler_id in enumerate(honest_ids):
                procs.start(f"sampler-{i}", ["sampler", *common, "--id", sampler_id])
            for kind, sampler_id in adversary_ids.items():
                procs.start(f"adversary-{kind}", ["adversary", kind, "--invite", str(invite_file),
                                                  "--home", str(homes[kind]), "--id", sampler_id])
            validator_env = child_env(as_role(services, cfg.services.data_dir, "validator"))
            for i, validator_id in enumerate(validator_ids):
                procs.start(f"validator-{i}", ["validator", *common, "--id", validator_id], env=validator_env)
            for attacker in attackers:
                attacker.start()
            _wait(procs, handles.state, minutes * 60)
            log.info("stopping samplers and attackers, then draining the learner")
            for attacker in attackers:
                attacker.stopped.set()
            for attacker in attackers:  # nothing forged may arrive after the learner has drained
                attacker.join(timeout=ATTACKER_STOP_S)
                if attacker.is_alive():
                    log.warning("attacker %s still running after %.0fs: what it sends after the drain goes "
                                "unread, and the audit may count it as not refused", attacker.name, ATTACKER_STOP_S)
            procs.stop([n for n in procs.procs if n != "learner" and not n.startswith("validator")], grace_s=120.0)
            _drain(procs)  # the validators judge what the learner still reads
        finally:
            for attacker in attackers:
                attacker.stopped.set()
            procs.stop()
        version, _ = current_pointer(handles.state)
        # The learner's last weights (and the offsets and verdicts it reached), from its final
        # recovery state: whole, whatever an attacker did to the chain of deltas before them.
        after, final_state = evaluate_final_state(cfg, handles.store, out / "final_weights", task)
        reports = handles.state.sampler_stats()
        prober = adversary_ids["stale_prober"]  # honest at first: its forged groups are counted by rollout id
        data = audit_topic(services.kafka_bootstrap, cfg.run.topic, final_state.extra, trusted_learner(cfg), reports,
                           honest_sampler_ids=set(honest_ids) | {prober}, forged_messages=frozenset(replayer.copies))
        update_log = read_update_log(services.kafka_bootstrap, cfg.run.topic, trusted_learner(cfg))
        used_ids = {g.rollout_id for e in (update_log.entries if update_log else []) for g in e.used}
        learner_summary = json.loads((out / "learner_summary.json").read_text())
        audit = _audit(data, handles.state.quarantines(), honest_ids, adversary_ids, replayer, tamperer, reports,
                       validators)
        probed = audit["adversaries"]["stale_prober"]
        record = prober_record(join_home(homes["stale_prober"], read_invite(invite_text)))
        forged = json.loads(record.read_text()) if record.exists() else {}
        probed.update(_prober(forged, used_ids, cfg.security, probed["groups_read_before_quarantine"]))
        keys = _adversary_keys(cfg, handles.state.client, adversary_ids, grant.grant_id)
        for kind, held in keys.items():  # beside what each did: the key it did it with
            audit["adversaries"][kind].update(held)
        audit.update(_key_findings(keys, adversary_ids))
        audit["targets_met"] = (audit["targets_met"] and probed["target_met"]
                                and not audit["adversary_keys_local"] and not audit["adversaries_not_joined"])
        if forger is not None:
            in_topic = Counter(message_digest(r.value)
                               for r in read_topic(services.kafka_bootstrap, verdicts_topic(cfg.run.topic), timeout_s=30.0))
            audit["adversaries"]["forged_verdicts"] = _forged_verdicts(forger, learner_summary.get("verdicts", {}),
                                                                       in_topic)
            audit["targets_met"] = audit["targets_met"] and audit["adversaries"]["forged_verdicts"]["target_met"]
        if intruder is not None:
            audit["stranger"] = intruder.report()
            audit["targets_met"] = audit["targets_met"] and audit["stranger"]["target_met"]
        audit.update(honest_pace=_honest_pace(data, honest_ids, minutes))
        audit.update(run=run_name, minutes=minutes, honest_samplers=honest, validators=validators,
                     invite=grant.grant_id,
                     final_policy_version=version,
                     eval_accuracy_before=before["accuracy_sampled"], eval_accuracy_after=after["accuracy_sampled"],
                     eval_greedy_before=before["accuracy_greedy"], eval_greedy_after=after["accuracy_greedy"],
                     learner_checks=learner_summary.get("checks"), learner_verdicts=learner_summary.get("verdicts"),
                     validator_checks={v: stats.get("checks") for v, stats in handles.state.validator_stats().items()},
                     wall_seconds=round(time.time() - started, 1))
    (out / "attack_audit.json").write_text(json.dumps(audit, indent=2))
    print(_report(audit, out))
    return 0 if audit["targets_met"] else 1


def _stranger(cfg: HeteroConfig, sampler_cfg: HeteroConfig, out: Path, honest_id: str, admin_redis,
              minutes: float) -> Stranger:
    """The stranger, with an invite of its own (one join), which the operator revokes during the run."""
    text, grant, _ = make_run_invite(cfg, sampler_cfg, 1, INVITE_HOURS)
    write_invite_file(out / "stranger-invite.txt", text)
    return Stranger(read_invite(text).services, cfg.run.name, cfg.run.topic, honest_id,
                    revoke=lambda: revoke_invite(cfg, admin_redis, grant.grant_id),
                    revoke_after_s=STRANGER_REVOKED_AT * minutes * 60, every_s=min(20.0, minutes * 60 / 6))


def _honest_pace(data: dict, honest_ids: list[str], minutes: float) -> dict:
    """The honest samplers' groups produced per minute of the attack (compare a run `--no-stranger`)."""
    produced = sum(data.get("by_sampler", {}).get(i, {}).get("produced", 0) for i in honest_ids)
    return {"groups": produced, "groups_per_min": round(produced / max(minutes, 1e-9), 2)}


def _key_findings(keys: dict[str, dict], adversary_ids: dict[str, str]) -> dict[str, list[str]]:
    """The adversaries (by sampler id) with a key marked the run's own, and those not admitted
    under the attack's invite: both must be empty (`_adversary_keys` gives `keys`)."""
    return {"adversary_keys_local": sorted(adversary_ids[k] for k, held in keys.items()
                                           if any(key["local"] for key in held["keys"])),
            "adversaries_not_joined": sorted(adversary_ids[k] for k, held in keys.items()
                                             if not held["joined_with_invite"])}


def _adversary_keys(cfg: HeteroConfig, client, adversary_ids: dict[str, str], invite_id: str) -> dict[str, dict]:
    """Per adversary, the keys its sampler id holds in the registry every role reads (the root's
    and the learner's admissions): each key's id, the invite it joined with (None: the root key
    registered it) and whether it is marked the run's own. Target: one key, admitted under the
    attack's invite, not local. The attack checks every key as a stranger's
    (`trust_local_samplers` off), so without this a registry that wrongly trusted an adversary
    would still pass the rest of the audit."""
    registry = run_registry(cfg, client)
    held = {}
    for kind, sampler_id in adversary_ids.items():
        keys = keys_of(registry, sampler_id)
        held[kind] = {"keys": keys, "joined_with_invite": joined_as_stranger(keys, invite_id)}
    return held


def keys_of(registry, sampler_id: str) -> list[dict]:
    """The keys `sampler_id` holds in the run's registry: each one's id, the invite it joined with
    (None: the root key registered it) and whether it is marked the run's own."""
    return [{"key_id": e.key_id, "invite": e.grant or None, "local": e.local}
            for e in registry.keys.values() if e.sampler_id == sampler_id]


def joined_as_stranger(keys: list[dict], invite_id: str) -> bool:
    """One key, admitted under the invite `invite_id`, not the run's own (its groups are checked)."""
    return len(keys) == 1 and keys[0]["invite"] == invite_id and not keys[0]["local"]


def _prober(report: dict, used_ids: set[str], security, read_before_quarantine: Optional[int] = None) -> dict:
    """The stale prober's forged groups used, against the bound its draws allow: each forged
    stale group is checked on its own with probability `stale_check_fraction`, so fewer than
    `forged_used_bound` are used but with probability 1e-4 (consumers/screening.py). Met if it
    forged (it got past probation) and no more than the bound were used.

    `read_before_quarantine`: the groups of its key the learner read before quarantining it;
    less the honest ones it made first, the forged groups that met the draw (the rest came after
    the quarantine, refused whatever their draw). A quarantine cuts a flood short after a few
    forged groups, so this audit holds the bound without showing what a draw that could be
    learned would have let through: tests/unit/test_screening.py floods both side by side."""
    forged = set(report.get("forged_rollout_ids") or [])
    bound = forged_used_bound(security.stale_check_fraction, security.strikes_to_quarantine)
    used = len(forged & used_ids)
    honest = report.get("honest_groups_made")
    met_the_draw = (None if read_before_quarantine is None or honest is None
                    else max(0, read_before_quarantine - honest))
    return {"forged_sent": len(forged), "forged_read_before_quarantine": met_the_draw, "forged_used": used,
            "forged_used_bound": bound, "probes": report.get("probes"), "floods": report.get("floods"),
            "flooded_groups": report.get("flooded_groups"), "target_met": bool(forged) and used <= bound}


def _wait(procs: Processes, state, seconds: float) -> None:
    t0 = time.monotonic()
    bar = tqdm(total=int(seconds), desc="attack", unit="s", file=sys.stderr, disable=None, mininterval=2)
    try:
        while time.monotonic() - t0 < seconds:
            learner = procs.procs["learner"]
            if learner.poll() is not None:
                raise procs.failure("learner", f"learner exited with {learner.returncode}")
            bar.update(int(time.monotonic() - t0) - bar.n)
            bar.set_postfix_str(f"v{PolicyPointer(state).version()} quarantined {len(state.quarantines())}")
            time.sleep(1.0)
    finally:
        bar.close()


def _drain(procs: Processes, timeout_s: float = 600.0) -> None:
    learner = procs.procs["learner"]
    learner.send_signal(signal.SIGUSR1)
    try:
        learner.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise procs.failure("learner", f"the learner did not finish draining within {timeout_s:.0f}s") from None
    if learner.returncode != 0:
        raise procs.failure("learner", f"learner exited with {learner.returncode} while draining")


def _audit(data: dict, quarantines: dict, honest_ids: list[str], adversary_ids: dict[str, str], replayer: Replayer,
           tamperer: ManifestTamperer, reports: dict, validators: int = 0) -> dict:
    """The audit's numbers and targets. With validators the quarantine counts are of the groups
    whose verdicts the learner applied (it reads groups ahead of their verdicts); without, of the
    groups it read (it checks them as it reads them)."""
    seen, fresh = ("groups_judged", "fresh_groups_judged") if validators else ("groups_seen", "fresh_groups_seen")
    by_sampler = data.get("by_sampler", {})
    quarantined_by_sampler = {q["sampler_id"]: q for q in quarantines.values()}
    adversaries = {}
    for kind, sampler_id in adversary_ids.items():
        row = by_sampler.get(sampler_id, {"produced": 0, "used": 0})
        q = quarantined_by_sampler.get(sampler_id)
        in_time = q is not None and q[seen] <= QUARANTINE_WITHIN and (
            kind not in FRESH_WITHIN or q[fresh] <= FRESH_WITHIN[kind])
        adversaries[kind] = {
            "sampler_id": sampler_id, "groups_produced": row["produced"], "groups_used": row["used"],
            "quarantined": q is not None, "quarantined_after_groups": q.get(seen) if q else None,
            "quarantined_after_fresh_groups": q.get(fresh) if q else None,
            "groups_read_before_quarantine": q.get("groups_seen") if q else None,
            "reason": q.get("reason") if q else None,
            "quarantine_within": None if kind in UNATTRIBUTABLE else QUARANTINE_WITHIN,
            "quarantine_within_fresh": FRESH_WITHIN.get(kind),
            "target_met": row["used"] == 0 and (kind in UNATTRIBUTABLE or in_time),
        }
        if kind in PROBES:  # honest groups first, used rightly: judged by `_prober` on what it forged
            adversaries[kind].update(quarantine_within=None, target_met=True)
    adversaries["replay"] = {"copies_sent": len(replayer.copies), "copies_used": data["copies_used_in_updates"],
                             "target_met": bool(replayer.copies) and data["copies_used_in_updates"] == 0}
    refusals = sum(int(r.get("refused_checkpoints", 0)) + int(r.get("refused_pointers", 0))
                   for sid, r in reports.items() if sid in honest_ids)
    delta_paths = sum(int(r.get("refused_delta_paths", 0)) for sid, r in reports.items() if sid in honest_ids)
    adversaries["tampered_manifest"] = {"attacks": tamperer.actions, "honest_sampler_refusals": refusals,
                                        "honest_delta_paths_refused": delta_paths,
                                        "target_met": bool(tamperer.actions) and refusals > 0}
    honest_quarantined = sorted(s for s in quarantined_by_sampler if s in honest_ids)
    counts = {k: v for k, v in data.items() if k != "by_sampler"}
    # `lost` is not a target here: with this many producers on one partition Tansu 0.6 stores some
    # messages under an offset another already holds (`broker_offset_collisions`), and a
    # consumer never sees them (docs/faults.md); such a message cannot be used either.
    met = (data["forged_used_in_updates"] == 0 and data["used_twice"] == 0
           and not honest_quarantined and all(a["target_met"] for a in adversaries.values()))
    return {"targets_met": met, "forged_used_in_updates": data["forged_used_in_updates"],
            "honest_quarantined": honest_quarantined, "adversaries": adversaries,
            "honest": {s: by_sampler.get(s, {}) for s in honest_ids}, "accounting": counts,
            "quarantines": quarantines}


def _forged_verdicts(forger: VerdictForger, learner_verdicts: dict, in_topic: Counter) -> dict:
    """What the forger sent by kind, how many of those a reader of the verdicts topic finds
    (`in_topic`: its messages' digests; `forgeries_in_topic`), and the learner's refusals under
    the code each should get: met if every kind was sent and found in the topic, and the learner
    refused at least as many as were found under each code (a refusal it had not read before
    draining would be missing; a validator that re-sends a verdict after a broker error adds
    `replayed_verdict` refusals of its own). That none was let in is `forged_used_in_updates`.
    `errors`: the forger's failed steps by error type (a send the broker failed, a topic not
    created yet)."""
    refused = {kind: int(learner_verdicts.get(f"refused:{code}", 0)) for kind, code in FORGED_VERDICT_REFUSALS.items()}
    sent, found = forger.sent, forgeries_in_topic(forger.acknowledged, in_topic)
    return {"sent": sent, "in_topic": found, "refused_by_the_learner": refused,
            "errors": dict(forger.errors),
            "target_met": all(sent[k] > 0 and found[k] > 0 and refused[k] >= found[k]
                              for k in FORGED_VERDICT_REFUSALS)}


def _report(audit: dict, out: Path) -> str:
    lines = [f"\nattack {audit['run']}: forged groups used {audit['forged_used_in_updates']}, honest samplers "
             f"quarantined {len(audit['honest_quarantined'])}, held-out accuracy {audit['eval_accuracy_before']:.3f}"
             f" -> {audit['eval_accuracy_after']:.3f}; targets {'met' if audit['targets_met'] else 'MISSED'}"]
    for kind, a in audit["adversaries"].items():
        if "groups_produced" in a and kind not in PROBES:
            judged = " judged by validators" if audit.get("validators") else ""
            q = (f"quarantined after {a['quarantined_after_groups']} groups{judged}, "
                 f"{a['quarantined_after_fresh_groups']} of staleness 0 ({a['reason']})" if a["quarantined"]
                 else "every message refused, not attributable" if a["quarantine_within"] is None else "NOT quarantined")
            lines.append(f"  {kind:16} produced {a['groups_produced']:4}, used {a['groups_used']}, {q}")
    r = audit["adversaries"]["replay"]
    lines.append(f"  {'replay':16} {r['copies_sent']} copies re-sent, {r['copies_used']} used")
    t = audit["adversaries"]["tampered_manifest"]
    lines.append(f"  {'tampered_manifest':16} {len(t['attacks'])} attacks on S3/Redis, refused "
                 f"{t['honest_sampler_refusals']} times by honest samplers")
    p = audit["adversaries"]["stale_prober"]
    q = f"quarantined after {p['quarantined_after_groups']} groups ({p['reason']})" if p["quarantined"] else "not quarantined"
    lines.append(f"  {'stale_prober':16} produced {p['groups_produced']:4}, used {p['groups_used']} (honest through "
                 f"probation); forged {p.get('forged_sent')} after it ({p.get('probes')} probes, "
                 f"{p.get('flooded_groups')} groups more, {p.get('floods')} versions flooded after a probe was seen "
                 f"used; {p.get('forged_read_before_quarantine')} read before its quarantine), {p.get('forged_used')} "
                 f"used (bound {p.get('forged_used_bound')}); {q}")
    joined = sum(1 for a in audit["adversaries"].values() if a.get("joined_with_invite"))
    lines.append(f"  {joined} adversarial samplers joined with invite {audit['invite']}, each with a key of its own")
    if audit["adversaries_not_joined"]:
        lines.append(f"  NOT admitted under the invite: {', '.join(audit['adversaries_not_joined'])}")
    if audit["adversary_keys_local"]:
        lines.append(f"  adversary keys registered as the run's own: {', '.join(audit['adversary_keys_local'])}")
    v = audit["adversaries"].get("forged_verdicts")
    if v is not None:
        lines.append(f"  {'forged_verdicts':16} sent {v['sent']}, in the topic {v['in_topic']}, refused by the learner "
                     f"{v['refused_by_the_learner']}")
    st = audit.get("stranger")
    if st is not None:
        accepted = [row for row, r in st["rows"].items() if r["accepted"]]
        tried = sum(r["tried"] for r in st["rows"].values())
        lines.append(f"  {'stranger':16} {tried} attempts at the servers with an invite's credentials, rows accepted: "
                     f"{', '.join(accepted) or 'none'}; revoked: refused by {', '.join(sorted(st['revoked_after_s']))} "
                     f"after {max(st['revoked_after_s'].values(), default=float('nan')):.1f} s at most")
    lines.append(f"  honest samplers produced {audit['honest_pace']['groups']} groups "
                 f"({audit['honest_pace']['groups_per_min']}/min)")
    lines.append(f"audit: {out}/attack_audit.json")
    return "\n".join(lines)

