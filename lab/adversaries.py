"""The adversaries of `heterorl attack`: samplers that hold a key the run admitted and lie,
and attackers with write access to the broker and the bucket (docs/security.md).

Samplers (`heterorl adversary KIND`), each a `producers.sampler.Sampler` that changes one thing.
In the attack each joins with the attack's invite, as a stranger does (`heterorl adversary
--invite`, the admission of `heterorl join`), and signs with the key it made for itself:

- `forged_rewards`:  claims every completion is correct;
- `noisy_logprobs`:  adds N(0, 0.5) noise to its log-probs;
- `other_model`:     generates with another model (a fresh random initialisation of the same
                     architecture) while claiming the published version;
- `false_version`:   stamps its groups with a policy version the learner has not made;
- `bad_signature`:   sends every other group unsigned, the rest with a corrupted signature;
- `stale_prober`:    honest through probation, then forges every group (noisy log-probs) claiming
                     a stale version, the way a draw shared by a version could be beaten: each
                     batch claims the newest version it held before its own (the first of its
                     groups is that version's probe), and once the update log shows a probe
                     used, every group claims that version while it is within the max delay
                     (where it can read the update log: through the Kafka gate it cannot).
                     It does not wait for a probe's fate (a young version would age past the
                     max delay meanwhile), so under a draw per version an undrawn version's
                     groups would all be used.

Attackers run as threads of `heterorl attack`:

- `Replayer`:        re-sends copies of earlier messages of the topic;
- `ManifestTamperer`: with write access to S3 and Redis, rewrites a checkpoint in place,
                     publishes a checkpoint of its own, and rolls the policy pointer back;
- `VerdictForger`:   with validators (`heterorl attack --validators K`), writes verdicts that
                     would let the adversaries' groups in: unsigned, signed with an adversary's
                     sampler key, a genuine verdict moved onto another group, and genuine
                     verdicts that let a group in, sent again.

The replayer and the tamperer hold no key (they copy or rewrite what others signed); the
`bad_signature` sampler joins like the others, but no message of its carries a valid signature.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import msgpack
import numpy as np
import torch

from pipeline.weights.store import CheckpointStore, PolicyPointer, current as current_pointer
from pipeline.config import HeteroConfig
from pipeline.clients.topics import TopicWriter, read_topic
from pipeline.records.update_log import read_update_log
from pipeline.wire.rollout import Rollout, encode_rollout, header_value, seal_rollout
from pipeline.wire.signing import KeyFileError, SigningKey, read_key_file, sign_document
from producers.sampler import Sampler

SAMPLER_KINDS = ("forged_rewards", "noisy_logprobs", "other_model", "false_version", "bad_signature",
                 "stale_prober")
ATTACKER_KINDS = ("replay", "tampered_manifest")
FORGED_VERDICT_KINDS = ("unsigned", "sampler_key", "other_group", "replayed")
"""What `VerdictForger` sends, and the learner's refusal code for each."""
FORGED_VERDICT_REFUSALS = {"unsigned": "unsigned_verdict", "sampler_key": "wrong_role",
                           "other_group": "bad_signature", "replayed": "replayed_verdict"}


def message_digest(value: bytes) -> str:
    """A message's name by its bytes (what `VerdictForger.acknowledged` keeps of each it sent)."""
    return hashlib.sha256(value).hexdigest()


def forgeries_in_topic(acknowledged: dict[str, Counter], in_topic: Counter) -> dict[str, int]:
    """How many of the forger's acknowledged messages, by kind, a reader of the verdicts topic
    finds (`in_topic`: every message's `message_digest`, counted), each counted at most as often
    as it was acknowledged. A forgery is new bytes, so every copy found counts; a replay repeats a
    genuine verdict's bytes, so only the copies past the original do. A message the broker acknowledged may be one no reader finds (the local stack's
    Tansu 0.6 can store one under an offset another holds, docs/faults.md): the learner cannot
    refuse what it never reads."""
    found = {}
    for kind, sent in acknowledged.items():
        originals = 1 if kind == "replayed" else 0
        found[kind] = sum(min(n, max(0, in_topic.get(digest, 0) - originals)) for digest, n in sent.items())
    return found


