-- Count a new batch among its tenant's open ones, unless the tenant has its
-- limit open already: checked and added in one step, so two creations at once
-- cannot both take the last place.
-- KEYS: 1 the tenant's open batches (set)
-- ARGV: 1 the new batch's id, 2 the most open batches the tenant may have
-- Returns 0 when the batch was added, else the number of batches open (the
-- limit or more: nothing was added).
local open = redis.call('SCARD', KEYS[1])
if open >= tonumber(ARGV[2]) then return open end
redis.call('SADD', KEYS[1], ARGV[1])
return 0
