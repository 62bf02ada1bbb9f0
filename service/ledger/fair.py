"""Fair intake: the broker's queues taken by tenant share, not by arrival (Flask- and torch-free; the publisher,
the workers' take and beat all use it).

Publishers keep pushing kombu messages onto each queue's list (LPUSH); a message carries `headers["fair"] =
[tenant, weight, deadline or null, estimated tokens]` (`meta()`). The take (TAKE, one Lua script, so atomic) first
moves what arrived on the lists into one sorted set per (lane, tenant), scored by deadline (EDF; none = +inf) with
an arrival sequence in the member (FIFO among equal deadlines), keeping the set of backlogged tenants per lane.
Then it picks the backlogged tenant with the least weighted service (tokens served / weight; a sorted set per
lane keeps them in that order, so the pick costs O(log n) in backlogged tenants), pops its earliest job and
records it as unacked exactly as broker.py's FIFO take does (unacked hash, index, owner): ack, reject, restore
and restore_visible see a usual kombu message, and a restored message goes back to its list, to be sorted in
again at the next take.

Service is per (class, tenant), shared by every worker through Redis: the take charges a job's estimate at once
(so a take right after it sees it), the worker corrects it by the tokens actually served when the result is
written (`CHARGE`). It decays exponentially with the window's time constant, and a tenant that becomes backlogged
is lifted to the least weighted service among those already backlogged (VTC's counter lift), so an idle tenant
banks no credit and a newcomer does not monopolise the device. A lane is one of a class's queues: the shared one
or a worker's private one (prefix affinity); the take looks at a worker's lanes of a class together, preferring
the private lane's jobs of the tenant it picked.
"""
import hashlib
import math
import time

from redis.exceptions import NoScriptError

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


def weights_key(queue: str) -> str:
    """tenant -> weight for the class of shared queue `queue`: one hash for every class on one Redis server; on a
    Redis Cluster, where the queue's key carries a hash tag (service/ledger/cluster_queues.py), the class's own, on
    its slot, like every other key of its take."""
    return f"{PREFIX}w:{queue}" if queue.startswith("{") else WEIGHTS_KEY


