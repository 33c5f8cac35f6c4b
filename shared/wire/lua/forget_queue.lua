-- Forget a queue nobody uses: every level's stream empty, no consumer group on
-- any (no worker ever served it: a mistyped model name, say) and no live worker.
-- Its streams, backlog counter and list of (dead) workers are deleted, so it no
-- longer shows in `tokenfleet status`. Atomic against submit.lua: a submit
-- that runs after this creates the stream again with a backlog from zero, which
-- is right, since nothing was queued. A queue that has a consumer group is kept:
-- a worker (or a KEDA scaler) reads that group, and deleting it under them
-- would lose its read position.
-- Its tenants' streams and fair-share counters go with it.
-- KEYS: 1 backlog counter, 2 live workers (sorted set), 3 named tenants (set),
--       4-6 each level's fair-share counters, 7.. every stream of the queue (each
--       level's, of the default tenant and of each tenant in ARGV 2..)
-- ARGV: 1 heartbeat score a live worker has at least, 2.. the named tenants
-- Returns 1 when the queue was forgotten, 0 when it is in use (or has a tenant
-- the caller did not name: it may be in use).
if redis.call('ZCOUNT', KEYS[2], ARGV[1], '+inf') > 0 then return 0 end
local named = {}
for i = 2, #ARGV do named[ARGV[i]] = true end
for _, tenant in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  if not named[tenant] then return 0 end
end
for i = 7, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    if redis.call('XLEN', KEYS[i]) > 0 then return 0 end
    if #redis.call('XINFO', 'GROUPS', KEYS[i]) > 0 then return 0 end
  end
end
redis.call('DEL', unpack(KEYS))
return 1
