-- Hand a job back to the queue (a worker draining past its grace period): a new
-- entry at the end of the stream, the old one acknowledged and deleted, the
-- record queued again and pointed at its new entry (a cancel deletes the entry
-- the record names: naming the old one would leave the new one counting
-- against max_queue forever). The hand-back is counted apart from the
-- attempts, so it never brings a job nearer to max_attempts; unless ARGV[5] is
-- '1' (the job was in the batch that broke its worker's device: it may be the
-- cause).
-- A job handed back from a worker's own stream (placement by prefix) goes to
-- the shared one: the worker that owned it is leaving.
-- KEYS: 1 the stream it goes to, 2 job hash, 3 the model's backlog counter,
--       4 the stream its entry is in (KEYS[1] or its owner's)
-- ARGV: 1 old entry id, 2 attempt of the caller, 3 entry JSON, 4 group,
--       5 '1' to count the hand-back as an attempt
-- Returns 1 when handed back, 0 when the job is no longer the caller's.
local cur = redis.call('HMGET', KEYS[2], 'status', 'attempts')
if cur[1] ~= 'running' or cur[2] ~= ARGV[2] then return 0 end
local weight = redis.call('HGET', KEYS[2], 'weight') or 0
-- 'w': the weight fair.lua charges the job's tenant, as submit.lua writes it.
local entry = redis.call('XADD', KEYS[1], '*', 'data', ARGV[3], 'w', weight)
redis.call('XACK', KEYS[4], ARGV[4], ARGV[1])
redis.call('XDEL', KEYS[4], ARGV[1])
redis.call('HSET', KEYS[2], 'status', 'queued', 'worker', '', 'entry', entry)
redis.call('HDEL', KEYS[2], 'owner')
if ARGV[5] ~= '1' then redis.call('HINCRBY', KEYS[2], 'handbacks', 1) end
redis.call('INCRBY', KEYS[3], weight)
return 1
