-- Take or renew the lease on one batch: the driver that holds it is the only
-- one that feeds, collects and finalizes the batch. A lease its holder stopped
-- renewing (a killed gateway) lapses, and the next driver to ask takes it.
-- KEYS: 1 the batch's lease (string with a TTL)
-- ARGV: 1 the asking driver's name, 2 the lease's time to live (ms)
-- Returns 1 when the caller holds the lease now (taken or renewed), else 0.
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
