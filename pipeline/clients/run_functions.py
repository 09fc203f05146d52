"""The Redis functions every write of a sampler goes through (a library named `heterorl`).

Why functions: what a sampler writes is shared by the whole run (the prompt claims, the
re-issue queue, the fleet's leases), and samplers may be strangers. A sampler that could write
those keys directly could push garbage into the re-issue queue (an honest sampler crashed
reading `abc` as a prompt index), push one prompt 3,000 times (everybody then worked on that
prompt), hold 100,000 claims under a lease that never expires, store 200 MB values, or run
`EVAL "while true do end"` and block Redis for everyone. So:

- a sampler's every write is one of the functions below, which validate their arguments
  (ids, sizes, counts, integers), bound what one sampler may hold, set every lease's expiry
  themselves, and act only for the process that holds the sampler id (its **token**, below);
- no role but the admin may run scripts of its own (no EVAL): the learner loads this library
  (`ensure_loaded`, FUNCTION LOAD), everyone else only calls it (FCALL);
- strangers reach Redis only through the Redis gate (`infra/redis_gate.py`), which lets through
  reads of their run's keys and calls of these functions with their run's keys, nothing else.
  Redis ACLs alone cannot do it: the commands a function runs are checked against the
  caller's permissions, so a user allowed to call a function that writes a key may write it.

**Tokens.** A sampler proves it holds its id with a secret token, derived from its signing key
(`sampler_token`), so the same sampler restarted has the same token. Its first heartbeat binds
the id to the token's SHA-1 for the run (`sampler_owners`); from then on only that token renews
or releases the lease, claims under the id (and only while the lease lives), completes its
claims, reports its discards or records its stats. Another process or key naming the same id is
refused ("held with another token").

Limits (a stranger's worst case, with `MAX_SAMPLERS` ids; the Redis gate allows an invite
fewer): a lease of at most `MAX_FIELDS` fields of `MAX_FIELD_BYTES`, its last info and stats of
at most `MAX_JSON_BYTES` each, a lease time of at most `MAX_TTL_MS`, at most `MAX_BATCH` prompts
claimed and `MAX_CALL_INDICES` completed per call, `MAX_OWNER_CLAIMS` claims held by one
sampler, a join request of at most `MAX_JSON_BYTES` and a stream of at most `MAX_JOIN_REQUESTS`
of them, a sweep token held at most `MAX_SWEEP_MS`.

Keys are passed as KEYS (so the ACL and the gate check them), those of `FUNCTION_KEYS` in its
order and of one run, the lease being the named sampler's own: a function refuses any other. Errors are replies starting `HETERORL `; `RunState` raises them as
`RunStateRefused`, one line each.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Optional

import redis

LIBRARY = "heterorl"
MAX_ID_CHARS = 128
MAX_TTL_MS = 600_000
MAX_FIELDS = 64
MAX_FIELD_BYTES = 256
MAX_JSON_BYTES = 16_384
MAX_BATCH = 1024
MAX_OWNER_CLAIMS = 1024
MAX_SAMPLERS = 10_000
MAX_JOIN_REQUESTS = 10_000
MAX_CALL_INDICES = 128
"""Prompt indices per `hr_complete` / `hr_reissue` call (RunState splits longer lists): what the
Redis gate's argument limit for a stranger lets through."""
MAX_SWEEP_MS = 60_000
"""The longest a sweep token holds (`hr_sweep_due`)."""

FUNCTION_KEYS = {
    "hr_version": (),
    "hr_heartbeat": ("sampler:*", "samplers_seen", "sampler_last", "sampler_owners"),
    "hr_release": ("sampler:*", "samplers_seen", "sampler_last", "sampler_owners"),
    "hr_record_stats": ("sampler_owners", "sampler_stats"),
    "hr_claim": ("sampler:*", "reissue", "prompt_cursor", "claims", "claim_stats", "claim_counts", "sampler_owners"),
    "hr_complete": ("sampler_owners", "claims", "claim_stats", "reissue", "claim_counts", "reissued_from",
                    "completed_by"),
    "hr_reissue": ("claims", "reissue", "claim_stats", "sampler:*", "claim_counts", "reissued_from"),
    "hr_sweep_due": ("claims_sweep",),
    "hr_discarded": ("sampler_owners", "claim_stats", "completed_by", "discarded_by"),
    "hr_epoch_size": ("meta",),
    "hr_join_request": ("join_requests",),
    "hr_judged": ("sampler_owners", "judged_by"),
}
"""The keys (under `heterorl:<run>:`) each function takes, in order; `sampler:*` is the lease of the
sampler the call names (its id, or the owner whose claims are re-issued). The functions refuse any
other keys, and the gate's grants are made from this table too (`infra.access`)."""

