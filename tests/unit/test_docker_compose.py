"""docker-compose.yml and infra/Dockerfile describe the production shape (no Docker needed)."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "infra" / "Dockerfile"

INFRA = ("kafka", "redis", "minio")
WORKERS = ("learner", "sampler")
ONE_SHOT = ("createbuckets",)
PRODUCT_ENV = ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "AWS_ENDPOINT_URL",
               "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH|ACCESS_KEY", re.I)
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


def test_one_shot_bucket_creation(services: dict) -> None:
    mc = services["createbuckets"]
    assert "minio/mc" in mc["image"]
    assert mc["depends_on"]["minio"]["condition"] == "service_healthy"
    script = " ".join(_command(mc))
    assert "mc mb" in script and "HETERORL_S3_BUCKET" in script
    assert mc.get("restart", "no") == "no"


def test_workers_wait_for_healthy_infrastructure(services: dict) -> None:
    for name in WORKERS:
        deps = services[name]["depends_on"]
        for infra in INFRA:
            assert deps[infra]["condition"] == "service_healthy", (name, infra)
        assert deps["createbuckets"]["condition"] == "service_completed_successfully"


def test_workers_built_from_infra_dockerfile(services: dict) -> None:
    for name in WORKERS:
        build = services[name]["build"]
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context.is_dir()
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE
        assert DOCKERFILE.is_file()


def test_worker_commands(services: dict) -> None:
    for name in WORKERS:
        assert _command(services[name]) == ["heterorl", name, "--config", "/app/configs/demo.yaml"]


def test_workers_get_service_urls_from_env(services: dict) -> None:
    for name in WORKERS:
        env = _env(services[name])
        for key in PRODUCT_ENV:
            assert env.get(key), (name, key)
        assert env["KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
        assert "@redis:6379" in env["REDIS_URL"] or "//redis:6379" in env["REDIS_URL"]


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
            if SECRET_NAME.search(key) or re.match(r"^\w+://[^/]*@", value):
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
        if url:  # only the userinfo of a URL is secret
            literal = url.group(1).strip(":")
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
    assert re.search(r"^RUN pip install \.(\s|$)", text, re.M)
    assert re.search(r"^USER (?!root)\S+", text, re.M)
    assert "HEALTHCHECK" in text and "heterorl-healthcheck" in text
    # Every COPY from the build context names something that exists (a wildcard may
    # match nothing, as long as the instruction copies something).
    for line in re.findall(r"^COPY (?!<<)(.+)$", text, re.M):
        sources = [s for s in line.split()[:-1] if not s.startswith("--")]
        matched = [s for s in sources if glob.glob(str(ROOT / s))]
        missing = [s for s in sources if s not in matched and not any(c in s for c in "*?[")]
        assert matched and not missing, f"COPY {line}: missing {missing or sources}"
