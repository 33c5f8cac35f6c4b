-- Take ownership of jobs a worker just read from the stream. Each take is a new
-- attempt: the attempt number fences every later write (a worker that lost the
-- job to a reclaim can no longer write tokens or the final state).
-- Every record is checked before anything is written to it, and one that cannot
-- be started gets a verdict of its own: a bad record never fails the whole read
-- (an error here would leave every job of the read pending, to be redelivered
-- and fail again).
-- KEYS: 1 the model's backlog counter, 2 the level's stream, 3.. job hashes
-- ARGV: 1 worker name, 2 now, 3 group, then per job 2: its stream entry id,
--       '1' if the caller runs the job already (from another entry), else '0'
-- Returns one entry per job:
--   {'run', attempt, cancel flag, hand-backs}  a new attempt, taken by the caller
--   {status}    not to run: it ended (or was cancelled while queued)
--   {'missing'} no record
--   {'stale'}   the record's live entry is another one: this copy is acked and
--               deleted here, so it never runs the job twice nor counts as queued
--   {'held'}    the caller runs the job from another entry, and the record names
--               this one: nothing is written (not a second run in the caller)
--   {'bad', reason, writable}  a record that cannot be started; writable is '1'
--               when it is a hash (a final state can be stored in it), else '0'
local STATUSES = {queued = true, running = true, succeeded = true, failed = true,
                  cancelled = true, expired = true}

-- An absent field (false) or a decimal integer of at most 15 digits: one that
-- DECRBY accepts and a Lua number (a double) holds exactly, since the attempt
-- count comes back to the worker through one.
local function integer(v)
  return not v or (#v <= 15 and string.match(v, '^%-?%d+$') ~= nil)
end

local NOT_INTEGER = ' is not an integer of at most 15 digits: '

local function quoted(v)
  return "'" .. string.sub(v, 1, 40) .. "'"
end

-- The backlog is a gauge: a corrupt one is left alone rather than failing every take.
local backlog_type = redis.call('TYPE', KEYS[1]).ok
local backlog_ok = backlog_type == 'none'
  or (backlog_type == 'string' and integer(redis.call('GET', KEYS[1])))

local function leave_backlog(weight)
  if backlog_ok and weight then redis.call('DECRBY', KEYS[1], weight) end
end

local out = {}
for i = 3, #KEYS do
  local key, entry, held = KEYS[i], ARGV[2 * i - 2], ARGV[2 * i - 1]
  -- One read for a record that is a hash (all but hostile ones): HMGET fails
  -- on another type, and gives nothing but nils for no key at all.
  local cur = redis.pcall('HMGET', key, 'status', 'cancel', 'started_at', 'handbacks',
                          'weight', 'attempts', 'entry')
  local kind = 'hash'
  if type(cur) == 'table' and cur.err then
    kind = redis.call('TYPE', key).ok
  elseif not cur[1] and redis.call('EXISTS', key) == 0 then
    kind = 'none'
  end
  if kind == 'none' then
    out[i - 2] = {'missing'}
  elseif kind ~= 'hash' then
    out[i - 2] = {'bad', 'job record is a ' .. kind .. ', not a hash', '0'}
  else
    local status, handbacks, weight, attempts, live = cur[1], cur[4], cur[5], cur[6], cur[7]
    local reason
    if not status then
      reason = 'job record has no status'
    elseif not STATUSES[status] then
      reason = 'job record has an unknown status ' .. quoted(status)
    elseif not integer(attempts) then
      reason = "job record's attempts" .. NOT_INTEGER .. quoted(attempts)
    elseif not integer(handbacks) then
      reason = "job record's handbacks" .. NOT_INTEGER .. quoted(handbacks)
    elseif not integer(weight) then
      reason = "job record's weight" .. NOT_INTEGER .. quoted(weight)
    end
    if reason then
      -- It leaves the queue for the dead letters: its work no longer waits.
      if status == 'queued' and integer(weight) then leave_backlog(weight) end
      out[i - 2] = {'bad', reason, '1'}
    elseif status ~= 'queued' and status ~= 'running' then
      out[i - 2] = {status}
    elseif live and live ~= entry then
      -- A copy of a job whose live entry is elsewhere (a duplicate, a leftover
      -- of a hand-back): the live entry carries the job, this one goes.
      redis.call('XACK', KEYS[2], ARGV[3], entry)
      redis.call('XDEL', KEYS[2], entry)
      out[i - 2] = {'stale'}
    elseif held == '1' then
      out[i - 2] = {'held'}
    else
      -- Leaving the queue: its work no longer counts in the backlog.
      if status == 'queued' then leave_backlog(weight) end
      -- 'entry' binds the record to the entry it runs from (a record written
      -- before the field existed gets it here), so any other copy is stale.
      local attempt = (tonumber(attempts) or 0) + 1
      local fields = {'attempts', attempt, 'status', 'running', 'worker', ARGV[1],
                      'entry', entry}
      if not cur[3] then fields[#fields + 1], fields[#fields + 2] = 'started_at', ARGV[2] end
      redis.call('HSET', key, unpack(fields))
      out[i - 2] = {'run', attempt, cur[2] or '0', handbacks or '0'}
    end
  end
end
return out
