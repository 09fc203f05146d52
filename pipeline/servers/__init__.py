"""The clients of Kafka, Redis and S3: service URLs, the rollout topic, run state in Redis, checkpoints, the on-disk spool, retries."""
