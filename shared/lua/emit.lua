-- Append one step's token events to their jobs' logs and publish them.
-- Log entry ids are '0-<index+1>', so a token is logged once whoever writes it.
-- A log never has a hole: a token is appended only right after the one before it
-- (until its end entry '1-0', a log holds exactly its tokens, so XLEN is the
-- next index), and published only once appended.
-- A write Redis refuses (OOM, READONLY, MISCONF, ...) ends the script with that
-- error. The events before it stay logged and published; a retry of the whole
-- call finds them logged and neither logs nor publishes them again. So the
-- caller retries the same call until it succeeds, and every event goes out once.
-- KEYS: per event: job hash, token log, event channel
-- ARGV: 1 result TTL, 2 now, then per event: attempt, index, event JSON
-- Returns {fenced, gaps}: 0-based positions of events whose job this attempt no
-- longer owns, and of events not logged because tokens before them are missing
-- from the log (the log lost them: the caller's state of that job is not to be
-- trusted, another attempt resumes it from the log).
local fenced, gaps = {}, {}
for i = 0, #KEYS / 3 - 1 do
  local job, log, chan = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local attempt, index, payload = ARGV[3 * i + 3], tonumber(ARGV[3 * i + 4]), ARGV[3 * i + 5]
  local id = '0-' .. (index + 1)
  if redis.call('HGET', job, 'attempts') ~= attempt then
    fenced[#fenced + 1] = i
  else
    local logged = redis.call('XLEN', log)
    if logged < index then
      gaps[#gaps + 1] = i
    elseif logged > index then
      -- Logged (and published) by an earlier try of this call, unless the
      -- log has a hole below its top (written before holes were refused).
      if #redis.call('XRANGE', log, id, id) == 0 then gaps[#gaps + 1] = i end
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