class ForgedRewards(Sampler):
    def make_rollouts(self, problems, groups) -> list[Rollout]:
        rollouts = super().make_rollouts(problems, groups)
        for r in rollouts:
            r.rewards = [1.0] * r.group_size
        return rollouts


class NoisyLogprobs(Sampler):
    def make_rollouts(self, problems, groups) -> list[Rollout]:
        rollouts = super().make_rollouts(problems, groups)
        rng = np.random.default_rng(self.seed)
        for r in rollouts:
            r.sampler_logps = [np.minimum(np.asarray(c) + rng.normal(0.0, 0.5, len(c)), 0.0).tolist()
                               for c in r.sampler_logps]
        return rollouts


class OtherModel(Sampler):
    """Every version it loads is replaced by another model before it generates."""

    def swap_weights(self) -> None:
        before = self.policy.version
        super().swap_weights()
        engine = self.policy.engine
        if self.policy.version != before and hasattr(engine, "model"):
            torch.manual_seed(self.seed)
            other = type(engine.model)(engine.model.config).to(next(engine.model.parameters()).device)
            engine.model = other.eval()


class FalseVersion(Sampler):
    def make_rollouts(self, problems, groups) -> list[Rollout]:
        rollouts = super().make_rollouts(problems, groups)
        for r in rollouts:
            r.policy_version = (self.view.newest_version or 0) + 1000
        return rollouts


class ForgingSink(TopicWriter):
    """Alternates an unsigned body and a sealed one whose signature has a flipped byte."""

    sent = 0

    def encode(self, rollout: Rollout) -> bytes:
        self.sent += 1
        if self.sent % 2:
            return encode_rollout(rollout)
        sealed = msgpack.unpackb(seal_rollout(rollout, self.signer), raw=False)
        signature = bytearray(sealed["signature"])
        signature[0] ^= 0xFF
        return msgpack.packb({"signed_rollout": sealed["signed_rollout"], "signature": bytes(signature)},
                             use_bin_type=True)


class BadSignature(Sampler):
    def start(self) -> None:
        super().start()
        services, topic, timeout = self.handles.services, self.cfg.run.topic, self.scfg.send_timeout_s
        self.outbox.make_sink = lambda: ForgingSink(services.kafka_bootstrap, topic, send_timeout_s=timeout,
                                                    connect_timeout_s=timeout, signer=self.signer,
                                                    security=services.security)  # its invite's login at the gate


