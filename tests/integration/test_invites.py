"""`heterorl invite` and `heterorl join` against the real local stack: volunteers given only the
invite's line are admitted by the learner's `JoinDesk` (here on its own, standing for the
learner, which runs the same desk in `Intake.refresh_registry`), up to the invite's count; every
bad invite is one line and exit status 2 with nothing registered; and the sampler role's
credentials that the invite carries cannot write what the learner or the root key sign."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
import torch

from heterorl import invites
from heterorl.cli import main
from heterorl.invites import JoinProgress
from heterorl.keys import keys_list
from heterorl.stack import with_services
from infra.local_stack import stack_services
from pipeline.clients.run_state import RunState
from pipeline.config import load_config
from pipeline.trust.invites import make_join_request, read_invite
from pipeline.trust.keyring import (JoinDesk, RegistryFollower, init_keys, join_requests_key, key_paths, load_learner_key,
                                    load_root_public)
from pipeline.wire.signing import SigningKey

pytestmark = pytest.mark.integration


@pytest.fixture
def run(local_stack, tmp_path):
    """A run's keys, its config as the admin and as the sampler role, and a learner's join desk
    serving requests in a thread."""
    name = f"inv-{uuid.uuid4().hex[:8]}"
    cfg = with_services(load_config(None, [f"run.name={name}", f"security.keys_dir={tmp_path / 'keys'}",
                                           f"services.data_dir={tmp_path / 'stack'}"], env={}),
                        stack_services(local_stack, "admin"))
    paths = key_paths(cfg)
    init_keys(paths)
    admin = redis.Redis.from_url(stack_services(local_stack, "admin").redis_url, decode_responses=True)
    desk = JoinDesk(admin, name, load_root_public(paths), load_learner_key(paths), 30, logging.getLogger("test.invites"))
    follower = RegistryFollower(admin, name, load_root_public(paths), 0.1, logging.getLogger("test.invites"),
                                load_learner_key(paths).public)
    stop, paused = threading.Event(), threading.Event()

    def learner():
        while not stop.is_set():
            if paused.wait(0.1):
                continue
            follower.refresh(force=True)
            desk.serve(follower.registry, set(admin.hkeys(f"heterorl:{name}:quarantine")))
            time.sleep(0.1)

    thread = threading.Thread(target=learner, daemon=True)
    thread.start()
    yield type("Run", (), dict(cfg=cfg, sampler_cfg=with_services(cfg, stack_services(local_stack, "sampler")),
                               admin=admin, follower=follower, name=name, tmp=tmp_path,
                               paused=paused))
    stop.set()
    thread.join(5)


def make(run, joins=2, hours=1.0) -> str:
    text, _, _ = invites.make_run_invite(run.cfg, run.sampler_cfg, joins, hours)
    return text


def join(run, text, home, sampled, **kw) -> int:
    return invites.join(text, base=run.tmp / home, config_file=None, overrides=["sampler.max_groups=3"],
                        sampler_id=kw.get("sampler_id"), wait_s=kw.get("wait_s", 20),
                        run_sampler=lambda cfg, sampler_id, policy: sampled.append((cfg, sampler_id)) or 0)


def cli_join(run, text, home, capsys) -> tuple[int, str]:
    code = main(["join", text, "--home", str(run.tmp / home)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("heterorl join: error:")]
    return code, " | ".join(lines)


def test_volunteers_join_with_the_invite_alone_up_to_its_count(run, capsys):
    text, sampled = make(run, joins=2), []
    assert join(run, text, "host-a", sampled) == 0 and join(run, text, "host-b", sampled) == 0
    (cfg_a, id_a), (cfg_b, id_b) = sampled
    assert id_a != id_b and cfg_a.run.name == run.name and cfg_a.run.topic == run.cfg.run.topic
    assert cfg_a.sampler.max_groups == 3  # the joiner's --set on top of the run's config
    assert cfg_a.services.redis_url == run.sampler_cfg.services.redis_url  # the sampler role's user, never admin
    registry = run.follower.refresh(force=True) or run.follower.registry
    joined = {e.sampler_id: e for e in registry.keys.values()}
    grant = read_invite(text).grant.grant_id
    assert {id_a, id_b} <= set(joined) and all(joined[i].grant == grant and not joined[i].local
                                                 and not registry.is_local(joined[i].key_id) for i in (id_a, id_b))
    # The same host again: the same sampler, not a new one (the count is not used again).
    assert join(run, text, "host-a", sampled) == 0 and sampled[-1][1] == id_a
    listed = "\n".join(keys_list(run.cfg))
    assert id_a in listed and grant in listed
    # A third host: used up. One line, exit status 2, nothing registered.
    code, said = cli_join(run, text, "host-c", capsys)
    assert code == 2 and "is used up (2 of 2 joined)" in said
    assert len(run.follower.admissions.keys) == 2 and run.follower.admissions.joins == {grant: 2}


def test_a_join_the_learner_did_not_answer_is_asked_again_as_the_same_host(run, capsys):
    """A first try the learner never answered leaves the host's key but no admission: the next
    try asks again with the same key and id (counted once), and checks the invite's expiry
    again, which only an admitted host may outlive."""
    sampled: list = []
    run.paused.set()  # the learner is away
    short = make(run, joins=1, hours=3 / 3600)
    with pytest.raises(invites.InviteError, match="did not answer"):
        join(run, short, "late", sampled, wait_s=1)
    (home,) = (run.tmp / "late").iterdir()
    assert json.loads((home / "joined.json").read_text())["admitted"] is False
    time.sleep(3.5)
    code, said = cli_join(run, short, "late", capsys)
    assert code == 2 and "expired" in said and sampled == []

    text = make(run, joins=1)
    with pytest.raises(invites.InviteError, match="did not answer"):
        join(run, text, "slow", sampled, wait_s=1)
    first_id = json.loads(next((run.tmp / "slow").iterdir()).joinpath("joined.json").read_text())["sampler_id"]
    run.paused.clear()
    assert join(run, text, "slow", sampled) == 0 and sampled[-1][1] == first_id
    grant = read_invite(text).grant.grant_id
    assert run.follower.admissions.joins.get(grant) == 1
    assert join(run, text, "slow", sampled) == 0 and sampled[-1][1] == first_id  # resumes, not a new one


def test_every_bad_invite_is_one_line_and_registers_nothing(run, capsys):
    text = make(run, joins=5)
    code, said = cli_join(run, text[:200], "cut", capsys)
    assert code == 2 and "cut short or garbled" in said
    code, said = cli_join(run, text[:-8] + ("A" * 8 if not text.endswith("A" * 8) else "B" * 8), "altered", capsys)
    assert code == 2 and ("altered" in said or "garbled" in said)
    expired = make(run, hours=1 / 3600)
    time.sleep(1.5)
    code, said = cli_join(run, expired, "late", capsys)
    assert code == 2 and "expired" in said
    other = run.cfg.model_copy(update={"security": run.cfg.security.model_copy(
        update={"keys_dir": str(run.tmp / "other-keys"), "root_public_key": None, "learner_public_key": None})})
    init_keys(key_paths(other))
    foreign, _, _ = invites.make_run_invite(other, run.sampler_cfg, 1, 1.0)  # the same run name, another root
    from heterorl.keys import keys_add
    keys_add(run.cfg, "own-gpu")  # a registry signed by the run's root exists
    code, said = cli_join(run, foreign, "foreign", capsys)
    assert code == 2 and "not run" in said and "root key" in said
    unreachable = run.sampler_cfg.model_copy(update={"services": run.sampler_cfg.services.model_copy(
        update={"kafka_bootstrap": "127.0.0.1:1"})})
    nowhere, _, _ = invites.make_run_invite(run.cfg, unreachable, 1, 1.0)
    code, said = cli_join(run, nowhere, "nowhere", capsys)
    assert code == 2 and "127.0.0.1:1" in said
    time.sleep(0.5)  # the desk has read every request by now
    run.follower.refresh(force=True)
    assert run.follower.admissions.keys == {}  # nothing registered
    # Revoked: the invite, and with it every key that joined with it.
    sampled: list = []
    assert join(run, text, "before", sampled) == 0
    said = invites.revoke_invite(run.cfg, run.admin, read_invite(text).grant.grant_id)
    assert "its 1 sampler(s)" in said[0]
    registry = run.follower.refresh(force=True)
    assert registry.keys[next(iter(run.follower.admissions.keys))].status == "revoked"
    code, said = cli_join(run, text, "after", capsys)
    assert code == 2 and "was revoked" in said
    # A run that ended: nothing to join.
    fresh = make(run)
    run.admin.hset(f"heterorl:{run.name}:learner", "ended_at", str(time.time()))
    code, said = cli_join(run, fresh, "ended", capsys)
    assert code == 2 and "ended" in said


def test_the_invite_s_credentials_cannot_write_what_others_sign(run):
    """What a leaked invite never lets its holder do (docs/security.md, "Invites"), tried with
    the credentials it carries: its Redis user cannot write the key registry, the admissions,
    the policy pointer or the quarantines, nor read the learner's counters."""
    services = read_invite(make(run)).services
    sampler = redis.Redis.from_url(services["redis_url"], decode_responses=True)
    for key in ("key_registry", "admissions", "policy", "quarantine"):
        with pytest.raises(redis.exceptions.NoPermissionError):
            sampler.set(f"heterorl:{run.name}:{key}", "{}")
    with pytest.raises(redis.exceptions.NoPermissionError):
        sampler.hgetall(f"heterorl:{run.name}:learner_stats")
    sampler.xadd(f"heterorl:{run.name}:join_requests", {"request": "{}"})  # what it may write: a request


