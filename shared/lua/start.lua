-- Take ownership of jobs a worker just read from the stream. Each take is a new
-- attempt: the attempt number fences every later write (a worker that lost the
-- job to a reclaim can no longer write tokens or the final state).
-- KEYS: 1 the model's backlog counter, 2.. job hashes
-- ARGV: 1 worker name, 2 now
-- Returns one entry per key: {status} for a job not to run, else
-- {'run', attempt, cancel flag, hand-backs}
local out = {}
for i = 2, #KEYS do
  local key = KEYS[i]
  local cur = redis.call('HMGET', key, 'status', 'cancel', 'started_at', 'handbacks', 'weight')
  if not cur[1] then
    out[i - 1] = {'missing'}
  elseif cur[1] == 'queued' or cur[1] == 'running' then
    -- Leaving the queue: its work no longer counts in the backlog.
    if cur[1] == 'queued' then redis.call('DECRBY', KEYS[1], cur[5] or 0) end
    local attempt = redis.call('HINCRBY', key, 'attempts', 1)
    redis.call('HSET', key, 'status', 'running', 'worker', ARGV[1])
    if not cur[3] then redis.call('HSET', key, 'started_at', ARGV[2]) end
    out[i - 1] = {'run', attempt, cur[2] or '0', cur[4] or '0'}
  else
    out[i - 1] = {cur[1]}
  end
end
return out