class StaleProber(Sampler):
    """Probes which stale groups go unchecked and floods there (the module's docstring). It tries to
    learn a probe's fate from the run's update log, which a stranger cannot read (the Kafka gate
    refuses it, docs/security.md): it then never learns it, and probes on, version after version.
    Its forged rollout ids go into a file at the end (`prober_record`), for the audit to count how
    many were used."""

    PROBATION_MARGIN = 2
    """Honest groups first: this many times `security.probation_groups`, plus 10 (groups dropped
    as stale are not checked, so probation takes more groups than it counts)."""
    WATCH_S = 1.0
    """How often it reads the update log while a probe waits (a probe's version ages meanwhile)."""

    def start(self) -> None:
        super().start()
        self.honest_groups = self.PROBATION_MARGIN * self.cfg.security.probation_groups + 10
        self.forged_ids: list[str] = []
        self.probe: Optional[tuple[str, int]] = None
        """(rollout id, claimed version) of the forged group whose fate it waits for."""
        self.flood: Optional[int] = None
        """The version its last used probe claimed: every group forged and claiming it."""
        self.probes = self.floods = self.flooded = 0
        self.honest_made: Optional[int] = None
        """Groups it made before its first forged one (all honest)."""
        self.watched_at = 0.0
        self.held: set[int] = set()
        """Versions it generated with: published ones, so a group claiming one can be checked."""

    def make_rollouts(self, problems, groups) -> list[Rollout]:
        rollouts = super().make_rollouts(problems, groups)
        self.held.add(self.policy.version)
        earlier = [v for v in self.held if v < self.policy.version]  # published: it held them
        if self.generated < self.honest_groups or not earlier:
            return rollouts
        self.watch()
        newest = self.view.version_at_use or self.policy.version
        if self.flood is not None and newest - self.flood >= self.cfg.learner.max_delay_steps:
            self.flood = None  # too old to be used now: find another
        if self.honest_made is None:
            self.honest_made = self.generated  # this batch not yet counted: every group before it was honest
        # A version seen used is flooded while young; otherwise each batch claims the newest version
        # it held before (as young as a stale claim gets: an older one ages past the max delay
        # before the update log could tell its probe's fate), its first group that version's probe.
        version = self.flood if self.flood is not None else max(earlier)
        if self.probe is None:
            self.probe, self.probes = (rollouts[0].rollout_id, version), self.probes + 1
        self.flooded += sum(r.rollout_id != self.probe[0] for r in rollouts)
        rng = np.random.default_rng(self.seed + len(self.forged_ids))
        for r in rollouts:
            r.policy_version = version
            r.sampler_logps = [np.minimum(np.asarray(c) + rng.normal(0.0, 0.5, len(c)), 0.0).tolist()
                               for c in r.sampler_logps]
            self.forged_ids.append(r.rollout_id)
        return rollouts

    def watch(self) -> None:
        """Whether the probe was used (then flood its version) or not (then probe again)."""
        if self.probe is None or time.monotonic() - self.watched_at < self.WATCH_S:
            return
        self.watched_at = time.monotonic()
        probe_id, version = self.probe
        if (self.view.version_at_use or 0) - version >= self.cfg.learner.max_delay_steps:
            self.probe = None  # too stale to be used by now (or discarded at the source): probe again
            return
        try:
            update_log = read_update_log(self.handles.services.kafka_bootstrap, self.cfg.run.topic, None, timeout_s=5.0)
        except Exception:  # noqa: BLE001 - an attacker keeps trying
            return
        for entry in update_log.entries if update_log else []:
            if any(g.rollout_id == probe_id for g in entry.used):
                self.probe, self.flood, self.floods = None, version, self.floods + 1
                self.log.info("probe %s claiming v%d was used: flooding v%d", probe_id, version, version)
                return
            if any(g.rollout_id == probe_id for g in entry.dropped):
                self.probe = None
                return

    def close(self) -> None:
        super().close()
        # the audit's record of what it forged, in its own directory: Redis takes no value that large
        # (the run functions bound a sampler's stats), and the audit runs on the same machine
        record = {"forged_rollout_ids": self.forged_ids, "probes": self.probes, "floods": self.floods,
                  "flooded_groups": self.flooded, "honest_groups_made": self.honest_made}
        prober_record(self.cfg.services.data_dir).write_text(json.dumps(record))


def prober_record(home: str | Path) -> Path:
    """Where the stale prober leaves what it forged for `heterorl attack`'s audit (its joined home)."""
    return Path(home) / "stale_prober.json"


ADVERSARY_SAMPLERS = {"forged_rewards": ForgedRewards, "noisy_logprobs": NoisyLogprobs, "other_model": OtherModel,
                      "false_version": FalseVersion, "bad_signature": BadSignature, "stale_prober": StaleProber}


def run_adversary(kind: str, cfg: HeteroConfig, sampler_id: str) -> int:
    return ADVERSARY_SAMPLERS[kind](cfg, sampler_id).run()


class Replayer(threading.Thread):
    """Every `every_s`, re-sends verbatim copies of `batch` earlier messages of the topic
    (with their headers), remembering each copy as the audit identifies a message:
    (partition, offset where it landed, rollout id)."""

    def __init__(self, bootstrap: str, topic: str, every_s: float = 3.0, batch: int = 4, seed: int = 0):
        super().__init__(name="replayer", daemon=True)
        self.bootstrap, self.topic, self.every_s, self.batch = bootstrap, topic, every_s, batch
        self.rng = random.Random(seed)
        self.copies: set[tuple[int, int, Optional[str]]] = set()
        self.stopped = threading.Event()
        self.errors = 0

    def run(self) -> None:
        sink: Optional[TopicWriter] = None
        while not self.stopped.wait(self.every_s):
            try:
                sink = sink or TopicWriter(self.bootstrap, self.topic)
                records = [r for r in read_topic(self.bootstrap, self.topic, timeout_s=10.0)
                           if (r.partition, r.offset, header_value(r.headers, "rollout_id")) not in self.copies]
                for r in self.rng.sample(records, min(self.batch, len(records))):
                    where = sink.send_raw(r.value, headers=r.headers, key=None)
                    self.copies.add((*where, header_value(r.headers, "rollout_id")))
            except Exception:  # noqa: BLE001 - an attacker keeps trying
                self.errors += 1
        if sink is not None:
            sink.close()


