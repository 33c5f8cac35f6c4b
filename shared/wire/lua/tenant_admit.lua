-- Reserve a place among a tenant's jobs waiting or running, under a key's cap.
-- The submit that follows replaces the reservation with its job id (or drops it).
-- KEYS: 1 the tenant's jobs (sorted set: member job id or reservation, score admission time)
-- ARGV: 1 cap, 2 reservation, 3 now (s, the fleet's clock)
-- Returns {'ok', jobs now} (reserved) or {'full', jobs now} (nothing written)
local count = redis.call('ZCARD', KEYS[1])
if count >= tonumber(ARGV[1]) then return {'full', count} end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
return {'ok', count + 1}
