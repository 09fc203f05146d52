#!/bin/sh
# One-shot for docker-compose.yml (minio/mc image): the checkpoint bucket, and one MinIO user
# per role with its own policy. Samplers may list the bucket and read objects; the learner may
# also write and delete them. Idempotent: safe on every `docker compose up`.
set -eu
umask 077
mkdir -p "$HOME/.mc/certs/CAs" && cp /certs/ca.crt "$HOME/.mc/certs/CAs/heterorl-ca.crt"
mc alias set heterorl https://minio:9000 "${MINIO_ROOT_USER:?}" "${MINIO_ROOT_PASSWORD:?}"
mc mb --ignore-existing "heterorl/${HETERORL_S3_BUCKET:?}"

BUCKET="arn:aws:s3:::$HETERORL_S3_BUCKET"
cat > /tmp/sampler.json <<JSON
{"Version": "2012-10-17", "Statement": [
  {"Effect": "Allow", "Action": ["s3:GetBucketLocation", "s3:ListBucket"], "Resource": ["$BUCKET"]},
  {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": ["$BUCKET/*"]}]}
JSON
cat > /tmp/learner.json <<JSON
{"Version": "2012-10-17", "Statement": [
  {"Effect": "Allow", "Action": ["s3:GetBucketLocation", "s3:ListBucket", "s3:ListBucketMultipartUploads"],
   "Resource": ["$BUCKET"]},
  {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                                 "s3:ListMultipartUploadParts"], "Resource": ["$BUCKET/*"]}]}
JSON

role() {  # role NAME ACCESS_KEY SECRET_KEY
  mc admin policy create heterorl "heterorl-$1" "/tmp/$1.json"
  mc admin user add heterorl "$2" "$3"
  # attach fails when the policy is attached already (a rerun): then check that it is.
  mc admin policy attach heterorl "heterorl-$1" --user "$2" 2>/dev/null \
    || mc admin user info heterorl "$2" | grep -q "heterorl-$1"
}
role sampler "${S3_SAMPLER_ACCESS_KEY:?}" "${S3_SAMPLER_SECRET_KEY:?}"
role learner "${S3_LEARNER_ACCESS_KEY:?}" "${S3_LEARNER_SECRET_KEY:?}"
echo "bucket $HETERORL_S3_BUCKET and users for sampler, learner ready"
