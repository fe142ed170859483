"""The Lua scripts of the Redis ledger (redis_store.py): each step of a request's life in the
ledger is one script, so that it is atomic across every gateway replica, and one round trip.
They run by their hash (`run`)."""

from __future__ import annotations

import functools
import hashlib

import redis.exceptions

# Quota counters: KEYS[1..4] = image tokens, total tokens (of the period), requests (of the
# minute), large images (at once), KEYS[5] = the period counters' epoch (set when they were
# started from what is metered); ARGV[1..3] = the ask (image, total, large), ARGV[4..7] the
# limits (-1: none). The journal: KEYS[6..8] = entries, heartbeats, and the epoch each
# reservation was made in; ARGV[8..10] = request id, entry, beat ('' when the request is not
# journaled here). ARGV[11] = '1' when reserving. Spend: KEYS[9] = the period's spend hash
# (micro-units: field 'tenant', and 'k<id>' per key), ARGV[12] = the ask's worst-case cost,
# ARGV[13] the tenant's budget (-1: none), ARGV[14] the key's field, ARGV[15] its budget.
ADMIT = """
local function over(key, ask, limit)
  if tonumber(limit) < 0 then return false end
  return tonumber(redis.call('GET', key) or '0') + tonumber(ask) > tonumber(limit)
end
local function spent_over(field, ask, limit)
  if tonumber(limit) < 0 then return false end
  return tonumber(redis.call('HGET', KEYS[9], field) or '0') + tonumber(ask) > tonumber(limit)
end
if ARGV[11] == '1' then
  local epoch = redis.call('GET', KEYS[5])
  if not epoch or redis.call('EXISTS', KEYS[9]) == 0 then return -1 end
  if over(KEYS[1], ARGV[1], ARGV[4]) then return 1 end
  if over(KEYS[2], ARGV[2], ARGV[5]) then return 2 end
  if over(KEYS[3], 1, ARGV[6]) then return 3 end
  if ARGV[3] == '1' and over(KEYS[4], 1, ARGV[7]) then return 4 end
  if spent_over('tenant', ARGV[12], ARGV[13]) then return 5 end
  if spent_over(ARGV[14], ARGV[12], ARGV[15]) then return 6 end
  redis.call('INCRBY', KEYS[1], ARGV[1])
  redis.call('INCRBY', KEYS[2], ARGV[2])
  redis.call('INCR', KEYS[3])
  redis.call('EXPIRE', KEYS[3], 120)
  if ARGV[3] == '1' then
    redis.call('INCR', KEYS[4])
    redis.call('EXPIRE', KEYS[4], 3600)
  end
  redis.call('HINCRBY', KEYS[9], 'tenant', ARGV[12])
  redis.call('HINCRBY', KEYS[9], ARGV[14], ARGV[12])
  redis.call('HSET', KEYS[8], ARGV[8], epoch)
end
if ARGV[9] ~= '' then
  redis.call('HSET', KEYS[6], ARGV[8], ARGV[9])
  redis.call('HSET', KEYS[7], ARGV[8], ARGV[10])
end
return 0
"""
# Starting a period's counters from what is metered, once: KEYS = image, total, epoch, spend;
# ARGV = image, total, a new epoch, the time to live, then the spend hash's fields and values.
# Counters already started are kept (spend started on its own when only it is missing).
SEED = """
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[4])
  redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[4])
  redis.call('SET', KEYS[3], ARGV[3], 'EX', ARGV[4])
  redis.call('DEL', KEYS[4])
end
if redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[4], ARGV[4])
return 1
"""
# Settling a reservation to what was used. Made in the counters' epoch: the difference is
# applied. Made before they were started again (Redis lost them meanwhile, and the new ones,
# counted from what was metered, do not hold it): what was used is added. No counters: left
# to be started from what is metered, with this request in it. Spend likewise, in the
# tenant's field and the key's.
SETTLE_FUNCTION = """
local function settle(image_key, total_key, large_key, epoch_key, epochs, spend_key, id, image_delta, total_delta,
                      image_used, total_used, large, key_field, cost_delta, cost_used)
  local reserved = redis.call('HGET', epochs, id)
  redis.call('HDEL', epochs, id)
  local current = redis.call('GET', epoch_key)
  if current then
    local same = reserved == current
    redis.call('INCRBY', image_key, same and image_delta or image_used)
    redis.call('INCRBY', total_key, same and total_delta or total_used)
    if redis.call('EXISTS', spend_key) == 1 then
      redis.call('HINCRBY', spend_key, 'tenant', same and cost_delta or cost_used)
      redis.call('HINCRBY', spend_key, key_field, same and cost_delta or cost_used)
    end
  end
  if large == '1' and reserved and tonumber(redis.call('GET', large_key) or '0') > 0 then
    redis.call('DECR', large_key)
  end
end
"""
SETTLE = SETTLE_FUNCTION + """
settle(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6],
       ARGV[7], ARGV[8], ARGV[9])
return 0
"""
# KEYS = entries, heartbeats, the usage stream, the request's reaped mark, then the six keys
# to settle (or ''); ARGV = request id, '1' if journaled, the usage, '1' to settle, its nine
# arguments, and the beat the reaper judged stale ('' from the gateway: a beat refreshed
# since means its gateway lives). An entry already gone was recorded by the reaper (its mark
# says so) or went with Redis (a restart): then the usage is handed over still.
FINISH = SETTLE_FUNCTION + """
local reaping = ARGV[14] ~= ''
if reaping and redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[14] then return 0 end
local held = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if held == 0 and ARGV[2] == '1' and (reaping or redis.call('EXISTS', KEYS[4]) == 1) then return 0 end
redis.call('XADD', KEYS[3], '*', 'record', ARGV[3])
if reaping then redis.call('SET', KEYS[4], '1', 'EX', 86400) end
if ARGV[4] == '1' then settle(KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], ARGV[5], ARGV[6], ARGV[7],
                              ARGV[8], ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[13]) end
return 1
"""
BEAT = """
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
end
return 0
"""
# One request of a key this minute, if it is under its limit: KEYS[1] the minute's counter,
# ARGV[1] the limit. Returns 1 when counted, 0 when refused.
KEY_RATE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if used >= tonumber(ARGV[1]) then return 0 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], 120)
return 1
"""
KEY_RATE_RETURN = """
if tonumber(redis.call('GET', KEYS[1]) or '0') > 0 then redis.call('DECR', KEYS[1]) end
return 0
"""


# What a key's requests cost before admission. KEYS: the tenant's and the key's requests of
# the minute, the key's intake CPU (ms) and body bytes of the window; ARGV[1..4] their limits
# in those windows (-1: none). Which is reached (1..4), or 0, and then ARGV[5] bytes counted.
INTAKE_OVER = """
for i = 1, 4 do
  local limit = tonumber(ARGV[i])
  if limit >= 0 and tonumber(redis.call('GET', KEYS[i]) or '0') >= limit then return i end