def seq_key(queue: str) -> str:
    """The arrival sequence the take numbers `queue`'s messages with (per class on a cluster: weights_key)."""
    return f"{PREFIX}n:{queue}" if queue.startswith("{") else SEQ_KEY


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
-- Backlogged tenants are also kept per lane in a sorted set ('tidepool:fair:z:' .. lane) scored by weighted service
-- normalised to the class's origin time ('tidepool:fair:o:' .. queue): decayed service / weight x exp((now - origin)
-- / tau). Decay scales every tenant's service alike, so the order of these scores never changes with time, and the
-- pick is the set's first member (O(log n), not a pass over every backlogged tenant). Whatever changes a tenant's
-- service or weight rescores it in every lane of the class ('tidepool:fair:l:' .. queue); the origin moves up
-- (rescaling every score) once it is REBASE time constants old, so the scores stay far from overflow.
local REBASE = 20
local function class_of(skey) return string.sub(skey, string.len('tidepool:fair:s:') + 1) end
local function norm_factor(queue)
  if tau <= 0 then return 1 end
  local okey = 'tidepool:fair:o:' .. queue
  local origin = tonumber(redis.call('GET', okey) or '')
  if origin == nil or now - origin > REBASE * tau then     -- (a worker's clock a little behind: factor < 1, fine)
    local scale = 1
    if origin ~= nil then scale = math.exp((origin - now) / tau) end
    for _, lane in ipairs(redis.call('SMEMBERS', 'tidepool:fair:l:' .. queue)) do
      local zkey = 'tidepool:fair:z:' .. lane
      local all = redis.call('ZRANGE', zkey, 0, -1, 'WITHSCORES')
      for i = 1, #all, 2 do redis.call('ZADD', zkey, tonumber(all[i + 1]) * scale, all[i]) end
    end
    redis.call('SET', okey, ARGV[1])
    origin = now
  end
  return math.exp((now - origin) / tau)
end
local function rescore(skey, tkey, t)
  local queue = class_of(skey)
  local score = decayed(skey, tkey, t) / weight(t) * norm_factor(queue)
  for _, lane in ipairs(redis.call('SMEMBERS', 'tidepool:fair:l:' .. queue)) do
    redis.call('ZADD', 'tidepool:fair:z:' .. lane, 'XX', score, t)
  end
  return score
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
local queue = class_of(SKEY)
local lanes, backlog, zsets = {}, {}, {}
for j = 1, nl do
  lanes[j] = ARGV[6 + j]
  backlog[j] = 'tidepool:fair:b:' .. lanes[j]
  zsets[j] = 'tidepool:fair:z:' .. lanes[j]
  redis.call('SADD', 'tidepool:fair:l:' .. queue, lanes[j])
end
local factor = norm_factor(queue)
local function tscore(t) return decayed(SKEY, TKEY, t) / weight(t) * factor end
for j = 1, nl do      -- a backlog sorted in before the sets existed (or by hand): scored from the counters
  if redis.call('ZCARD', zsets[j]) ~= redis.call('SCARD', backlog[j]) then
    redis.call('DEL', zsets[j])
    for _, t in ipairs(redis.call('SMEMBERS', backlog[j])) do redis.call('ZADD', zsets[j], tscore(t), t) end
  end
end
local function backlogged_elsewhere(t, j)
  for k = 1, nl do
    if k ~= j and redis.call('SISMEMBER', backlog[k], t) == 1 then return true end
  end
  return false
end
local function lift(t)
  -- a tenant backlogged again starts level with the least served of those backlogged (VTC's counter lift)
  local least = nil
  for k = 1, nl do
    local first = redis.call('ZRANGE', zsets[k], 0, 0, 'WITHSCORES')
    if first[2] ~= nil and (least == nil or tonumber(first[2]) < least) then least = tonumber(first[2]) end
  end
  local own = decayed(SKEY, TKEY, t)
  if least ~= nil and least / factor * weight(t) > own then own = least / factor * weight(t) end
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
        if type(f[2]) == 'number' and f[2] > 0 and tonumber(redis.call('HGET', WKEY, tenant) or '') ~= f[2] then
          redis.call('HSET', WKEY, tenant, f[2])
          rescore(SKEY, TKEY, tenant)
        end
        if type(f[3]) == 'number' then score = f[3] end
      end
      local seq = redis.call('INCR', QKEY)
      redis.call('ZADD', 'tidepool:fair:q:' .. lanes[j] .. '|' .. tenant, score, string.format('%016d', seq) .. raw)
      if redis.call('SADD', backlog[j], tenant) == 1 then
        if not backlogged_elsewhere(tenant, j) then lift(tenant) end
        redis.call('ZADD', zsets[j], tscore(tenant), tenant)
      end
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
local tol = 1e-9 * factor
for j = 1, nl do      -- each lane's least-served tenants not passed over: its first one and any tied with it
  local from, done = 0, false
  while not done do
    local part = redis.call('ZRANGE', zsets[j], from, from + 15, 'WITHSCORES')
    if #part == 0 then break end
    for i = 1, #part, 2 do
      local t, v = part[i], tonumber(part[i + 1])
      if bestv ~= nil and v > bestv + tol then done = true; break end
      if not seen[t] and not excluded[t] then
        seen[t] = true
        if best == nil or v < bestv - tol then
          best, bestv, besthead = t, v, nil
        else
          if besthead == nil then besthead = head(best) end
          local h = head(t)
          if h ~= nil and (besthead == nil or h[1] < besthead[1] or (h[1] == besthead[1] and h[2] < besthead[2])) then
            best, bestv, besthead = t, v, h
          end
        end
      end
    end
    from = from + 16
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
    if redis.call('EXISTS', zkey) == 0 then
      redis.call('SREM', backlog[j], best)
      redis.call('ZREM', zsets[j], best)
    end
    break
  else
    redis.call('SREM', backlog[j], best)
    redis.call('ZREM', zsets[j], best)
  end
end
if raw == nil then return false end
local msg = cjson.decode(raw)
local cost = 1
local hdr = msg['headers']
if type(hdr) == 'table' and type(hdr['fair']) == 'table' and type(hdr['fair'][4]) == 'number' then cost = hdr['fair'][4] end
redis.call('HSET', SKEY, best, decayed(SKEY, TKEY, best) + cost)
redis.call('HSET', TKEY, best, ARGV[1])
rescore(SKEY, TKEY, best)
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
rescore(KEYS[1], KEYS[2], ARGV[2])
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
redis.call('DEL', 'tidepool:fair:z:' .. ARGV[1])
redis.call('SREM', 'tidepool:fair:l:' .. KEYS[2], ARGV[1])     -- (KEYS[2]: the lane's shared queue)
return n
"""


_SHAS: dict[str, str] = {}


def run_script(client, script: str, numkeys: int, *args):
    """EVAL `script` by its SHA (EVALSHA), sending the text only when this Redis has not cached it yet (a restart,
    SCRIPT FLUSH): the take runs per job, and its text is kilobytes."""
    sha = _SHAS.get(script)
    if sha is None:
        sha = _SHAS.setdefault(script, hashlib.sha1(script.encode()).hexdigest())
    try:
        return client.evalsha(sha, numkeys, *args)
    except NoScriptError:
        return client.eval(script, numkeys, *args)


def charge(client, queue: str, tenant: str, tokens: float, window: float, now: float | None = None) -> float:
    """Add `tokens` (negative: a refund) to `tenant`'s decayed service in the class of shared queue `queue`."""
    skey, tkey = service_keys(queue)
    now = time.time() if now is None else now
    return float(run_script(client, CHARGE, 4, skey, tkey, weights_key(queue), seq_key(queue), now, tenant, window,
                            tokens))


def move_lane(client, lane: str, to_list: str) -> int:
    """Hand what waits in `lane`'s sorted sets to the list `to_list` (a private lane handed back to its shared queue)."""
    return int(run_script(client, MOVE, 2, backlog_key(lane), to_list, lane) or 0)


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
    weights = {_text(k): float(v) for k, v in client.hgetall(weights_key(queue)).items()}
    out = {}
    for k, v in values.items():
        t = _text(k)
        at = float(stamps.get(k, now))
        decay = math.exp((at - now) / window) if now > at and window > 0 else 1.0
        out[t] = (float(v) * decay, weights.get(t, 1.0) or 1.0)
    return out
