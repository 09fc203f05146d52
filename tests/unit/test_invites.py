"""Invites without servers (pipeline/trust/invites.py): the token a person pastes, the grant the
root key signs, and the learner's decision on each join request (`GrantBook`), which is what
holds an invite to its count, its expiry and its revocation."""

from __future__ import annotations

import pytest

from heterorl.invites import refuse_other_roles
from pipeline.config import ConfigError
from pipeline.trust import KeyEntry, KeyRegistry
from pipeline.trust.invites import (Admissions, Grant, GrantBook, InviteError, check_not_expired, decode_invite,
                                    encode_invite, make_invite, make_join_request, read_invite)
from pipeline.wire.signing import SigningKey, sign_document

RUN, NOW = "r1", 1_000_000.0
SERVICES = {"kafka_bootstrap": "10.0.0.1:9092", "redis_url": "redis://sampler:pw@10.0.0.1:6379/0"}


def invite(root: SigningKey, joins: int = 2, lifetime_s: float = 3600, run: str = RUN) -> str:
    return make_invite(root, Grant.new(run, joins, lifetime_s, NOW), services=SERVICES, ca_pem=None,
                       learner_public=SigningKey.generate().public, config={"run": {"name": run}})


def test_an_invite_is_one_line_that_reads_back_as_signed():
    root = SigningKey.generate()
    text = invite(root)
    assert "\n" not in text and len(text) < 2000
    got = read_invite(text[:70] + "\n" + text[70:])  # wrapped by a chat: still the same invite
    assert got.run == RUN and got.grant.max_joins == 2 and got.grant.local is False and got.grant.role == "sampler"
    assert got.services == SERVICES and got.root_public.key_id == root.key_id


