#!/bin/sh
# Prints the Kafka client settings of the `admin` super user on the BROKER listener
# (kafka:9094, SASL PLAIN over TLS): for kafka's healthcheck and kafka-init.
set -eu
printf '%s\n' "security.protocol=SASL_SSL" "sasl.mechanism=PLAIN" \
  "ssl.truststore.type=PEM" "ssl.truststore.location=/certs/ca.crt" \
  "sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username=\"admin\" password=\"${HETERORL_KAFKA_ADMIN_PASSWORD:?}\";"