class ManifestTamperer(threading.Thread):
    """An attacker with write access to the bucket and to Redis. Every `every_s` it does the
    next of three things:

    1. rewrites the newest checkpoint in place: a weights file altered, the manifest's sha256
       changed to match (the learner's signature no longer holds);
    2. publishes a checkpoint of its own as the next version, signed with its own key, and
       points the policy pointer at it;
    3. puts back an old policy pointer the learner really signed (a rollback);
    4. alters the payload of the newest delta and leaves its signed manifest alone (the
       object no longer matches its sha256; every version chained on it is unreachable
       until the next keyframe);
    5. points the newest delta at another base version in its manifest, keeping the
       learner's signature (which no longer holds).

    Samplers must refuse all five and keep their weights."""

    def __init__(self, store: CheckpointStore, state, every_s: float = 10.0):
        super().__init__(name="tamperer", daemon=True)
        self.store, self.state, self.every_s = store, state, every_s
        self.key = SigningKey.generate()
        self.actions: list[str] = []
        self.stopped = threading.Event()
        self.errors = 0
        self.old_pointer: Optional[dict] = None

    def run(self) -> None:
        attacks = (self.tamper_in_place, self.forge_next_version, self.roll_back, self.corrupt_delta_payload,
                   self.rebase_delta)
        while not self.stopped.wait(self.every_s):
            try:
                done = attacks[len(self.actions) % len(attacks)]()
                if done:
                    self.actions.append(done)
            except Exception:  # noqa: BLE001 - an attacker keeps trying
                self.errors += 1

    def _altered_weights(self, version: int, manifest: dict) -> tuple[dict, bytes]:
        target = next(f for f in manifest["files"] if f["path"].endswith(".safetensors"))
        data = bytearray(self._get(self.store.version_prefix(version) + target["path"]))
        data[-64:] = bytes(64)  # the last weights of the file, zeroed
        return target, bytes(data)

    def _get(self, key: str) -> bytes:
        response = self.store.client.get_object(self.store.bucket, key)
        try:
            return response.read()
        finally:
            response.close()
            response.release_conn()

    def _put(self, key: str, data: bytes) -> None:
        self.store.client.put_object(self.store.bucket, key, io.BytesIO(data), len(data))

    def tamper_in_place(self) -> Optional[str]:
        version, key = current_pointer(self.state)
        if not version:
            return None
        if self.old_pointer is None:
            self.old_pointer = self.state.client.hgetall(self.state.prefix + "policy")
        manifest = json.loads(self._get(key))
        target, data = self._altered_weights(version, manifest)
        self._put(self.store.version_prefix(version) + target["path"], data)
        target["sha256"] = hashlib.sha256(data).hexdigest()
        self._put(key, json.dumps(manifest).encode())
        return f"v{version} rewritten in place"

    def forge_next_version(self) -> Optional[str]:
        version, key = current_pointer(self.state)
        if version is None:
            return None
        manifest = json.loads(self._get(key))
        forged = version + 1
        target, data = self._altered_weights(version, manifest)
        for f in manifest["files"]:
            body = data if f is target else self._get(self.store.version_prefix(version) + f["path"])
            self._put(self.store.version_prefix(forged) + f["path"], body)
            f["sha256"], f["size"] = hashlib.sha256(body).hexdigest(), len(body)
        manifest = sign_document({**{k: v for k, v in manifest.items() if k != "signature"}, "version": forged},
                                 self.key)
        self._put(self.store.manifest_key(forged), json.dumps(manifest).encode())
        PolicyPointer(self.state).set(forged, self.store.manifest_key(forged), signer=self.key)
        return f"v{forged} forged and pointed to"

    def _newest_delta(self) -> Optional[tuple[int, str, dict]]:
        version, key = current_pointer(self.state)
        if not version:
            return None
        manifest = json.loads(self._get(key))
        if (manifest.get("extra", {}).get("weights") or {}).get("kind") != "delta":
            return None
        return version, key, manifest

    def corrupt_delta_payload(self) -> Optional[str]:
        newest = self._newest_delta()
        if newest is None:
            return None
        version, _, manifest = newest
        target, data = self._altered_weights(version, manifest)
        self._put(self.store.version_prefix(version) + target["path"], data)
        return f"v{version}'s delta payload altered"

    def rebase_delta(self) -> Optional[str]:
        newest = self._newest_delta()
        if newest is None:
            return None
        version, key, manifest = newest
        weights = manifest["extra"]["weights"]
        weights["base_version"] = max(0, int(weights["base_version"]) - 1)
        self._put(key, json.dumps(manifest).encode())
        return f"v{version}'s delta pointed at base v{weights['base_version']}"

    def roll_back(self) -> Optional[str]:
        if not self.old_pointer:
            return None
        self.state.client.hset(self.state.prefix + "policy", mapping=self.old_pointer)
        return f"pointer rolled back to v{self.old_pointer['version']}"


