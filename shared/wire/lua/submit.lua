-- Admit one job: idempotency check, a live worker (unless queued ahead, the
-- queue is declared as served by an autoscaled pool, or its last worker was
-- live within the grace period: a restart), the
-- queue's limits (its length among them), then record + stream entry together,
-- so a reader never sees an entry without its record or the reverse.
-- KEYS: 1 the stream of the job's level and tenant, 2 job hash, 3 idempotency key,
--       4 the model's backlog counter, 5 the model's live workers (sorted set),
--       6 the limits its workers published (hash: worker name -> QueueLimits JSON),
--       7 the model's named tenants (set), 8 the queue's declaration (hash; exists
--       for a queue an autoscaled pool serves), 9 the time until which a worker
--       last counted as live (string), 10 the owners of streams of their own
--       (hash: tag -> {"worker", "slots"}, workers/affinity.py), 11 the owned
--       levels that have a stream (set), 12.. every stream of the model: each
--       level's, of the default tenant and of each tenant of ARGV 12.., the
--       live levels' first ("live" of ARGV 3 counts them), the batch level's
--       after (the depth counts them all); the owned streams are named by KEYS
--       11 and "qhead" (below), not declared: they share the queue's slot
-- ARGV: 1 job id, 2 entry JSON, 3 JSON {"limits": the client's QueueLimits,
--       "asked": {limit name: what the request brings}, "live": how many of
--       KEYS 12.. are live levels' streams, "batch": true for a batch line,
--       "qhead": the key its streams' names start with ('<ns>:q:{<queue>}'),
--       "place": with placement on, {"prefix": [[length, key], ...] shortest
--       first, "plen": the request's length, "held": the key the held sets'
--       names start with, "level": '<priority>:<tenant>', "since": the score a
--       live worker has at least, "group"}}, 4 idempotency TTL (s),
--       5 '1' if an idempotency key is used, 6 backlog weight (tokens),
--       7 fingerprint of the request, 8 heartbeat score a live worker has at
--       least ('' to queue ahead of the workers), 9 the least KEYS[9] of a queue
--       in its grace period ('' for none), 10 the job's named tenant ('' for
--       the default one), 11 n: how many named tenants' streams are in KEYS,
--       12..11+n those tenants, then the record's field/value pairs
-- Placement: the job goes to the own stream of the live owner that holds the
-- longest of its prefixes, scored as production-stack's router does, matched
-- share of the prompt less the owner's load (its own streams' jobs, waiting or
-- running, over its slots); an owner with a batch's worth there already is
-- passed over; equal scores are broken by rendezvous hashing (below). A job
-- whose best owner scores no more than the least loaded owner would without the
-- prefix (its load alone), and a batch line always, go to the shared stream
-- KEYS[1].
-- Returns {'ok', job id}, {'dup', id of the job the key made before},
--         {'conflict', ''} (the key was used for another request),
--         {'noworker', KEYS[9]} (KEYS[9]: '' for a queue never served, or not
--         within a day), {'full', depth, limit, by, why},
--         {'over', limit name, value, limit, by, why} (a request over a limit),
--         {'tenants', name...} (KEYS miss a tenant's streams: nothing written;
--         the caller asks again with the streams of every tenant named)
if ARGV[5] == '1' then
  local existing = redis.call('GET', KEYS[3])
  if existing then
    -- '<job id> <fingerprint>'; a bare id was stored before fingerprints were.
    local id, fingerprint = string.match(existing, '^(%S+) (%S+)$')
    if not id then return {'dup', existing} end
    -- Another request under the same key gets nothing of the first job: its
    -- id would give read and cancel access to someone else's job.
    if fingerprint ~= ARGV[7] then return {'conflict', ''} end
    return {'dup', id}
  end
end
-- Checked here rather than by the client beforehand: no extra round trip. A
-- declared queue's pool may be scaled to zero: its backlog is what wakes it.
-- A queue served until lately waits for its workers to come back (a rolling
-- restart of its only worker) for the grace period, then is refused as one
-- that was served (the caller may retry), not as an unknown name.
if ARGV[8] ~= '' and redis.call('ZCOUNT', KEYS[5], ARGV[8], '+inf') == 0
    and redis.call('EXISTS', KEYS[8]) == 0 then
  local served_until = redis.call('GET', KEYS[9])
  if not served_until or ARGV[9] == ''
      or tonumber(served_until) < tonumber(ARGV[9]) then
    return {'noworker', served_until or ''}
  end
end
-- The strictest of the client's limits and of every worker's of the queue: a
-- job may run on any of them. Workers publish theirs with each heartbeat and the
-- hash expires once none is live, so with no live worker the client's hold.
-- On a tie a worker's wins: the refusal names the fleet's limit.
local submitted = cjson.decode(ARGV[3])
local limits, seen = {}, {}
for _, published in ipairs(redis.call('HVALS', KEYS[6])) do
  -- Workers of one model and settings publish the same text: decoded once.
  if not seen[published] then
    seen[published] = true
    for name, limit in pairs(cjson.decode(published)) do
      if limits[name] == nil or limit.value < limits[name].value then limits[name] = limit end
    end
  end
end
for name, limit in pairs(submitted.limits) do
  if limits[name] == nil or limit.value < limits[name].value then limits[name] = limit end
