#!/bin/sh
# Make a private CA and the server certificates docker-compose.yml mounts (openssl only).
#
#   infra/make_certs.sh [DIR] [EXTRA_HOST...]     # DIR defaults to ./certs
#
# EXTRA_HOST: names (or IPs) remote samplers use to reach this host, i.e. HETERORL_PUBLIC_HOST;
# every server certificate also names its compose service and localhost.
#
#   DIR/ca.crt, DIR/ca.key              the CA (ca.key 0600: keep it off the servers)
#   DIR/client/ca.crt                   what learner and samplers mount to check the servers
#   DIR/kafka/server.pem, ca.crt        Kafka's PEM keystore (PKCS#8 key + certificate)
#   DIR/redis/redis.crt, redis.key, ca.crt
#   DIR/minio/public.crt, private.key, CAs/ca.crt   (MinIO's --certs-dir layout)
#
# Server keys are 0644 so the containers' own users (kafka's appuser, redis, minio) can read
# the bind-mounted files; the directory is 0700 for everyone else on this host. Run it again
# with an existing ca.key to re-issue server certificates from the same CA.
set -eu

DIR=${1:-certs}
[ $# -gt 0 ] && shift
DAYS=${HETERORL_CERT_DAYS:-825}
mkdir -p "$DIR/client" "$DIR/kafka" "$DIR/redis" "$DIR/minio/CAs"
chmod 700 "$DIR"

if [ ! -f "$DIR/ca.key" ]; then
  openssl req -x509 -newkey rsa:3072 -nodes -sha256 -days "$DAYS" -subj "/CN=heterorl-ca" \
    -keyout "$DIR/ca.key" -out "$DIR/ca.crt" 2>/dev/null
  chmod 600 "$DIR/ca.key"
fi

# server NAME OUT_KEY OUT_CRT: a key and a certificate for the compose service NAME.
server() {
  san="DNS:$1,DNS:localhost,IP:127.0.0.1"
  for host in $EXTRA; do
    case "$host" in
      *[!0-9.]*) san="$san,DNS:$host" ;;
      *) san="$san,IP:$host" ;;
    esac
  done
  openssl req -newkey rsa:3072 -nodes -sha256 -subj "/CN=$1" -keyout "$2" -out "$2.csr" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$san" > "$2.ext"
  openssl x509 -req -in "$2.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" -CAcreateserial -days "$DAYS" \
    -sha256 -extfile "$2.ext" -out "$3" 2>/dev/null
  rm -f "$2.csr" "$2.ext"
  chmod 644 "$2" "$3"
}

EXTRA="$*"
server kafka "$DIR/kafka/server.key" "$DIR/kafka/server.crt"
openssl pkcs8 -topk8 -nocrypt -in "$DIR/kafka/server.key" -out "$DIR/kafka/server.pk8"
cat "$DIR/kafka/server.pk8" "$DIR/kafka/server.crt" > "$DIR/kafka/server.pem"
rm -f "$DIR/kafka/server.key" "$DIR/kafka/server.pk8" "$DIR/kafka/server.crt"
chmod 644 "$DIR/kafka/server.pem"
server redis "$DIR/redis/redis.key" "$DIR/redis/redis.crt"
server minio "$DIR/minio/private.key" "$DIR/minio/public.crt"
for sub in client kafka redis minio/CAs; do cp "$DIR/ca.crt" "$DIR/$sub/ca.crt"; done
rm -f "$DIR/ca.srl"
echo "certificates for kafka, redis, minio (and localhost${EXTRA:+, $EXTRA}) in $DIR/"
