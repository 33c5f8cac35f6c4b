-- Take a tenant's due webhook events for delivery: each is leased (its score
-- moved to the lease's end) rather than removed, so an event whose deliverer
-- dies mid-attempt comes due again when the lease ends (at least once), and two
-- deliverers never take the same event while the lease lasts.
-- KEYS: 1 the tenant's lane (sorted set: event ids scored by when each is due)
-- ARGV: 1 now (Unix seconds), 2 the lease's end, 3 how many to take at most
-- Returns the event ids taken, the longest due first.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, id in ipairs(due) do
  redis.call('ZADD', KEYS[1], 'XX', ARGV[2], id)
end
return due