def test_a_volunteer_sees_the_groups_it_sent_and_those_the_learner_used(run):
    """`heterorl join`'s progress line, read with the sampler role's credentials: the policy
    its lease names, the groups it sent and those the learner trained on (`count_used`)."""
    learner = RunState(run.admin, run.name)
    learner.renew_sampler_lease("vol-1", {"policy_version": 3, "groups": 7}, 30)
    learner.count_used({"vol-1": 4, "honest-0": 60})
    learner.count_used({"vol-1": 1})
    sampler = redis.Redis.from_url(read_invite(make(run)).services["redis_url"], decode_responses=True)
    progress = JoinProgress(RunState(sampler, run.name), "vol-1")
    assert progress.line() == "vol-1: policy v3, groups sent 7, used by the learner 5"
    learner.record_sampler_stats("vol-1", {"policy_version": 4, "published": 9})  # what a sampler's close() leaves
    learner.release_sampler_lease("vol-1")
    assert progress.line() == "vol-1: policy v4, groups sent 9, used by the learner 5"  # its last line
    assert JoinProgress(RunState(sampler, run.name), "vol-2").line() == (
        "vol-2: policy not loaded yet, groups sent 0, used by the learner 0")


def test_an_invite_s_count_holds_across_learner_restarts(local_stack, tmp_path):
    """A restarted learner's desk goes on from the signed admissions in Redis: the joins made
    before count, and the requests decided before are not decided again."""
    name = f"inv-{uuid.uuid4().hex[:8]}"
    cfg = with_services(load_config(None, [f"run.name={name}", f"security.keys_dir={tmp_path / 'keys'}"], env={}),
                        stack_services(local_stack, "admin"))
    paths = key_paths(cfg)
    init_keys(paths)
    admin = redis.Redis.from_url(stack_services(local_stack, "admin").redis_url, decode_responses=True)
    text, grant, _ = invites.make_run_invite(cfg, with_services(cfg, stack_services(local_stack, "sampler")), 2, 1.0)
    invite = read_invite(text)

    def desk():  # a learner started (again)
        return JoinDesk(admin, name, load_root_public(paths), load_learner_key(paths), 30, logging.getLogger("t"))

    def request(sampler_id):
        key = SigningKey.generate()
        admin.xadd(join_requests_key(name), {"request": json.dumps(
            make_join_request(key, invite, sampler_id, "host", time.time()))})
        return key

    first = request("a")
    assert desk().serve(None, set())
    second, third = request("b"), request("c")
    assert desk().serve(None, set()) and not desk().serve(None, set())  # nothing new: nothing decided
    admissions = RegistryFollower(admin, name, load_root_public(paths), 1, logging.getLogger("t"),
                                  load_learner_key(paths).public)
    admissions.refresh(force=True)
    assert set(admissions.admissions.keys) == {first.key_id, second.key_id}
    assert admissions.admissions.joins == {grant.grant_id: 2}
    assert "used up" in admissions.admissions.refused[third.key_id]


