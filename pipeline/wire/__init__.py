"""What travels: the rollout schema and its msgpack codec, and Ed25519-signed documents."""
