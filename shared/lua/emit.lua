-- Append token events to their jobs' logs and publish them: one call for all
-- the events a step sends. An event carries the tokens of one job that the
-- output side held back together (one or several: see log_prefix.lua for the
-- id scheme), so a job costs two commands per event (XADD, PUBLISH), not per
-- token, and none reads the job record or the log first:
-- - The fence is the entry id: it carries the attempt, and once a newer
--   attempt has resumed the job its band is above every id an older one
--   writes, so Redis refuses the stale XADD. (A job's first event reads the
--   record: no resume may have made its log yet.)
-- - A log never has a hole: an event of tokens [i, j) follows the caller's own
--   event that ended at i, logged and acknowledged before. What could take
--   tokens from under it is Redis losing writes (a restart, a failover), which
--   the caller sees as an error or a new connection: a job's first event
--   after that (and its first event at all) runs checked, which reads the
--   record and the log's end and logs the event only where the log holds
--   exactly i tokens. A log that is gone (expired, lost)
--   is not made again past the first event (NOMKSTREAM).
-- Only a refused XADD is looked into: a log that has ended ('1-0' sorts after
-- every token: nothing to add), a newer attempt (fenced), the event's own entry
-- (logged by an earlier try of this call: neither logged nor published again),
-- or else a gap.
-- A write Redis refuses (OOM, READONLY, MISCONF, ...) ends the script with that
-- error. The events before it stay logged and published; a retry of the whole
-- call finds them logged (their entries are there) and neither logs nor
-- publishes them again. So the caller retries the same call until it
-- succeeds, and every token goes out once.
-- KEYS: per event 3: job hash, token log, event channel
-- ARGV: 1 result TTL, 2 now, then per event 5: attempt, '1' to check the record
--       and the log's end first, index of its first token, number of tokens,
--       event JSON
-- Returns {fenced, gaps}: 0-based positions of events whose job this attempt no
-- longer owns, and of events not logged because the log does not end where they
-- start (it lost tokens: the caller's state of that job is not to be trusted,
-- another attempt resumes it from the log).
-- include: log_prefix.lua
local fenced, gaps = {}, {}
for i = 0, #KEYS / 3 - 1 do
  local job, log, chan = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local a = 5 * i + 2
  local attempt, checked, payload = ARGV[a + 1], ARGV[a + 2] == '1', ARGV[a + 5]
  local index = tonumber(ARGV[a + 3])
  local top = index + tonumber(ARGV[a + 4])
  local id = log_id(attempt, top)
  local write = true
  if (checked or index == 0 or not banded(attempt))
     and redis.call('HGET', job, 'attempts') ~= attempt then
    fenced[#fenced + 1] = i
    write = false
  elseif checked then
    local logged = log_end(log)
    if logged ~= index then
      write = false
      -- More than index: logged (and published) by an earlier try of this call
      -- if its entry is there; other tokens past index are a log this attempt
      -- cannot go on.
      if logged < top or #redis.call('XRANGE', log, id, id) == 0 then gaps[#gaps + 1] = i end
    end
  end
  if write then
    local added
    if index == 0 then
      added = redis.pcall('XADD', log, id, 'e', payload)
    else
      added = redis.pcall('XADD', log, 'NOMKSTREAM', id, 'e', payload)
    end
    if not added then
      gaps[#gaps + 1] = i  -- no log: it expired or Redis lost it
    elseif type(added) == 'table' and added.err then
      -- The one error expected: an id at or below the log's last. Any other
      -- error is the caller's to retry.
      if not string.find(added.err, 'equal or smaller', 1, true) then return added end
      if #redis.call('XRANGE', log, '1-0', '1-0') > 0 then
        -- The log has ended: nothing to add.
      elseif redis.call('HGET', job, 'attempts') ~= attempt then
        fenced[#fenced + 1] = i
      elseif #redis.call('XRANGE', log, id, id) == 0 then
        gaps[#gaps + 1] = i
      end
    else
      redis.call('PUBLISH', chan, payload)
      if index == 0 then
        redis.call('HSET', job, 'first_token_at', ARGV[2])
        redis.call('EXPIRE', log, ARGV[1])
      end
    end
  end
end
return {fenced, gaps}
