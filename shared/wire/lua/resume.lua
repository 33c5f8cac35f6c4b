-- Resume a job from its token log under the caller's new attempt: keep the
-- log's contiguous prefix and delete every entry after it. Entries past a gap
-- would otherwise sit at the ids the new attempt writes its tokens to (its
-- writes refused, or a consumer given tokens out of order); with them gone the
-- log stays gap-free and each token is logged exactly once.
-- This is also the fence of every earlier attempt: the stream's last id moves
-- to the caller's band at the prefix's end (log_id(attempt, k) for k tokens,
-- log_prefix.lua), so the next event's XADD (k + n for n tokens) lands and an
-- older attempt's XADD, at a lower band, is refused. A job with no log gets
-- an empty one at that id (an older attempt must not make it later).
-- KEYS: 1 job hash, 2 token log
-- ARGV: 1 attempt of the caller, 2 result TTL (of a log made here)
-- Returns {'fenced'} when the attempt is no longer the caller's, else
-- {'ok', payload of each kept token event, in order}.
-- include: log_prefix.lua

-- Move the log's last id to id: an entry made there and deleted (which makes
-- a log that is not there), or XSETID where that is refused (an id not above
-- the last one: attempts past the bands share one).
local function move_last_id(log, id)
  local added = redis.pcall('XADD', log, id, 'e', '')
  if type(added) == 'table' and added.err then
    -- The one error expected; any other (OOM, ...) ends the script.
    if not string.find(tostring(added.err), 'equal or smaller', 1, true) then error(added) end
    redis.call('XSETID', log, id)
  else
    redis.call('XDEL', log, id)
  end
end

local attempts = redis.call('HGET', KEYS[1], 'attempts')
if attempts ~= ARGV[1] then return {'fenced'} end
local kind = redis.call('TYPE', KEYS[2]).ok
if kind == 'none' then
  local base = log_id(ARGV[1], 0)
  if base ~= '0-0' then
    move_last_id(KEYS[2], base)
    redis.call('EXPIRE', KEYS[2], ARGV[2])
  end
  return {'ok'}
end
if kind ~= 'stream' then
  return redis.error_reply('the token log is a ' .. kind .. ', not a stream')
end
local prefix = log_prefix(KEYS[2])
local rest, kept = {}, #prefix[1]
for n, item in ipairs(redis.call('XRANGE', KEYS[2], '-', '+')) do
  if n > kept then rest[#rest + 1] = item[1] end
end
if #rest > 0 then redis.call('XDEL', KEYS[2], unpack(rest)) end
move_last_id(KEYS[2], log_id(ARGV[1], prefix[4]))
local out = {'ok'}
for _, payload in ipairs(prefix[1]) do out[#out + 1] = payload end
return out
