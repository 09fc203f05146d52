#!/bin/sh
# One-shot for docker-compose.yml: Kafka's SCRAM-SHA-512 users `learner` and `sampler`, the
# run's rollout topic, and ACLs. A sampler may only Write and Describe the rollout topic; the
# learner may do anything with the run's topics (prefix `<run>.`: rollouts, updates, dead
# letters), which it creates and reads. Idempotent: safe on every `docker compose up`.
# Passwords: no commas, brackets or whitespace (kafka-configs' syntax).
set -eu
umask 077
CONFIG=/tmp/admin.properties
sh /heterorl-compose/kafka-admin-config.sh > "$CONFIG"
BIN=/opt/kafka/bin
SERVER=kafka:9094
RUN=${HETERORL_RUN:?}
TOPIC="$RUN.rollouts"

scram_user() {
  "$BIN/kafka-configs.sh" --bootstrap-server "$SERVER" --command-config "$CONFIG" --alter \
    --entity-type users --entity-name "$1" --add-config "SCRAM-SHA-512=[iterations=8192,password=$2]"
}
acl() { "$BIN/kafka-acls.sh" --bootstrap-server "$SERVER" --command-config "$CONFIG" --add "$@"; }

scram_user learner "${KAFKA_LEARNER_PASSWORD:?}"
scram_user sampler "${KAFKA_SAMPLER_PASSWORD:?}"
"$BIN/kafka-topics.sh" --bootstrap-server "$SERVER" --command-config "$CONFIG" --create --if-not-exists \
  --topic "$TOPIC" --partitions "${HETERORL_TOPIC_PARTITIONS:-1}" --config retention.ms=-1
acl --allow-principal User:sampler --operation Write --operation Describe --topic "$TOPIC"
acl --allow-principal User:learner --operation All --resource-pattern-type prefixed --topic "$RUN."
echo "kafka users learner, sampler and ACLs on $TOPIC ready"
