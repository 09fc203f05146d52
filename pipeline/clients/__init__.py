"""The clients of the three servers: where they are (`services`), the Kafka topics (`topics`:
`TopicReader`, `TopicWriter`), the run's state in Redis (`run_state`: leases, claims,
positions), the samplers' on-disk spool (`spool`) and retries (`retry`). The servers
themselves are `infra/` (the local stack) or yours (docs/deployment.md)."""