_LUA_KEYS = ",\n".join(f"  {name} = {{{', '.join(repr(k) for k in keys)}}}" for name, keys in FUNCTION_KEYS.items())

_BODY = f"""#!lua name={LIBRARY}
-- heterorl run-state functions, version @VERSION@ (pipeline/clients/run_functions.py says why)
local MAX_ID, MAX_TTL_MS, MAX_FIELDS, MAX_FIELD_BYTES = {MAX_ID_CHARS}, {MAX_TTL_MS}, {MAX_FIELDS}, {MAX_FIELD_BYTES}
local MAX_JSON, MAX_BATCH, MAX_OWNER_CLAIMS = {MAX_JSON_BYTES}, {MAX_BATCH}, {MAX_OWNER_CLAIMS}
local MAX_SAMPLERS, MAX_JOIN, MAX_INDICES, MAX_SWEEP_MS = {MAX_SAMPLERS}, {MAX_JOIN_REQUESTS}, {MAX_CALL_INDICES}, {MAX_SWEEP_MS}
local KEYS_OF = {{
{_LUA_KEYS}
}}

local function refuse(why) return redis.error_reply('HETERORL ' .. why) end

local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end

local function valid_id(id)
  return type(id) == 'string' and #id >= 1 and #id <= MAX_ID and string.find(id, '^[%w][%w_%.:%-]*$') ~= nil
end

local function index_of(text)  -- a prompt index: digits only, below 2^53
  if type(text) ~= 'string' or #text == 0 or #text > 15 or string.find(text, '^%d+$') == nil then return nil end
  return text
end

local function integer(text, low, high)
  local n = tonumber(text)
  if n == nil or n ~= math.floor(n) or n < low or n > high then return nil end
  return n
end

local function json_object(text)
  if type(text) ~= 'string' or #text > MAX_JSON then return nil end
  local ok, value = pcall(cjson.decode, text)
  if not ok or type(value) ~= 'table' then return nil end
  return value
end

-- nil if `keys` are the keys function `name` takes (KEYS_OF), all of one run: `<prefix><key>`,
-- where `sampler:*` is `sampler:<id>`. So a caller can name neither another sampler's lease
-- (and claim, or re-issue an owner's claims, under a lease that is not theirs) nor another run's keys.
local function wrong_keys(name, keys, id)
  local names = KEYS_OF[name]
  local last, tail = names[#names], keys[#names]
  if #keys ~= #names or type(tail) ~= 'string' or #tail <= #last or string.sub(tail, -#last) ~= last then
    return name .. ' takes the keys ' .. table.concat(names, ', ') .. ' of one run, in this order'
  end
  local prefix = string.sub(tail, 1, #tail - #last)
  for i, key in ipairs(names) do
    if key == 'sampler:*' then
      if not valid_id(id) then return 'sampler id must be 1-' .. MAX_ID .. ' letters, digits, _ . : -' end
      key = 'sampler:' .. id
    end
    if keys[i] ~= prefix .. key then return name .. ': key ' .. i .. ' must be ' .. prefix .. key end
  end
  return nil
end

-- nil if the caller may act for `id`: `token` is the one `id` was first held with (`owners`:
-- id -> SHA-1 of its token, kept for the run); `bind`: a first heartbeat (or release) binds it.
local function not_owner(owners, id, token, bind)
  if not valid_id(id) then return 'sampler id must be 1-' .. MAX_ID .. ' letters, digits, _ . : -' end
  if type(token) ~= 'string' or #token < 16 or #token > 256 then return 'a token of 16-256 characters is needed' end
  local want = redis.sha1hex(token)
  local have = redis.call('HGET', owners, id)
  if have == false then
    if not bind then return 'sampler ' .. id .. ' never held a lease (heartbeat first)' end
    if redis.call('HLEN', owners) >= MAX_SAMPLERS then return 'this run has seen ' .. MAX_SAMPLERS .. ' sampler ids' end
    redis.call('HSET', owners, id, want)
    return nil
  end
  if have ~= want then return 'sampler id ' .. id .. ' is held with another token (another process or key): choose another id' end
  return nil
end

-- KEYS: sampler:<id>, samplers_seen, sampler_last, sampler_owners
-- ARGV: id, token, ttl_ms, last_json, field, value, ...
local function heartbeat(keys, args)
  local id, token = args[1], args[2]
  local why = wrong_keys('hr_heartbeat', keys, id) or not_owner(keys[4], id, token, true)
  if why then return refuse(why) end
  local ttl = integer(args[3], 1, MAX_TTL_MS)
  if ttl == nil then return refuse('lease time must be 1-' .. MAX_TTL_MS .. ' ms') end
  local last = json_object(args[4])
  if last == nil then return refuse('last info must be a JSON object of at most ' .. MAX_JSON .. ' bytes') end
  local nfields = (#args - 4) / 2
  if nfields ~= math.floor(nfields) or nfields > MAX_FIELDS then
    return refuse('at most ' .. MAX_FIELDS .. ' lease fields, as name value pairs')
  end
  local now = now_s()
  local fields = {{}}
  for k = 5, #args, 2 do
    local name, value = args[k], args[k + 1]
    if #name > MAX_FIELD_BYTES or #value > MAX_FIELD_BYTES or name == 'heartbeat_at' then
      return refuse('lease field ' .. string.sub(name, 1, 40) .. ': at most ' .. MAX_FIELD_BYTES .. ' bytes, not heartbeat_at')
    end
    fields[#fields + 1] = name
    fields[#fields + 1] = value
  end
  redis.call('DEL', keys[1])  -- the fields of this heartbeat only, as a sampler says them
  redis.call('HSET', keys[1], 'heartbeat_at', string.format('%.6f', now), unpack(fields))
  redis.call('PEXPIRE', keys[1], ttl)
  redis.call('ZADD', keys[2], now, id)
  last['heartbeat_at'] = now
  last['lease_ttl_s'] = ttl / 1000
  redis.call('HSET', keys[3], id, cjson.encode(last))
  return 1
end

-- KEYS: sampler:<id>, samplers_seen, sampler_last, sampler_owners; ARGV: id, token, reason
local function release(keys, args)
  local id, token = args[1], args[2]
  local why = wrong_keys('hr_release', keys, id) or not_owner(keys[4], id, token, true)
  if why then return refuse(why) end
  local now = now_s()
  local last = json_object(redis.call('HGET', keys[3], id) or '{{}}') or {{}}
  last['released_at'] = now
  last['release_reason'] = string.sub(args[3] or 'stopped', 1, 200)
  redis.call('HSET', keys[3], id, cjson.encode(last))
  redis.call('ZADD', keys[2], now, id)
  redis.call('DEL', keys[1])
  return 1
end

-- KEYS: sampler_owners, sampler_stats; ARGV: id, token, stats_json
local function record_stats(keys, args)
  local why = wrong_keys('hr_record_stats', keys) or not_owner(keys[1], args[1], args[2], false)
  if why then return refuse(why) end
  if json_object(args[3]) == nil then return refuse('stats must be a JSON object of at most ' .. MAX_JSON .. ' bytes') end
  redis.call('HSET', keys[2], args[1], args[3])
  return 1
end

-- The fleet's claims in flight, each sampler's counted up to `allowance` (a batch): one that holds
-- more (claims and never delivers) holds back the fleet's pacing no more than one sampler does.
local function in_flight(counts, allowance)
  local flat, total = redis.call('HGETALL', counts), 0
  for k = 2, #flat, 2 do total = total + math.min(tonumber(flat[k]) or 0, allowance) end
  return total
end

-- KEYS: sampler:<id>, reissue, prompt_cursor, claims, claim_stats, claim_counts, sampler_owners
-- ARGV: id, token, count, fleet limit ('' for none), allowance per sampler
-- Only under a live lease. Re-issued indices first (an epoch's holes are filled before moving
-- on), then fresh ones.
local function claim(keys, args)
  local id, token = args[1], args[2]
  local why = wrong_keys('hr_claim', keys, id) or not_owner(keys[7], id, token, false)
  if why then return refuse(why) end
  if redis.call('EXISTS', keys[1]) == 0 then return refuse('sampler ' .. id .. ' holds no lease (heartbeat first)') end
  local count = integer(args[3], 1, MAX_BATCH)
  if count == nil then return refuse('claim 1-' .. MAX_BATCH .. ' prompts at a time') end
  local held = tonumber(redis.call('HGET', keys[6], id) or '0')
  count = math.min(count, MAX_OWNER_CLAIMS - held)
  if args[4] ~= nil and args[4] ~= '' then
    local limit = integer(args[4], 0, 1e15)
    local allowance = integer(args[5], 1, MAX_BATCH)
    if limit == nil or allowance == nil then return refuse('a fleet limit needs a non-negative integer and an allowance of 1-' .. MAX_BATCH) end
    count = math.min(count, limit - in_flight(keys[6], allowance))
  end
  local out = {{}}
  if count <= 0 then return out end
  while #out < count do
    local index = redis.call('LPOP', keys[2])
    if not index then break end
    out[#out + 1] = index
  end
  local fresh = count - #out
  if fresh > 0 then
    local stop = redis.call('INCRBY', keys[3], fresh)
    for index = stop - fresh, stop - 1 do out[#out + 1] = string.format('%d', index) end
  end
  for _, index in ipairs(out) do redis.call('HSET', keys[4], index, id) end
  redis.call('HINCRBY', keys[5], 'claimed', count)
  redis.call('HINCRBY', keys[6], id, count)
  return out
end

-- KEYS: sampler_owners, claims, claim_stats, reissue, claim_counts, reissued_from, completed_by
-- ARGV: id, token, index...
-- Only the current owner completes: an index re-issued to someone else stays theirs. A late
-- completion of an index still waiting in the re-issue queue withdraws it from the queue (the
-- work is done), but only for the sampler it was taken from. `completed_by`: each sampler's
-- completions, which the fleet's pacing counts against the learner's `judged_by` per sampler.
local function complete(keys, args)
  local id, token = args[1], args[2]
  local why = wrong_keys('hr_complete', keys) or not_owner(keys[1], id, token, false)
  if why then return refuse(why) end
  if #args - 2 > MAX_INDICES then return refuse('complete at most ' .. MAX_INDICES .. ' prompts at a time') end
  local removed, late, withdrawn = 0, 0, 0
  for k = 3, #args do
    local index = index_of(args[k])
    if index == nil then return refuse('prompt indices are non-negative integers') end
    if redis.call('HGET', keys[2], index) == id then
      redis.call('HDEL', keys[2], index)
      removed = removed + 1
    else
      late = late + 1
      if redis.call('HGET', keys[6], index) == id then
        withdrawn = withdrawn + redis.call('LREM', keys[4], 1, index)
        redis.call('HDEL', keys[6], index)
      end
    end
  end
  if removed > 0 then
    redis.call('HINCRBY', keys[3], 'completed', removed)
    redis.call('HINCRBY', keys[7], id, removed)
    if redis.call('HINCRBY', keys[5], id, -removed) <= 0 then redis.call('HDEL', keys[5], id) end
  end
  if late > 0 then redis.call('HINCRBY', keys[3], 'late_completions', late) end
  if withdrawn > 0 then redis.call('HINCRBY', keys[3], 'reissue_withdrawn', withdrawn) end
  return removed
end

-- KEYS: claims, reissue, claim_stats, sampler:<owner>, claim_counts, reissued_from; ARGV: owner, index...
-- Moves the owner's claims to the re-issue queue only if its lease is gone *now* (leases always
-- expire: only `heartbeat` writes them) and each index is still the owner's: each moved once.
local function reissue(keys, args)
  local owner = args[1]
  local why = wrong_keys('hr_reissue', keys, owner)
  if why then return refuse(why) end
  if redis.call('EXISTS', keys[4]) == 1 then return {{}} end
  if #args - 1 > MAX_INDICES then return refuse('re-issue at most ' .. MAX_INDICES .. ' prompts at a time') end
  local moved = {{}}
  for k = 2, #args do
    local index = index_of(args[k])
    if index ~= nil and redis.call('HGET', keys[1], index) == owner then
      redis.call('HDEL', keys[1], index)
      redis.call('RPUSH', keys[2], index)
      redis.call('HSET', keys[6], index, owner)
      moved[#moved + 1] = index
    end
  end
  if #moved > 0 then
    redis.call('HINCRBY', keys[3], 'reissued', #moved)
    if redis.call('HINCRBY', keys[5], owner, -#moved) <= 0 then redis.call('HDEL', keys[5], owner) end
  end
  return moved
end

-- KEYS: claims_sweep; ARGV: every_ms (at most MAX_SWEEP_MS). 1 for one caller per interval across
-- the fleet; the learner sweeps on its own clock as well, so whoever takes the token and never
-- sweeps delays nothing for long.
local function sweep_due(keys, args)
  local why = wrong_keys('hr_sweep_due', keys)
  if why then return refuse(why) end
  local every = integer(args[1], 1, MAX_SWEEP_MS)
  if every == nil then return refuse('the sweep interval must be 1-' .. MAX_SWEEP_MS .. ' ms') end
  if redis.call('SET', keys[1], '1', 'NX', 'PX', every) then return 1 end
  return 0
end

-- KEYS: sampler_owners, claim_stats, completed_by, discarded_by; ARGV: id, token, count
-- Groups a sampler completed and then dropped from its spool as too stale to send: counted up to
-- what it completed (a sampler cannot discard more than it made).
local function discarded(keys, args)
  local why = wrong_keys('hr_discarded', keys) or not_owner(keys[1], args[1], args[2], false)
  if why then return refuse(why) end
  local count = integer(args[3], 1, MAX_BATCH)
  if count == nil then return refuse('discard 1-' .. MAX_BATCH .. ' groups at a time') end
  local made = tonumber(redis.call('HGET', keys[3], args[1]) or '0')
  local gone = tonumber(redis.call('HGET', keys[4], args[1]) or '0')
  count = math.max(0, math.min(count, made - gone))
  if count > 0 then
    redis.call('HINCRBY', keys[2], 'discarded_at_source', count)
    redis.call('HINCRBY', keys[4], args[1], count)
  end
  return count
end

-- KEYS: meta; ARGV: epoch_size. Recorded once (for `heterorl status`).
local function epoch_size(keys, args)
  local why = wrong_keys('hr_epoch_size', keys)
  if why then return refuse(why) end
  local size = integer(args[1], 1, 1e15)
  if size == nil then return refuse('the epoch size must be a positive integer') end
  redis.call('HSETNX', keys[1], 'epoch_size', string.format('%d', size))
  return 1
end

-- KEYS: join_requests; ARGV: request_json
local function join_request(keys, args)
  local why = wrong_keys('hr_join_request', keys)
  if why then return refuse(why) end
  if json_object(args[1]) == nil then return refuse('a join request is a JSON object of at most ' .. MAX_JSON .. ' bytes') end
  return redis.call('XADD', keys[1], 'MAXLEN', '~', MAX_JOIN, '*', 'request', args[1])
end

-- KEYS: sampler_owners, judged_by; ARGV: id, count, id, count...  (the learner's: not a sampler's)
-- Groups the learner judged, by the sampler id their seal names; ids that never held a lease are
-- left out (a forged id would only grow the hash).
local function judged(keys, args)
  local why = wrong_keys('hr_judged', keys)
  if why then return refuse(why) end
  local counted = 0
  for k = 1, #args - 1, 2 do
    local count = integer(args[k + 1], 1, 1e9)
    if count ~= nil and valid_id(args[k]) and redis.call('HEXISTS', keys[1], args[k]) == 1 then
      redis.call('HINCRBY', keys[2], args[k], count)
      counted = counted + count
    end
  end
  return counted
end

-- KEYS: the lease; ARGV: holder, ttl_ms. Take or renew it; 0 if another holds it.
local function hold(keys, args)
  local ttl = integer(args[2], 1, MAX_TTL_MS)
  if not valid_id(args[1]) or ttl == nil then return refuse('a holder id and a lease time of 1-' .. MAX_TTL_MS .. ' ms') end
  local holder = redis.call('GET', keys[1])
  if holder == false then redis.call('SET', keys[1], args[1], 'PX', ttl) return 1 end
  if holder == args[1] then redis.call('PEXPIRE', keys[1], ttl) return 1 end
  return 0
end

-- KEYS: the lease; ARGV: holder
local function let_go(keys, args)
  if redis.call('GET', keys[1]) == args[1] then redis.call('DEL', keys[1]) return 1 end
  return 0
end

-- KEYS: the lease, a hash; ARGV: holder, field, value. HSET only while `holder` holds the lease.
local function record_if_held(keys, args)
  if redis.call('GET', keys[1]) ~= args[1] then return 0 end
  redis.call('HSET', keys[2], args[2], args[3])
  return 1
end

redis.register_function('hr_version', function() return '@VERSION@' end)
redis.register_function('hr_heartbeat', heartbeat)
redis.register_function('hr_release', release)
redis.register_function('hr_record_stats', record_stats)
redis.register_function('hr_claim', claim)
redis.register_function('hr_complete', complete)
redis.register_function('hr_reissue', reissue)
redis.register_function('hr_sweep_due', sweep_due)
redis.register_function('hr_discarded', discarded)
redis.register_function('hr_epoch_size', epoch_size)
redis.register_function('hr_join_request', join_request)
redis.register_function('hr_judged', judged)
redis.register_function('hr_hold', hold)
redis.register_function('hr_let_go', let_go)
redis.register_function('hr_record_if_held', record_if_held)
"""

