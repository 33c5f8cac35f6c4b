-- Correct one request's token charge to what it used (its prompt and the tokens
-- actually made), once it ended; a charge that left the window already stays gone.
-- KEYS: 1 the key's token charges (sorted set), 2 the sum of those charges (counter)
-- ARGV: 1 request id, 2 tokens charged, 3 tokens used
-- Returns 1 when the charge was corrected, 0 when it had left the window.
local member = ARGV[1] .. ' ' .. ARGV[2]
local at = redis.call('ZSCORE', KEYS[1], member)
if not at then return 0 end
local used = tonumber(ARGV[3])
redis.call('ZREM', KEYS[1], member)
-- Same time as the charge: the correction leaves the window when it would have.
if used > 0 then redis.call('ZADD', KEYS[1], at, ARGV[1] .. ' ' .. used) end
redis.call('INCRBY', KEYS[2], used - tonumber(ARGV[2]))
return 1
