-- Store a job's final state, end its token log, tell subscribers, and only then
-- acknowledge and delete its stream entry: a crash before this script runs
-- leaves the entry pending, to be redelivered.
-- KEYS: 1 job hash, 2 token log, 3 event channel, 4 queue stream, 5 dead letters
-- ARGV: 1 attempt ('' for no ownership check), 2 stream entry id, 3 result TTL,
--       4 end event JSON, 5 dead-letter JSON ('' for none), 6 group,
--       7.. record field/value pairs
-- Returns 1 when stored, 0 when fenced off, 2 when the job had already ended.
local cur = redis.call('HMGET', KEYS[1], 'status', 'attempts')
if ARGV[1] ~= '' and cur[2] ~= ARGV[1] then return 0 end
local result = 1
if cur[1] == 'succeeded' or cur[1] == 'failed' or cur[1] == 'cancelled'
   or cur[1] == 'expired' then
  result = 2
else
  local fields = {}
  for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.pcall('XADD', KEYS[2], '1-0', 'e', ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  redis.call('PUBLISH', KEYS[3], ARGV[4])
  if ARGV[5] ~= '' then redis.call('XADD', KEYS[5], '*', 'data', ARGV[5]) end
end
if ARGV[2] ~= '' then
  redis.call('XACK', KEYS[4], ARGV[6], ARGV[2])
  redis.call('XDEL', KEYS[4], ARGV[2])
end
return result