def test_a_cut_altered_or_foreign_text_is_one_line_saying_so():
    root = SigningKey.generate()
    text = invite(root)
    with pytest.raises(InviteError, match="cut short or garbled"):
        read_invite(text[: len(text) // 2])
    with pytest.raises(InviteError, match="not a heterorl invite"):
        read_invite("hello " + text)
    for change in (lambda d: d["services"].update(redis_url="redis://evil:6379/0"),
                   lambda d: d["grant"].update(max_joins=1000),
                   lambda d: d.update(learner_public_key=SigningKey.generate().public.to_b64())):
        document = decode_invite(text)
        change(document)
        with pytest.raises(InviteError, match="altered"):
            read_invite(encode_invite(document))
    document = decode_invite(text)  # a grant for samplers that are the run's own: never made, never read
    document["grant"]["local"] = True
    with pytest.raises(InviteError, match="altered"):
        read_invite(encode_invite(document))


def test_an_expired_invite_says_since_when():
    grant = read_invite(invite(SigningKey.generate(), lifetime_s=60)).grant
    check_not_expired(grant, NOW + 59)
    with pytest.raises(InviteError, match=r"expired 2 min ago"):
        check_not_expired(grant, NOW + 180)


class Run:
    """A run's root key and the learner's book of admissions."""

    def __init__(self, key_lifetime_s: float = 86400):
        self.root = SigningKey.generate()
        self.book = GrantBook(RUN, self.root.public, Admissions(RUN), key_lifetime_s)
        self.registered: dict = {}
        self.revoked: set = set()
        self.quarantined: set = set()

    def request(self, text: str, key: SigningKey, sampler_id: str, at: float = NOW) -> str:
        document = make_join_request(key, read_invite(text), sampler_id, "host", at)
        return self.book.decide(document, at, self.registered, self.revoked, self.quarantined)[1]


def test_a_grant_admits_as_many_keys_as_it_says_and_the_same_key_again():
    run = Run()
    text = invite(run.root, joins=2)
    first, second, third = (SigningKey.generate() for _ in range(3))
    assert run.request(text, first, "a") == "" and run.request(text, second, "b") == ""
    assert run.request(text, third, "c") == f"invite {read_invite(text).grant.grant_id} is used up (2 of 2 joined)"
    assert run.request(text, first, "a") == ""  # the same volunteer starting again: not counted
    admissions = run.book.admissions
    assert set(admissions.keys) == {first.key_id, second.key_id} and admissions.joins == {
        read_invite(text).grant.grant_id: 2}
    assert admissions.refused == {third.key_id: admissions.refused[third.key_id]}
    registry = KeyRegistry.empty(RUN).with_admitted(admissions.keys)
    entry = registry.keys[first.key_id]
    assert (entry.sampler_id, entry.status, entry.role, entry.local) == ("a", "active", "sampler", False)
    assert not registry.is_local(first.key_id)  # a volunteer is never the run's own sampler


def test_what_a_join_request_cannot_get():
    run = Run()
    text = invite(run.root, joins=5, lifetime_s=60)
    grant_id = read_invite(text).grant.grant_id
    key = SigningKey.generate()
    assert "expired" in run.request(text, key, "late", at=NOW + 61)
    assert "of another run" in run.request(invite(SigningKey.generate()), key, "x")  # another run's root
    assert "not 'r1'" in run.request(invite(run.root, run="r2"), key, "x")  # this root, another run's name
    run.quarantined.add(key.key_id)
    assert "quarantined" in run.request(text, key, "q")
    owner = SigningKey.generate()
    run.registered = {owner.key_id: KeyEntry(owner.key_id, "gpu-1", owner.public, "active", NOW + 1e6, NOW)}
    assert "already registered" in run.request(text, owner, "gpu-1")
    assert "is taken" in run.request(text, SigningKey.generate(), "gpu-1")  # another key under a known id
    run.revoked.add(grant_id)
    assert "revoked" in run.request(text, SigningKey.generate(), "new")
    validator = Grant.new(RUN, 5, 60, NOW).to_document() | {"role": "validator"}  # signed by the root, even
    signed = make_join_request(key, read_invite(text), "v", "host", NOW) | {"grant": sign_document(validator, run.root)}
    assert "role 'validator'" in run.book.decide(sign_document(signed, key), NOW, {}, set(), set())[1]
    forged = make_join_request(SigningKey.generate(), read_invite(text), "forged", "host", NOW)
    forged["public_key"] = SigningKey.generate().public.to_b64()  # someone else's key, not signed by it
    assert "is signed by key" in run.book.decide(forged, NOW, {}, set(), set())[1]
    assert "not a JSON object" in run.book.decide(None, NOW, {}, set(), set())[1]
    assert run.book.admissions.keys == {} and run.book.admissions.joins == {}


def test_a_revoked_invite_revokes_the_keys_that_joined_with_it():
    run = Run()
    text = invite(run.root)
    key = SigningKey.generate()
    assert run.request(text, key, "v") == ""
    grant_id = read_invite(text).grant.grant_id
    registry = KeyRegistry.empty(RUN).with_revoked_grant(grant_id, NOW + 5)
    registry = KeyRegistry.from_signed(registry.signed(run.root), run.root.public, RUN)  # as Redis holds it
    assert registry.revoked_grants == {grant_id: NOW + 5}
    entry = registry.with_admitted(run.book.admissions.keys).keys[key.key_id]
    assert (entry.status, entry.grant, entry.revoked_at) == ("revoked", grant_id, NOW + 5)
    revoked = KeyRegistry.empty(RUN).with_revoked(key.key_id, NOW, entry=entry)  # `heterorl keys revoke` one of them
    again = KeyRegistry.from_signed(revoked.signed(run.root), run.root.public, RUN)
    assert again.with_admitted(run.book.admissions.keys).keys[key.key_id].status == "revoked"


def test_an_invite_never_carries_another_role_s_credentials():
    """Where the learner's variables are set (its host holds the root key), its Redis user would
    otherwise go into the invite: `heterorl invite` asks for the sampler's instead."""
    refuse_other_roles("redis://sampler:pw@10.0.0.1:6379/0", None)
    refuse_other_roles("redis://:pw@10.0.0.1:6379/0", "sampler")
    for redis_url, kafka_user in (("redis://learner:pw@10.0.0.1:6379/0", None),
                                  ("redis://admin:pw@10.0.0.1:6379/0", None),
                                  ("redis://sampler:pw@10.0.0.1:6379/0", "learner")):
        with pytest.raises(ConfigError, match=r"sampler role's credentials.*sampler\.env"):
            refuse_other_roles(redis_url, kafka_user)


def test_a_joiner_s_config_file_and_set_change_its_sampler_never_the_servers_or_keys(tmp_path):
    """`heterorl join --config FILE --set k=v`: the run's config from the invite, the joiner's
    sampler, model and task fields on top; a file or --set that reaches for the servers, the keys
    or the run is refused in one line, naming it."""
    from heterorl.invites import joined_config

    got = read_invite(invite(SigningKey.generate()))
    mine = tmp_path / "mine.yaml"
    mine.write_text("sampler:\n  max_new_tokens: 7\n  backend: hf\n")
    cfg = joined_config(got, tmp_path / "home", str(mine), ["sampler.max_groups=3"])
    assert cfg.sampler.max_new_tokens == 7 and cfg.sampler.backend == "hf" and cfg.sampler.max_groups == 3
    assert cfg.run.name == RUN and cfg.services.redis_url == SERVICES["redis_url"]
    assert cfg.security.sampler_key == str(tmp_path / "home" / "sampler.key")
    for section in ("services", "security", "run"):
        (tmp_path / f"{section}.yaml").write_text(f"{section}:\n  x: 1\n")
        with pytest.raises(ConfigError, match=f"{section}: the invite sets it"):
            joined_config(got, tmp_path / "home", str(tmp_path / f"{section}.yaml"), [])
    for assignment in ("services.redis_url=redis://admin@x/0", "security.trust_local_samplers=true", "run.name=other"):
        with pytest.raises(ConfigError, match="the invite sets it"):
            joined_config(got, tmp_path / "home", None, [assignment])