end
for _, name in ipairs({'payload_bytes', 'new_tokens', 'prompt_tokens'}) do
  local value, limit = submitted.asked[name], limits[name]
  if value ~= nil and limit ~= nil and value > limit.value then
    return {'over', name, tostring(value), tostring(limit.value), limit.by, limit.why}
  end
end
-- The depth counts every tenant's streams, so the caller must have named
-- them all: the tenants a caller knows are cached, and a new one costs a retry.
local n = tonumber(ARGV[11])
local known = {}
for i = 12, 11 + n do known[ARGV[i]] = true end
local members = redis.call('SMEMBERS', KEYS[7])
for _, tenant in ipairs(members) do
  if not known[tenant] then return {'tenants', unpack(members)} end
end
-- Finished entries are deleted, so the length is what is waiting or running.
-- A live job counts only the live levels' jobs: batch lines, however many a
-- tenant's batches queue, never fill the queue for live requests. A batch line
-- counts every level, so it takes only room the live jobs leave: the queue
-- holds at most its limit of live jobs, and of all jobs together past that
-- only live ones.
local live, depth = 0, 0
for i = 12, #KEYS do
  local length = redis.call('XLEN', KEYS[i])
  depth = depth + length
  if i < 12 + submitted.live then live = live + length end
end
-- The owned streams hold live levels' jobs only.
local load, owned = {}, {}
for _, level in ipairs(redis.call('SMEMBERS', KEYS[11])) do
  local rest, tag = string.match(level, '^[^:]+:(.+):(w%x+)$')
  owned[level] = true
  if rest then
    local length = redis.call('XLEN', submitted.qhead .. ':' .. rest .. ':' .. tag)
    load[tag] = (load[tag] or 0) + length
    live, depth = live + length, depth + length
  end
end
if not submitted.batch then depth = live end
local most = limits.queue
if depth >= most.value then
  return {'full', tostring(depth), tostring(most.value), most.by, most.why}
end
local stream, owner = KEYS[1], nil
local place = submitted.place
if place and not submitted.batch then
  local best, least = nil, 1
  local owners = redis.call('HGETALL', KEYS[10])
  for i = 1, #owners, 2 do
    local tag, ok, info = owners[i], pcall(cjson.decode, owners[i + 1])
    -- An entry not written by a worker is passed over, never an error for the submit.
    local fit = ok and type(info) == 'table' and type(info.worker) == 'string'
      and type(info.slots) == 'number' and info.slots >= 1
    local busy = fit and (load[tag] or 0) / info.slots or 1
    least = math.min(least, busy)
    if busy < 1 then
      for j = #place.prefix, 1, -1 do
        local key = place.prefix[j][2]
        if redis.call('ZSCORE', place.held .. tag, key) then
          local score = place.prefix[j][1] / place.plen - busy
          -- Equal scores (owners that hold it, equally loaded: at a low arrival
          -- rate, none) go to the highest hash of prefix and owner (rendezvous
          -- hashing): each prefix to one of them, the prefixes spread over them,
          -- so their caches split the load's prefixes instead of the owner
          -- listed first taking every job. Live: its heartbeat's score (asked
          -- only of an owner that would win).
          if not best or score > best[2] or (score == best[2]
              and redis.sha1hex(key .. tag) > redis.sha1hex(best[3] .. best[1])) then
            local seen = redis.call('ZSCORE', KEYS[5], info.worker)
            if seen and tonumber(seen) >= place.since then best = {tag, score, key} end
          end
          break
        end
      end
    end
  end
  -- An owner that does not hold the prefix scores its load alone (0 matched):
  -- the best holder must beat the least loaded owner so, or the job goes to the
  -- shared stream, where that one takes it. Else an owner that ran the first
  -- turn of many conversations would draw every later turn while a peer idles.
  if best and best[2] > -least then
    owner = best[1]
    stream = submitted.qhead .. ':' .. place.level .. ':' .. owner
    local level = string.match(KEYS[1], '{(.-)}') .. ':' .. place.level .. ':' .. owner
    if not owned[level] then
      redis.call('SADD', KEYS[11], level)
      redis.pcall('XGROUP', 'CREATE', stream, place.group, '0', 'MKSTREAM')
    end
  end
end
-- 'w': the job's weight in tokens, what fair.lua charges its tenant.
local entry = redis.call('XADD', stream, '*', 'data', ARGV[2], 'w', ARGV[6])
-- The record knows its entry, so a cancel can take it off the queue at once.
local fields = {}
for i = 12 + n, #ARGV do fields[#fields + 1] = ARGV[i] end
for _, v in ipairs({'entry', entry, 'weight', ARGV[6]}) do fields[#fields + 1] = v end
-- The stream it waits in is its owner's: a cancel must find it there.
if owner then fields[#fields + 1], fields[#fields + 2] = 'owner', owner end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('INCRBY', KEYS[4], ARGV[6])
if ARGV[10] ~= '' then redis.call('SADD', KEYS[7], ARGV[10]) end
if ARGV[5] == '1' then
  redis.call('SET', KEYS[3], ARGV[1] .. ' ' .. ARGV[7], 'EX', ARGV[4])
end
return {'ok', ARGV[1]}
