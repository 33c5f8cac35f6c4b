-- Append token events to their jobs' logs and publish them: one call for all
-- the events a step sends. An event carries the tokens of one job that the
-- output side held back together (one or several: see log_prefix.lua for the
-- id scheme), so a job costs a few commands per event, not per token.
-- A log never has a hole: an event of tokens [i, j) is appended (at '0-<j>')
-- only where the log holds exactly i tokens, and published only once appended.
-- The attempt is checked once per event: a worker that lost the job to a
-- reclaim writes nothing more to it, nor one that handed it back (requeue.lua:
-- the record is 'queued' under the same attempt until a worker starts it again).
-- A write Redis refuses (OOM, READONLY, MISCONF, ...) ends the script with that
-- error. The events before it stay logged and published; a retry of the whole
-- call finds them logged (their entries are there) and neither logs nor
-- publishes them again. So the caller retries the same call until it
-- succeeds, and every token goes out once.
-- KEYS: per event 3: job hash, token log, event channel
-- ARGV: 1 result TTL, 2 now, then per event 4: attempt, index of its first
--       token, number of tokens, event JSON
-- Returns {fenced, gaps}: 0-based positions of events whose job this attempt no
-- longer owns, and of events not logged because the log does not end where they
-- start (it lost tokens: the caller's state of that job is not to be trusted,
-- another attempt resumes it from the log).
-- include: log_prefix.lua
local fenced, gaps = {}, {}
for i = 0, #KEYS / 3 - 1 do
  local job, log, chan = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local a = 4 * i + 2
  local attempt, index, payload = ARGV[a + 1], tonumber(ARGV[a + 2]), ARGV[a + 4]
  local top = index + tonumber(ARGV[a + 3])
  local id = '0-' .. top
  local cur = redis.call('HMGET', job, 'attempts', 'status')
  if cur[1] ~= attempt or cur[2] == 'queued' then
    fenced[#fenced + 1] = i
  else
    local logged = log_end(log)
    if logged < index then
      gaps[#gaps + 1] = i
    elseif logged > index then
      -- Logged (and published) by an earlier try of this call: its entry is
      -- there. Other tokens past index are a log this attempt cannot go on.
      if logged < top or #redis.call('XRANGE', log, id, id) == 0 then
        gaps[#gaps + 1] = i
      end
    else
      local added = redis.pcall('XADD', log, id, 'e', payload)
      if type(added) == 'table' and added.err then
        -- The one error expected: an id at or below the log's top. Either the
        -- log has ended ('1-0' sorts after every token): nothing to add; or
        -- entries past this index were deleted: a hole. Any other error is the
        -- caller's to retry.
        if not string.find(added.err, 'equal or smaller', 1, true) then return added end
        if #redis.call('XRANGE', log, '1-0', '1-0') == 0 then gaps[#gaps + 1] = i end
      else
        redis.call('PUBLISH', chan, payload)
        if index == 0 then
          redis.call('HSET', job, 'first_token_at', ARGV[2])
          redis.call('EXPIRE', log, ARGV[1])
        end
      end
    end
  end
end
return {fenced, gaps}
