#!/bin/sh
# Redis of docker-compose.yml: TLS only, and one ACL user per role with its password from the
# environment (stored as sha256, never in argv). The rules are infra.access.redis_acl_rules
# for Redis >= 7 (a unit test keeps them equal): the default user is off; `learner` reads and
# writes heterorl:* without admin or dangerous commands, and loads the run functions
# (pipeline/clients/run_functions.py); `sampler` writes its lease, claims and counters through
# those functions (no script of its own) and only reads the policy pointer, the learner's
# progress and the key registry.
# Passwords: no whitespace.
set -eu
umask 077

hash() { printf %s "$1" | sha256sum | cut -d ' ' -f 1; }
COMMANDS="-@all +@connection +@read +@write +@transaction -@dangerous -@admin -@scripting +fcall +fcall_ro +time"
SAMPLER_KEYS="~heterorl:*:sampler:* ~heterorl:*:samplers_seen ~heterorl:*:sampler_last ~heterorl:*:sampler_stats \
~heterorl:*:sampler_owners ~heterorl:*:claims ~heterorl:*:reissue ~heterorl:*:prompt_cursor ~heterorl:*:claim_stats \
~heterorl:*:claim_counts ~heterorl:*:reissued_from ~heterorl:*:completed_by ~heterorl:*:discarded_by \
~heterorl:*:claims_sweep ~heterorl:*:meta ~heterorl:*:join_requests \
%R~heterorl:*:policy %R~heterorl:*:learner %R~heterorl:*:key_registry %R~heterorl:*:quarantine \
%R~heterorl:*:admissions %R~heterorl:*:used_by_sampler %R~heterorl:*:judged_by"

cat > /tmp/users.acl <<ACL
user default off
user admin on #$(hash "${REDIS_ADMIN_PASSWORD:?}") ~* &* +@all
user learner on #$(hash "${REDIS_LEARNER_PASSWORD:?}") resetkeys ~heterorl:* resetchannels $COMMANDS +function|load
user sampler on #$(hash "${REDIS_SAMPLER_PASSWORD:?}") resetkeys $SAMPLER_KEYS resetchannels $COMMANDS
ACL

exec redis-server --appendonly yes --aclfile /tmp/users.acl \
  --port 0 --tls-port 6379 --tls-auth-clients no \
  --tls-cert-file /certs/redis.crt --tls-key-file /certs/redis.key --tls-ca-cert-file /certs/ca.crt
