-- Store the final state of jobs (the ones a step finished, or ended outside the
-- engine), end their token logs, tell subscribers, and only then acknowledge and
-- delete their stream entries: a crash before this script runs leaves the
-- entries pending, to be redelivered. One call for all the jobs of a step.
-- A job ends only with a whole log: its final state is not written unless the
-- log holds exactly its tokens (the step's emit.lua call may have been refused,
-- or Redis lost them), so an end never follows a hole.
-- Errors: the record (HSET) is a job's first write, so a write Redis refuses
-- (OOM, READONLY, MISCONF: checked before a script's first write only) ends the
-- script with nothing of that job written; jobs before it in the call stay
-- ended, and a retry of the whole call finds them ended (2) and acknowledges.
-- PUBLISH: SPUBLISH on a Redis Cluster, else PUBLISH (set before the source: scripts.py)
-- KEYS: 1 dead letters, 2 the queue's webhook outbox (job_webhook.lua), then per
--       job 5: job hash, token log, event channel, end channel (the end event
--       alone, for waiters), queue stream
-- ARGV: 1 result TTL, 2 group, 3 worker name, 4 now,
--       then per job 11: attempt ('' for no ownership check), stream entry id
--       ('' for none), end event JSON, dead-letter JSON ('' for none), status,
--       finish reason, error, text, token ids JSON, prompt tokens ('' if unknown),
--       tokens the log must hold ('' for no check)
-- Returns per job: 1 when stored, 0 when fenced off, 2 when it had already ended,
-- 3 when not stored because its log does not hold exactly its tokens.
-- include: log_prefix.lua
-- include: job_webhook.lua
local ttl, group, worker, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local out = {}
for i = 0, (#KEYS - 2) / 5 - 1 do
  local k = 5 * i + 2
  local job, log, chan, ends, queue = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], KEYS[k + 5]
  local a = 11 * i + 4
  local attempt, entry, event = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local cur = redis.call('HMGET', job, 'status', 'attempts')
  -- A job handed back ('queued' under the same attempt) is no longer the caller's.
  if attempt ~= '' and (cur[2] ~= attempt or cur[1] == 'queued') then
    out[i + 1] = 0
  else
    local result = 1
    if cur[1] == 'succeeded' or cur[1] == 'failed' or cur[1] == 'cancelled'
       or cur[1] == 'expired' then
      result = 2
    elseif ARGV[a + 11] ~= '' and log_end(log) ~= tonumber(ARGV[a + 11]) then
      result = 3
    else
      local fields = {'status', ARGV[a + 5], 'finish_reason', ARGV[a + 6], 'error', ARGV[a + 7],
                      'text', ARGV[a + 8], 'token_ids', ARGV[a + 9], 'finished_at', now,
                      'worker', worker}
      if ARGV[a + 10] ~= '' then
        fields[15], fields[16] = 'num_prompt_tokens', ARGV[a + 10]
      end
      redis.call('HSET', job, unpack(fields))
      redis.call('EXPIRE', job, ttl)
      -- '1-0' sorts after every token entry: the end is always last. The one
      -- error expected: an end entry is there already.
      local added = redis.pcall('XADD', log, '1-0', 'e', event)
      if type(added) == 'table' and added.err
         and not string.find(added.err, 'equal or smaller', 1, true) then
        return added
      end
      redis.call('EXPIRE', log, ttl)
      redis.call(PUBLISH, chan, event)
      redis.call(PUBLISH, ends, event)
      if ARGV[a + 4] ~= '' then redis.call('XADD', KEYS[1], '*', 'data', ARGV[a + 4]) end
      job_webhook(KEYS[2], job, ARGV[a + 5], now)
    end
    if entry ~= '' and result ~= 3 then
      redis.call('XACK', queue, group, entry)
      redis.call('XDEL', queue, entry)
    end
    out[i + 1] = result
  end
end
return out
