"""Fair intake: the broker's queues taken by tenant share, not by arrival (Flask- and torch-free; the publisher,
the workers' take and beat all use it).

Publishers keep pushing kombu messages onto each queue's list (LPUSH); a message carries `headers["fair"] =
[tenant, weight, deadline or null, estimated tokens]` (`meta()`). The take (TAKE, one Lua script, so atomic) first
moves what arrived on the lists into one sorted set per (lane, tenant), scored by deadline (EDF; none = +inf) with
an arrival sequence in the member (FIFO among equal deadlines), keeping the set of backlogged tenants per lane.
Then it picks the backlogged tenant with the least weighted service (tokens served / weight), pops its earliest
job and records it as unacked exactly as broker.py's FIFO take does (unacked hash, index, owner): ack, reject,
restore and restore_visible see a usual kombu message, and a restored message goes back to its list, to be sorted
in again at the next take.

Service is per (class, tenant), shared by every worker through Redis: the take charges a job's estimate at once
(so a take right after it sees it), the worker corrects it by the tokens actually served when the result is
written (`CHARGE`). It decays exponentially with the window's time constant, and a tenant that becomes backlogged
is lifted to the least weighted service among those already backlogged (VTC's counter lift), so an idle tenant
banks no credit and a newcomer does not monopolise the device. A lane is one of a class's queues: the shared one
or a worker's private one (prefix affinity); the take looks at a worker's lanes of a class together, preferring
the private lane's jobs of the tenant it picked.
"""
import math
import time

PREFIX = "tidepool:fair:"
WEIGHTS_KEY = PREFIX + "w"            # tenant -> weight (the last one its messages carried)
SEQ_KEY = PREFIX + "seq"              # arrival sequence
SEQ_DIGITS = 16                       # a member is the sequence, zero-padded, then the raw message


def backlog_key(lane: str) -> str:
    """The set of tenants with jobs waiting in `lane`."""
    return f"{PREFIX}b:{lane}"


def tenant_key(lane: str, tenant: str) -> str:
    """The sorted set of `tenant`'s jobs waiting in `lane`."""
    return f"{PREFIX}q:{lane}|{tenant}"


def service_keys(queue: str) -> tuple[str, str]:
    """(tenant -> service in tokens, tenant -> when it was last updated) of a class's shared queue."""
    return f"{PREFIX}s:{queue}", f"{PREFIX}t:{queue}"


def meta(tenant_id: str, weight: float | None, deadline, estimated_tokens: int | None) -> list:
    """The `fair` header of a job's message. deadline: a datetime (or None)."""
    return [tenant_id, float(weight or 1.0), None if deadline is None else round(deadline.timestamp(), 3),
            int(estimated_tokens or 1)]


_COMMON = """
local now = tonumber(ARGV[1])
local tau = tonumber(ARGV[3])
local function decayed(skey, tkey, t)
  local v = tonumber(redis.call('HGET', skey, t) or '0') or 0
  local at = tonumber(redis.call('HGET', tkey, t) or ARGV[1]) or now
  if now > at and tau > 0 then v = v * math.exp((at - now) / tau) end
  return v
end
local function weight(t)
  local w = tonumber(redis.call('HGET', KEYS[#KEYS - 1], t) or '1')
  if not w or w <= 0 then w = 1 end
  return w
end
"""