VERSION = hashlib.sha256(_BODY.encode()).hexdigest()[:12]
"""Of the library's text: a server holding another version (an older heterorl's) gets this one."""
SOURCE = _BODY.replace("@VERSION@", VERSION)

SAMPLER_FUNCTIONS = ("hr_version", "hr_heartbeat", "hr_release", "hr_record_stats", "hr_claim", "hr_complete",
                     "hr_reissue", "hr_sweep_due", "hr_discarded", "hr_epoch_size", "hr_join_request")
"""What a sampler calls; the Redis gate lets a stranger call these but `hr_epoch_size` (the
operator's own samplers record it), with its run's keys."""


class FunctionsMissing(RuntimeError):
    """The server has no (or another version of the) `heterorl` library; the learner loads it."""


def ensure_loaded(client: redis.Redis) -> bool:
    """Load this library unless the server has this version already; whether it loaded it. Needs a
    user allowed FUNCTION LOAD (the admin, or the learner's)."""
    if loaded_version(client) == VERSION:
        return False
    client.function_load(SOURCE, replace=True)
    return True


def loaded_version(client: redis.Redis) -> Optional[str]:
    """The version of the library the server has (None: none)."""
    try:
        return str(client.fcall("hr_version", 0))
    except redis.ResponseError as e:
        if "function not found" in str(e).lower():
            return None
        raise


def sampler_token(run: str, sampler_id: str, seed: Optional[bytes]) -> str:
    """The secret a sampler holds its id with: an HMAC of (run, id) under its signing key's seed, so a
    restarted sampler has the same one. A sampler without a key (signatures off: every sampler of such
    a run is trusted anyway) gets one anybody could compute."""
    message = f"heterorl redis token\0{run}\0{sampler_id}".encode()
    if seed is None:
        return hashlib.sha256(b"unsigned\0" + message).hexdigest()
    return hmac.new(seed, message, hashlib.sha256).hexdigest()
