-- End a job still queued past its deadline. Run by `tokenfleet repair`
-- (producer/client/fleet.py, repair_fleet) on a queue no live worker serves: nobody
-- else would, and the job would sit 'queued' for good (readers report it
-- expired, but write nothing). A worker that takes the job afterwards finds
-- it expired and only acknowledges it; a job a worker already started is not
-- touched here (its worker ends it at the deadline).
-- PUBLISH: SPUBLISH on a Redis Cluster, else PUBLISH (set before the source: scripts.py)
-- KEYS: 1 job hash, 2 token log, 3 event channel, 4 queue stream, 5 backlog counter,
--       6 end channel, 7 the queue's webhook outbox (job_webhook.lua)
-- ARGV: 1 now, 2 result TTL, 3 end event JSON, 4 group, 5 error message
-- Returns 'expired', 'missing', or the job's status when it is not queued or not
-- yet due (nothing changed).
-- include: job_webhook.lua
local cur = redis.call('HMGET', KEYS[1], 'status', 'deadline_at', 'entry', 'weight')
if not cur[1] then return 'missing' end
if cur[1] ~= 'queued' or not cur[2] or tonumber(cur[2]) > tonumber(ARGV[1]) then
  return cur[1]
end
-- The end entry first, before anything is changed: '1-0' sorts after every token
-- entry ('0-<n>', log_prefix.lua); it can exist already only if the job had
-- ended, which a queued job has not, so any error here is a real one and stops the script.
redis.call('XADD', KEYS[2], '1-0', 'e', ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'status', 'expired', 'finish_reason', 'deadline',
           'error', ARGV[5], 'finished_at', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call(PUBLISH, KEYS[3], ARGV[3])
redis.call(PUBLISH, KEYS[6], ARGV[3])
job_webhook(KEYS[7], KEYS[1], 'expired', ARGV[1])
-- Off the queue and out of the backlog. A worker that has read the entry but not
-- yet taken it finds the job expired and acknowledges it (again: harmless).
redis.call('DECRBY', KEYS[5], cur[4] or 0)
if cur[3] then
  redis.call('XACK', KEYS[4], ARGV[4], cur[3])
  redis.call('XDEL', KEYS[4], cur[3])
end
return 'expired'