# KEYS: for each lane its lists (kombu's priority lists, ARGV[5] of them), then unacked, unacked_index, owners,
# service, service stamps, weights, sequence. ARGV: now, owner ('' for none), decay time constant, most messages to
# sort in, lists per lane, a JSON list of tenants not to pick (a worker's over-take for tenants under their share of
# its seats: workers/intake.py), then the lanes' names in order (a worker's private lane first).
TAKE = _COMMON + """
local owner, limit, p = ARGV[2], tonumber(ARGV[4]), tonumber(ARGV[5])
local nl = #ARGV - 6
local base = nl * p
local excluded = {}
for _, t in ipairs(cjson.decode(ARGV[6])) do excluded[t] = true end
local SKEY, TKEY, WKEY, QKEY = KEYS[base + 4], KEYS[base + 5], KEYS[base + 6], KEYS[base + 7]
local lanes, backlog = {}, {}
for j = 1, nl do
  lanes[j] = ARGV[6 + j]
  backlog[j] = 'tidepool:fair:b:' .. lanes[j]
end
local function backlogged_elsewhere(t, j)
  for k = 1, nl do
    if k ~= j and redis.call('SISMEMBER', backlog[k], t) == 1 then return true end
  end
  return false
end
local function lift(t, j)
  local least = nil
  for k = 1, nl do
    for _, o in ipairs(redis.call('SMEMBERS', backlog[k])) do
      if o ~= t then
        local v = decayed(SKEY, TKEY, o) / weight(o)
        if least == nil or v < least then least = v end
      end
    end
  end
  local own = decayed(SKEY, TKEY, t)
  if least ~= nil and least * weight(t) > own then own = least * weight(t) end
  redis.call('HSET', SKEY, t, own)
  redis.call('HSET', TKEY, t, ARGV[1])
end
-- 1. sort in what arrived on the lists, oldest first
for j = 1, nl do
  for i = 1, p do
    local list = KEYS[(j - 1) * p + i]
    while limit > 0 do
      local raw = redis.call('RPOP', list)
      if not raw then break end
      limit = limit - 1
      local tenant, score = '', '+inf'
      local ok, msg = pcall(cjson.decode, raw)
      if ok and type(msg) == 'table' and type(msg['headers']) == 'table' and type(msg['headers']['fair']) == 'table' then
        local f = msg['headers']['fair']
        if type(f[1]) == 'string' then tenant = f[1] end
        if type(f[2]) == 'number' and f[2] > 0 then redis.call('HSET', WKEY, tenant, f[2]) end
        if type(f[3]) == 'number' then score = f[3] end
      end
      local seq = redis.call('INCR', QKEY)
      redis.call('ZADD', 'tidepool:fair:q:' .. lanes[j] .. '|' .. tenant, score, string.format('%016d', seq) .. raw)
      if redis.call('SADD', backlog[j], tenant) == 1 and not backlogged_elsewhere(tenant, j) then lift(tenant, j) end
    end
  end
end
-- 2. the backlogged tenant with the least weighted service; ties: the earliest head (deadline, then arrival)
local best, bestv, besthead = nil, nil, nil
local seen = {}
local function head(t)
  local h = nil
  for j = 1, nl do
    local r = redis.call('ZRANGE', 'tidepool:fair:q:' .. lanes[j] .. '|' .. t, 0, 0, 'WITHSCORES')
    if r[1] then
      local key = {tonumber(r[2]) or math.huge, string.sub(r[1], 1, 16)}
      if h == nil or key[1] < h[1] or (key[1] == h[1] and key[2] < h[2]) then h = key end
    end
  end
  return h
end
for j = 1, nl do
  for _, t in ipairs(redis.call('SMEMBERS', backlog[j])) do
    if not seen[t] and not excluded[t] then
      seen[t] = true
      local v = decayed(SKEY, TKEY, t) / weight(t)
      if best == nil or v < bestv - 1e-9 then
        best, bestv, besthead = t, v, nil
      elseif v <= bestv + 1e-9 then
        if besthead == nil then besthead = head(best) end
        local h = head(t)
        if h ~= nil and (besthead == nil or h[1] < besthead[1] or (h[1] == besthead[1] and h[2] < besthead[2])) then
          best, bestv, besthead = t, v, h
        end
      end
    end
  end
end
if best == nil then return false end
-- 3. its earliest job, from its first lane that has one
local raw = nil
for j = 1, nl do
  local zkey = 'tidepool:fair:q:' .. lanes[j] .. '|' .. best
  local r = redis.call('ZPOPMIN', zkey)
  if r[1] then
    raw = string.sub(r[1], 17)
    if redis.call('EXISTS', zkey) == 0 then redis.call('SREM', backlog[j], best) end
    break
  else
    redis.call('SREM', backlog[j], best)
  end
end
if raw == nil then return false end
local msg = cjson.decode(raw)
local cost = 1
local hdr = msg['headers']
if type(hdr) == 'table' and type(hdr['fair']) == 'table' and type(hdr['fair'][4]) == 'number' then cost = hdr['fair'][4] end
redis.call('HSET', SKEY, best, decayed(SKEY, TKEY, best) + cost)
redis.call('HSET', TKEY, best, ARGV[1])
-- 4. unacked, as broker.py's FIFO take records it
local props = msg['properties']
local info = props['delivery_info']
if owner ~= '' then redis.call('HSET', KEYS[base + 3], props['delivery_tag'], owner) end
redis.call('ZADD', KEYS[base + 2], ARGV[1], props['delivery_tag'])
redis.call('HSET', KEYS[base + 1], props['delivery_tag'],
           '[' .. raw .. ',' .. cjson.encode(info['exchange']) .. ',' .. cjson.encode(info['routing_key']) .. ']')
return raw
"""

