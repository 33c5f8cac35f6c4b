-- Append token events to their jobs' logs and publish them: one call for all
-- the events a step sends. An event carries the tokens of one job that the
-- output side held back together (one or several: see log_prefix.lua for the
-- id scheme), so a job costs two commands per event (XADD, PUBLISH), not per
-- token, and an event that is not checked (below) reads neither the job
-- record nor the log first:
-- - The fence is the entry id: it carries the attempt, and once a newer
--   attempt has resumed the job its band is above every id an older one
--   writes, so Redis refuses the stale XADD. (A job's first event is checked,
--   below: no resume may have made its log yet; so is every event of an
--   attempt past the bands, which shares a band with others.) The caller
--   gives each event's id (worker_scripts.log_entry_id).
-- - A log never has a hole: an event of tokens [i, j) follows the caller's own
--   event that ended at i, logged and acknowledged before. What could take
--   tokens from under it is Redis losing writes (a restart, a failover), which
--   the caller sees as an error or a new connection: a job's first event
--   after that (and its first event at all) is checked, which reads the
--   record and the log's end and logs the event only where the log holds
--   exactly i tokens. An unchecked event never makes a log that is gone
--   (expired, lost): NOMKSTREAM.
-- Only a refused XADD is looked into: a log that has ended ('1-0' sorts after
-- every token: nothing to add), a newer attempt (fenced), the event's own entry
-- (logged by an earlier try of this call: neither logged nor published again),
-- or else a gap.
-- A job handed back (requeue.lua: 'queued' under the same attempt until a
-- worker starts it again) refuses a checked event and its end (finish.lua);
-- an unchecked one still in flight is logged, and the attempt that resumes the
-- job takes it as part of the prefix (its band refuses anything later).
-- A write Redis refuses (OOM, READONLY, MISCONF, ...) ends the script with that
-- error. The events before it stay logged and published; a retry of the whole
-- call finds them logged (their entries are there) and neither logs nor
-- publishes them again. So the caller retries the same call until it
-- succeeds, and every token goes out once.
-- KEYS: per event 3: job hash, token log, event channel
-- PUBLISH: SPUBLISH on a Redis Cluster, else PUBLISH (set before the source: scripts.py)
-- ARGV: 1 result TTL, 2 now, 3 how many events are checked (they come first),
--       then per checked event 4: attempt, index of its first token, log entry
--       id (log_prefix.lua), event JSON; then per other event 2: log entry id,
--       event JSON (its attempt is in its id)
-- Returns {fenced, gaps}: 0-based positions of events whose job this attempt no
-- longer owns, and of events not logged because the log does not end where they
-- start (it lost tokens: the caller's state of that job is not to be trusted,
-- another attempt resumes it from the log).
-- include: log_prefix.lua
local checked = tonumber(ARGV[3])
local fenced, gaps = {}, {}

-- An XADD at id refused as at or below the log's last id: why.
local function refused(i, job, log, id, attempt)
  if #redis.call('XRANGE', log, '1-0', '1-0') > 0 then
    return  -- the log has ended: nothing to add
  elseif redis.call('HGET', job, 'attempts') ~= attempt then
    fenced[#fenced + 1] = i
  elseif #redis.call('XRANGE', log, id, id) == 0 then
    gaps[#gaps + 1] = i
  end  -- else logged by an earlier try of this call
end

-- An event goes to its subscribers once logged.
local function publish(chan, payload)
  redis.call(PUBLISH, chan, payload)
end

-- The one error expected of an XADD: an id at or below the log's last. Any
-- other error is the caller's to retry. (tostring: an embedded Redis may give
-- the message as another type.)
local function expected(err)
  return string.find(tostring(err), 'equal or smaller', 1, true) ~= nil
end

for i = 0, #KEYS / 3 - 1 do
  local job, log, chan = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  if i < checked then
    local a = 4 * i + 4
    local attempt, index, id, payload = ARGV[a], tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 3]
    local cur = redis.call('HMGET', job, 'attempts', 'status')
    if cur[1] ~= attempt or cur[2] == 'queued' then
      fenced[#fenced + 1] = i
    else
      local logged = log_end(log)
      if logged ~= index then
        -- More than index: logged (and published) by an earlier try of this
        -- call if its entry is there; other tokens past index are a log this
        -- attempt cannot go on.
        if logged < tokens_at(id) or #redis.call('XRANGE', log, id, id) == 0 then
          gaps[#gaps + 1] = i
        end
      else
        local added = redis.pcall('XADD', log, id, 'e', payload)
        if type(added) == 'table' and added.err then
          if not expected(added.err) then return added end
          refused(i, job, log, id, attempt)
        else
          publish(chan, payload)
          if index == 0 then
            redis.call('HSET', job, 'first_token_at', ARGV[2])
            redis.call('EXPIRE', log, ARGV[1])
          end
        end
      end
    end
  else
    local a = 4 * checked + 2 * (i - checked) + 4
    local id, payload = ARGV[a], ARGV[a + 1]
    local added = redis.pcall('XADD', log, 'NOMKSTREAM', id, 'e', payload)
    if not added then
      gaps[#gaps + 1] = i  -- no log: it expired, or Redis lost it
    elseif type(added) == 'table' and added.err then
      if not expected(added.err) then return added end
      refused(i, job, log, id, attempt_of(id))
    else
      publish(chan, payload)
    end
  end
end
return {fenced, gaps}
