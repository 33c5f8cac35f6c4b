-- Move a batch to a new status, only from one of the statuses given: a cancel
-- that meets a batch already finalizing changes nothing, and a driver's end
-- never overwrites a cancel asked for meanwhile.
-- KEYS: 1 the batch's record (hash)
-- ARGV: 1 the statuses it may move from (space-separated), 2 the new status,
--       3.. field/value pairs written with it (a timestamp, say)
-- Returns the status before the call ('' for no batch); the move happened when
-- it was one of ARGV[1].
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
-- The record stores each field as JSON: a status is a quoted string.
local bare = string.sub(status, 2, -2)
for allowed in string.gmatch(ARGV[1], '%S+') do
  if allowed == bare then
    redis.call('HSET', KEYS[1], 'status', '"' .. ARGV[2] .. '"')
    for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
    return bare
  end
end
return bare
