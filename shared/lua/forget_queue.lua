-- Forget a queue nobody uses: every level's stream empty, no consumer group on
-- any (no worker ever served it: a mistyped model name, say) and no live worker.
-- Its streams, backlog counter and list of (dead) workers are deleted, so it no
-- longer shows in `tokenfleet status`. Atomic against submit.lua: a submit
-- that runs after this creates the stream again with a backlog from zero, which
-- is right, since nothing was queued. A queue that has a consumer group is kept:
-- a worker (or a KEDA scaler) reads that group, and deleting it under them
-- would lose its read position.
-- KEYS: 1-3 every level's stream, 4 backlog counter, 5 live workers (sorted set)
-- ARGV: 1 heartbeat score a live worker has at least
-- Returns 1 when the queue was forgotten, 0 when it is in use.
if redis.call('ZCOUNT', KEYS[5], ARGV[1], '+inf') > 0 then return 0 end
for i = 1, 3 do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    if redis.call('XLEN', KEYS[i]) > 0 then return 0 end
    if #redis.call('XINFO', 'GROUPS', KEYS[i]) > 0 then return 0 end
  end
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return 1
