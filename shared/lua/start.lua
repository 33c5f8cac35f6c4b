-- Take ownership of jobs a worker just read from the stream. Each take is a new
-- attempt: the attempt number fences every later write (a worker that lost the
-- job to a reclaim can no longer write tokens or the final state).
-- KEYS: job hashes
-- ARGV: 1 worker name, 2 now
-- Returns one entry per key: {status} for a job not to run, else
-- {'run', attempt, cancel flag, hand-backs}
local out = {}
for i, key in ipairs(KEYS) do
  local cur = redis.call('HMGET', key, 'status', 'cancel', 'started_at', 'handbacks')
  if not cur[1] then
    out[i] = {'missing'}
  elseif cur[1] == 'queued' or cur[1] == 'running' then
    local attempt = redis.call('HINCRBY', key, 'attempts', 1)
    redis.call('HSET', key, 'status', 'running', 'worker', ARGV[1])
    if not cur[3] then redis.call('HSET', key, 'started_at', ARGV[2]) end
    out[i] = {'run', attempt, cur[2] or '0', cur[4] or '0'}
  else
    out[i] = {cur[1]}
  end
end
return out