# KEYS: service, stamps, weights (unused), sequence (unused). ARGV: now, tenant, decay time constant, tokens
# (may be negative: the estimate charged at take corrected).
CHARGE = _COMMON + """
local v = decayed(KEYS[1], KEYS[2], ARGV[2]) + tonumber(ARGV[4])
if v < 0 then v = 0 end
redis.call('HSET', KEYS[1], ARGV[2], v)
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1])
return tostring(v)
"""

# Moves what waits in a lane's sorted sets (KEYS[1]: its backlog set) onto the consuming end of list KEYS[2],
# earliest first, in one step; ARGV[1]: the lane. Returns how many moved.
MOVE = """
local n = 0
for _, t in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local zkey = 'tidepool:fair:q:' .. ARGV[1] .. '|' .. t
  for _, m in ipairs(redis.call('ZRANGE', zkey, 0, -1)) do
    redis.call('RPUSH', KEYS[2], string.sub(m, 17))
    n = n + 1
  end
  redis.call('DEL', zkey)
end
redis.call('DEL', KEYS[1])
return n
"""


def charge(client, queue: str, tenant: str, tokens: float, window: float, now: float | None = None) -> float:
    """Add `tokens` (negative: a refund) to `tenant`'s decayed service in the class of shared queue `queue`."""
    skey, tkey = service_keys(queue)
    return float(client.eval(CHARGE, 4, skey, tkey, WEIGHTS_KEY, SEQ_KEY, time.time() if now is None else now,
                             tenant, window, tokens))


def move_lane(client, lane: str, to_list: str) -> int:
    """Hand what waits in `lane`'s sorted sets to the list `to_list` (a private lane handed back to its shared queue)."""
    return int(client.eval(MOVE, 2, backlog_key(lane), to_list, lane) or 0)


def _text(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def lane_backlogs(client, lanes=None) -> dict[str, dict[str, int]]:
    """lane -> {tenant: jobs waiting sorted in}; every lane with a backlog set when `lanes` is None."""
    if lanes is None:
        lanes = [_text(k)[len(PREFIX) + 2:] for k in client.scan_iter(match=PREFIX + "b:*", count=1000)]
    out: dict[str, dict[str, int]] = {}
    for lane in lanes:
        tenants = sorted(_text(t) for t in client.smembers(backlog_key(lane)))
        if not tenants:
            continue
        with client.pipeline(transaction=False) as pipe:
            for t in tenants:
                pipe.zcard(tenant_key(lane, t))
            counts = pipe.execute()
        out[lane] = {t: int(n) for t, n in zip(tenants, counts) if n}
    return out


def lane_depth(client, lane: str) -> int:
    """Jobs waiting in `lane`: on its list (not yet sorted in) and in its sorted sets."""
    return int(client.llen(lane)) + sum(lane_backlogs(client, [lane]).get(lane, {}).values())


def known_queues(client) -> list[str]:
    """The classes (shared queue names) with service counters."""
    return sorted(_text(k)[len(PREFIX) + 2:] for k in client.scan_iter(match=PREFIX + "s:*", count=1000))


def services(client, queue: str, window: float, now: float | None = None) -> dict[str, tuple[float, float]]:
    """tenant -> (decayed service in tokens, weight) for the class of shared queue `queue`."""
    now = time.time() if now is None else now
    skey, tkey = service_keys(queue)
    values, stamps = client.hgetall(skey), client.hgetall(tkey)
    weights = {_text(k): float(v) for k, v in client.hgetall(WEIGHTS_KEY).items()}
    out = {}
    for k, v in values.items():
        t = _text(k)
        at = float(stamps.get(k, now))
        decay = math.exp((at - now) / window) if now > at and window > 0 else 1.0
        out[t] = (float(v) * decay, weights.get(t, 1.0) or 1.0)
    return out