end
if tonumber(ARGV[5]) > 0 and tonumber(ARGV[4]) >= 0 then
  redis.call('INCRBY', KEYS[4], ARGV[5])
  redis.call('EXPIRE', KEYS[4], 30)
end
return 0
"""
# Counting it: ARGV[5] the CPU milliseconds, ARGV[6] the body bytes, ARGV[7] '1' when the
# request counts as one of the minute's (refused at intake: admission never counted it).
INTAKE_CHARGE = """
for i = 3, 4 do
  if tonumber(ARGV[i + 2]) > 0 and tonumber(ARGV[i]) >= 0 then
    redis.call('INCRBY', KEYS[i], ARGV[i + 2])
    redis.call('EXPIRE', KEYS[i], 30)
  end
end
if ARGV[7] == '1' then
  for i = 1, 2 do
    if tonumber(ARGV[i]) >= 0 then
      redis.call('INCR', KEYS[i])
      redis.call('EXPIRE', KEYS[i], 120)
    end
  end
end
return 0
"""


@functools.cache
def sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


async def run(client, script: str, numkeys: int, *args):
    """Run a script by its hash (EVALSHA), sending its text only when Redis does not have it
    (first use, or a Redis that restarted): every request runs two or three of them, and
    sending each one's text every time was most of the bytes the gateway wrote to Redis."""
    try:
        return await client.evalsha(sha(script), numkeys, *args)
    except redis.exceptions.NoScriptError:
        return await client.eval(script, numkeys, *args)  # which also caches it in Redis