class Loads:
    """An engine that records what it was given."""

    backend = "hf"

    def __init__(self):
        self.installed = []

    def prepare(self, path):
        return path

    def install(self, prepared):
        self.installed.append(prepared)


def publish(run, local_stack, tmp_path, version: int) -> Path:
    """A tiny model published as `version` of the run, signed, as its learner publishes it."""
    from pipeline.models.tiny import ModelSize, build_tiny_model, build_tokenizer
    from pipeline.weights.policy import KeyframeRule, PolicyWriter
    from pipeline.weights.store import CheckpointStore, PolicyPointer, connect_s3

    tokenizer = build_tokenizer()
    model_dir = tmp_path / f"v{version}"
    build_tiny_model(tokenizer, ModelSize(hidden_size=32, num_layers=2, num_heads=2,
                                          intermediate_size=64)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    learner = load_learner_key(key_paths(run.cfg))
    services = stack_services(local_stack, "admin")
    store = CheckpointStore(connect_s3(services), services.bucket, run.name, signer=learner)
    manifest_key = PolicyWriter(store, KeyframeRule(10)).write(version, model_dir)
    PolicyPointer(RunState(run.admin, run.name)).set(version, manifest_key, signer=learner)
    return model_dir


def test_a_volunteer_downloads_the_newest_policy_while_the_learner_admits_it(run, local_stack, tmp_path):
    """On a slow link the keyframe is most of a volunteer's wait: `heterorl join` downloads it from
    when the servers answer, beside the admission, and hands the sampler what it fetched (verified
    against the learner's key, as every download is), so nothing is downloaded twice."""
    from pipeline.weights.policy import read_weights
    from producers.sampler import sampler_work_dir

    model_dir = publish(run, local_stack, tmp_path, 3)
    run.paused.set()  # the learner is busy training: the admission waits
    handed, done = {}, threading.Event()

    def sampler(cfg, sampler_id, policy):
        handed.update(policy=policy, work_dir=sampler_work_dir(cfg, sampler_id))
        return 0

    thread = threading.Thread(target=lambda: handed.update(code=invites.join(
        make(run, joins=1), base=run.tmp / "far", config_file=None, overrides=[], sampler_id=None, wait_s=30,
        run_sampler=sampler)) or done.set(), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not list((run.tmp / "far").glob("*/samplers/*/v3/model.safetensors")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list((run.tmp / "far").glob("*/samplers/*/v3/model.safetensors")), "nothing downloaded while waiting"
    assert not run.follower.admissions.keys and not done.is_set()  # nobody admitted it yet
    run.paused.clear()
    assert done.wait(30) and handed["code"] == 0
    policy = handed["policy"]
    assert policy is not None and policy.bytes_downloaded > 0 and policy.work_dir == handed["work_dir"]
    engine = Loads()
    policy.attach(engine)  # the sampler's engine, built after the admission
    deadline = time.monotonic() + 10
    while policy.swap_if_ready() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert policy.version == 3 and engine.installed == [handed["work_dir"] / "v3"]
    got, want = read_weights(engine.installed[0]), read_weights(model_dir)
    assert {n: sorted(t) for n, t in got.items()} == {n: sorted(t) for n, t in want.items()}
    assert all(torch.equal(got[n][k], want[n][k]) for n in want for k in want[n])


def test_a_volunteer_the_learner_refuses_keeps_nothing_it_downloaded(run, local_stack, tmp_path):
    """What the first download fetched while the host waited goes with a refusal (the invite
    revoked while it waits: a used-up invite is said before anything is asked or downloaded)."""
    publish(run, local_stack, tmp_path, 0)
    text = make(run, joins=2)
    run.paused.set()  # the learner busy: the second host downloads while it waits
    refused = {}

    def second() -> None:
        try:
            join(run, text, "second", [])
        except invites.InviteError as e:
            refused["error"] = str(e)

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not list((run.tmp / "second").glob("*/samplers/*/v0/model.safetensors")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list((run.tmp / "second").glob("*/samplers/*/v0/model.safetensors")), "nothing downloaded while waiting"
    invites.revoke_invite(run.cfg, run.admin, read_invite(text).grant.grant_id)
    run.paused.clear()
    thread.join(30)
    assert "was revoked" in refused["error"]
    assert (run.tmp / "second").is_dir() and not list((run.tmp / "second").glob("*/samplers/*"))
