"""Completing a config from a running local stack, without pinning the stack's ports in saved configs."""

from heterorl.stack import with_services
from pipeline.config import dump_config, load_config
from pipeline.clients.services import Services, require_services, resolve_services

STACK = Services("127.0.0.1:9092", "redis://127.0.0.1:6379/0", "http://127.0.0.1:9000", "key", "s3cr3t-value",
                 "us-east-1", "heterorl", from_local_stack=True)


def test_configured_urls_win_and_the_stack_fills_the_rest():
    cfg = load_config(None, ["services.kafka_bootstrap=kafka.example:9092"], env={}).services
    s = resolve_services(cfg, STACK)
    assert s.kafka_bootstrap == "kafka.example:9092" and s.redis_url == STACK.redis_url
    assert (s.s3_endpoint, s.s3_access_key, s.bucket) == (STACK.s3_endpoint, "key", "heterorl")
    # S3 credentials and bucket go with the endpoint they belong to.
    cfg = load_config(None, ["services.s3_endpoint=https://minio.example", "services.bucket=mine"], env={}).services
    s = resolve_services(cfg, STACK)
    assert (s.s3_endpoint, s.s3_access_key, s.bucket) == ("https://minio.example", "", "mine")
    assert resolve_services(load_config(None, [], env={}).services) is None


def test_a_saved_config_keeps_what_was_configured_not_the_stack_addresses(tmp_path):
    cfg = load_config(None, ["services.bucket=mine", "services.s3_region=eu-west-1"], env={})
    filled = with_services(cfg, STACK)
    assert require_services(filled.services).redis_url == STACK.redis_url
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(filled.model_copy(update={"run": filled.run.model_copy(update={"name": "x"})})))
    again = load_config(saved, env={})
    assert again.services.kafka_bootstrap is None and again.services.redis_url is None
    assert (again.services.bucket, again.services.s3_region) == ("mine", "eu-west-1")
    assert "s3cr3t-value" not in saved.read_text()