class VerdictForger(threading.Thread):
    """An attacker that can write to the verdicts topic and holds an adversary's sampler key
    (`sampler_key_file`, read once the adversary has made it: it joins as the attack starts).
    Every `every_s`, for the adversaries' groups published since its last pass (`adversary_ids`)
    it sends passing verdicts: one unsigned, one signed with `sampler_key`, and a validator's
    genuine verdict on another group rewritten to name this one (its signature kept); and it
    re-sends verbatim up to 4 genuine verdicts that let a group into an update (the update log
    names each, so the learner has read every original). The learner must refuse every one
    (`FORGED_VERDICT_REFUSALS`). Each pass reads only what the rollout and verdicts topics gained
    since the last (and the update log, which is small) and sends its forgeries in one pipelined
    batch, so passes stay short as the topics grow; a step
    that fails (the broker fails a send, a topic not created yet) is counted by error type in
    `errors`, and what it had not sent is tried again at the next pass."""

    def __init__(self, bootstrap: str, topic: str, run: str, adversary_ids: set[str], sampler_key_file: Path,
                 every_s: float = 2.0):
        super().__init__(name="verdict-forger", daemon=True)
        self.bootstrap, self.topic, self.run_name, self.every_s = bootstrap, topic, run, every_s
        self.adversary_ids, self.sampler_key_file = adversary_ids, sampler_key_file
        self.sampler_key: Optional[SigningKey] = None
        self.acknowledged: dict[str, Counter] = {kind: Counter() for kind in FORGED_VERDICT_KINDS}
        """By kind, the `message_digest` of each message the broker acknowledged, counted."""
        self.stopped = threading.Event()
        self.errors: Counter = Counter()
        self.read_to: dict[str, dict[int, int]] = {}
        """Topic -> next offset to read per partition."""
        self.genuine: dict[str, tuple[bytes, dict]] = {}
        """The validators' verdicts read so far, by `GroupVerdict.ref`: the message's bytes and its
        decoded document."""
        self.replayed: set[str] = set()
        """Refs of the verdicts it re-sent."""
        self.seq = 0

    def run(self) -> None:
        from pipeline.trust.verdicts import verdicts_topic

        sink: Optional[TopicWriter] = None
        while not self.stopped.wait(self.every_s):
            if not self.has_key():
                continue  # no adversary's group to forge for before it has a key
            try:
                sink = sink or TopicWriter(self.bootstrap, verdicts_topic(self.topic))
                self.read_verdicts(verdicts_topic(self.topic))
                self.replay(sink)
            except Exception as e:  # noqa: BLE001 - an attacker keeps trying
                self.errors[type(e).__name__] += 1
                continue
            try:  # on its own: a send the broker fails ends this step, not the pass's replays
                self.forge(sink)
            except Exception as e:  # noqa: BLE001
                self.errors[type(e).__name__] += 1
        if sink is not None:
            sink.close()

    @property
    def sent(self) -> dict[str, int]:
        """By kind, how many messages the broker acknowledged."""
        return {kind: sum(digests.values()) for kind, digests in self.acknowledged.items()}

    def has_key(self) -> bool:
        """Whether it holds the adversary's key: read from its file once it is there, whole."""
        if self.sampler_key is None:
            try:
                self.sampler_key = read_key_file(self.sampler_key_file)
            except KeyFileError:
                return False  # not made yet, or being written
        return True

    def read_new(self, topic: str) -> tuple[list, dict[int, int]]:
        """The messages of `topic` past `read_to[topic]`, and the positions after them (the
        caller stores them in `read_to` once it has done with the messages)."""
        positions = dict(self.read_to.get(topic, {}))
        records = read_topic(self.bootstrap, topic, timeout_s=10.0, start_offsets=positions)
        for r in records:
            positions[r.partition] = max(positions.get(r.partition, 0), r.offset + 1)
        return records, positions

    def read_verdicts(self, topic: str) -> None:
        """Keeps the validators' verdicts published since the last pass: signed by the key they
        name, not its own. Its forgeries are not kept: unsigned, signed with its key, or (moved
        and replayed) under the ref of an original read before them."""
        from pipeline.trust.verdicts import Rejected, decode_verdict

        records, self.read_to[topic] = self.read_new(topic)
        for r in records:
            try:
                verdict, document = decode_verdict(r.value)
            except Rejected:
                continue
            signature = document.get("signature")
            if isinstance(signature, dict) and signature.get("key_id") == verdict.validator_key_id \
                    and verdict.validator_key_id != self.sampler_key.key_id:
                self.genuine.setdefault(verdict.ref, (r.value, document))

    def replay(self, sink: TopicWriter) -> None:
        """Re-sends up to 4 genuine verdicts that the update log says let a group in."""
        update_log = read_update_log(self.bootstrap, self.topic, None)
        used = {g.verdict for e in (update_log.entries if update_log else ()) for g in e.used if g.verdict}
        again = [ref for ref in self.genuine if ref in used and ref not in self.replayed][:4]
        if again:
            sink.send_raw_many([self.genuine[ref][0] for ref in again])
            self.replayed.update(again)
            self.acknowledged["replayed"].update(message_digest(self.genuine[ref][0]) for ref in again)

    def forge(self, sink: TopicWriter) -> None:
        """Three forged passing verdicts for each adversary's group published since the last pass,
        sent in one batch; the groups are marked read once the broker has acknowledged it."""
        from pipeline.wire.rollout import decode_rollout
        from pipeline.trust.verdicts import GroupVerdict, group_digest, seal_verdict

        records, positions = self.read_new(self.topic)
        passing = [document for _, document in list(self.genuine.values())[-64:] if document.get("passed") is True]
        messages: list[bytes] = []
        kinds: list[str] = []
        for record in records:
            if self.stopped.is_set():
                return  # the learner drains once every attacker has stopped
            try:
                group = decode_rollout(record.value)
            except ValueError:
                continue
            if group.sampler_id not in self.adversary_ids:
                continue
            self.seq += 1
            digest = group_digest(record.value)
            forged = GroupVerdict(run=self.run_name, rollout_id=group.rollout_id, partition=record.partition,
                                  offset=record.offset, group_digest=digest,
                                  sampler_id=group.sampler_id, key_id=group.key_id, passed=True,
                                  checks=("rewards", "logprobs"), version_used=group.policy_version,
                                  validator_id=group.sampler_id, validator_key_id=self.sampler_key.key_id,
                                  seq=self.seq)
            signed = json.loads(seal_verdict(forged, self.sampler_key))
            unsigned = {k: v for k, v in signed.items() if k != "signature"}
            messages += [json.dumps(unsigned).encode(), json.dumps(signed).encode()]
            kinds += ["unsigned", "sampler_key"]
            other = next((v for v in reversed(passing) if v["rollout_id"] != group.rollout_id), None)
            if other is not None:  # a validator's real signature, on another group's verdict
                moved = {**other, "rollout_id": group.rollout_id, "partition": record.partition,
                         "offset": record.offset, "group_digest": digest,
                         "sampler_id": group.sampler_id, "key_id": group.key_id}
                messages.append(json.dumps(moved).encode())
                kinds.append("other_group")
        if messages:
            sink.send_raw_many(messages)
        for kind, message in zip(kinds, messages):
            self.acknowledged[kind][message_digest(message)] += 1
        self.read_to[self.topic] = positions
