"""infra/access.py is the one place that says what each role may do: docs/security.md's table is
generated from it, each row names a test that exists, and docker-compose.yml's init scripts give
each role what it says (Redis ACLs: tests/unit/test_docker_compose.py; Kafka ACLs and MinIO
policies here)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from infra.access import (ROLES, SAMPLER_WRITES, STRANGER_READS, TESTED_BY, access_table, kafka_gate_grant,
                          redis_gate_grant, s3_grants)
from infra.s3_identities import DELETE, LIST, READ, WRITE
from pipeline.clients.run_functions import SAMPLER_FUNCTIONS

ROOT = Path(__file__).resolve().parents[2]
TABLE = re.compile(r"<!-- access table: .*? -->\n(.*?)\n<!-- end of the access table -->", re.S)


def test_the_security_page_holds_the_table_the_module_generates():
    found = TABLE.search((ROOT / "docs" / "security.md").read_text())
    assert found, "docs/security.md lost its access table markers"
    assert found.group(1) == access_table(), "regenerate it: python -c 'from infra.access import access_table; " \
                                             "print(access_table())'"


def test_every_row_names_a_test_that_exists():
    for (role, server), node in TESTED_BY.items():
        path, name = node.split("::")
        tree = ast.parse((ROOT / path).read_text())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, (role, server, node)


def test_a_stranger_gets_one_run_and_no_more():
    grant = redis_gate_grant("r1", samplers=2)
    assert set(grant.functions) == set(SAMPLER_FUNCTIONS) - {"hr_epoch_size"}  # the functions only: nothing
    # written directly, and not the run's epoch size; a stranger's join requests are counted
    assert grant.functions["hr_join_request"].max_calls == 8 and grant.functions["hr_claim"].max_calls is None
    assert all(k.startswith("heterorl:r1:") for f in grant.functions.values() for k in f.keys)
    assert all(k.startswith("heterorl:r1:") for k in grant.read_keys)
    assert "heterorl:r1:learner_stats" not in grant.read_keys and len(STRANGER_READS) == len(grant.read_keys)
    assert dict(grant.max_distinct) == {"heterorl:r1:sampler:*": 2}
    kafka = kafka_gate_grant("stranger", "r1.rollouts")
    assert (kafka.produce, kafka.fetch, kafka.everything) == (frozenset({"r1.rollouts"}), frozenset(), False)
    assert [(g.prefix, g.actions) for g in s3_grants("stranger", "heterorl", "r1")] == [
        ("r1/", frozenset({LIST})), ("r1/v", frozenset({READ}))]
    assert all(not g.actions & {WRITE, DELETE} for role in ("sampler", "validator", "stranger")
               for g in s3_grants(role, "heterorl", "r1"))
    assert s3_grants("broker", "heterorl")[0].bucket == "heterorl-kafka"
    assert all(g.bucket != "heterorl-kafka" for g in s3_grants("learner", "heterorl"))
    assert set(ROLES) >= {"admin", "learner", "sampler", "validator", "stranger", "broker"}
    assert "sampler_owners" in SAMPLER_WRITES


def test_compose_gives_each_role_what_the_module_says():
    """docker-compose.yml cannot run here (no Docker engine): its init scripts are held to the module."""
    kafka = (ROOT / "infra" / "compose" / "kafka-init.sh").read_text()
    sampler_acl = re.findall(r"--allow-principal User:sampler (.*)", kafka)
    assert sampler_acl == ['--operation Write --operation Describe --topic "$TOPIC"']  # produce the rollouts only
    assert kafka_gate_grant("sampler", "$TOPIC").produce == frozenset({"$TOPIC"})
    minio = (ROOT / "infra" / "compose" / "minio-init.sh").read_text()
    policy = json.loads(re.search(r"cat > /tmp/sampler.json <<JSON\n(.*?)\nJSON", minio, re.S).group(1)
                        .replace("$BUCKET", "arn:aws:s3:::b"))
    actions = {a for statement in policy["Statement"] for a in statement["Action"]}
    allowed = {READ: {"s3:GetObject"}, LIST: {"s3:ListBucket", "s3:GetBucketLocation"}}
    granted = set().union(*(allowed[a] for g in s3_grants("sampler", "b") for a in g.actions))
    assert actions == granted  # read and list: no put, no delete
