-- Store the final state of jobs (the ones a step finished, or ended outside the
-- engine), end their token logs, tell subscribers, and only then acknowledge and
-- delete their stream entries: a crash before this script runs leaves the
-- entries pending, to be redelivered. One call for all the jobs of a step.
-- KEYS: 1 dead letters, then per job 4: job hash, token log, event channel, queue stream
-- ARGV: 1 result TTL, 2 group, 3 worker name, 4 now,
--       then per job 10: attempt ('' for no ownership check), stream entry id
--       ('' for none), end event JSON, dead-letter JSON ('' for none), status,
--       finish reason, error, text, token ids JSON, prompt tokens ('' if unknown)
-- Returns per job: 1 when stored, 0 when fenced off, 2 when it had already ended.
local ttl, group, worker, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local out = {}
for i = 0, (#KEYS - 1) / 4 - 1 do
  local job, log, chan, queue = KEYS[4 * i + 2], KEYS[4 * i + 3], KEYS[4 * i + 4], KEYS[4 * i + 5]
  local a = 10 * i + 4
  local attempt, entry, event = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local cur = redis.call('HMGET', job, 'status', 'attempts')
  if attempt ~= '' and cur[2] ~= attempt then
    out[i + 1] = 0
  else
    local result = 1
    if cur[1] == 'succeeded' or cur[1] == 'failed' or cur[1] == 'cancelled'
       or cur[1] == 'expired' then
      result = 2
    else
      local fields = {'status', ARGV[a + 5], 'finish_reason', ARGV[a + 6], 'error', ARGV[a + 7],
                      'text', ARGV[a + 8], 'token_ids', ARGV[a + 9], 'finished_at', now,
                      'worker', worker}
      if ARGV[a + 10] ~= '' then
        fields[15], fields[16] = 'num_prompt_tokens', ARGV[a + 10]
      end
      redis.call('HSET', job, unpack(fields))
      redis.call('EXPIRE', job, ttl)
      redis.pcall('XADD', log, '1-0', 'e', event)
      redis.call('EXPIRE', log, ttl)
      redis.call('PUBLISH', chan, event)
      if ARGV[a + 4] ~= '' then redis.call('XADD', KEYS[1], '*', 'data', ARGV[a + 4]) end
    end
    if entry ~= '' then
      redis.call('XACK', queue, group, entry)
      redis.call('XDEL', queue, entry)
    end
    out[i + 1] = result
  end
end
return out
