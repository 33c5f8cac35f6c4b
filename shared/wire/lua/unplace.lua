-- A worker that leaves gives a job waiting unread in one of its own streams
-- (placement by prefix) to the shared stream of the same level and tenant:
-- every reader and every scaler counts the shared streams, and none would
-- read its own stream once it has gone (its peers steal from it, but a pool
-- scaled to zero has none). The entry moves whole ('data' and the weight
-- fair share charges), the record points at the new entry and names no owner,
-- so a cancel finds it. The job stays queued: the backlog is unchanged.
-- KEYS: 1 the own stream, 2 the shared stream, 3 the job's record
-- ARGV: 1 the entry id, 2 group
-- Returns 1 when moved; 0 when the entry is gone (ended, cancelled, moved),
-- was delivered (a reader holds it pending), or is not the record's live entry.
local found = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])[1]
if not found then return 0 end
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[2], ARGV[1], ARGV[1], 1)
if type(pending) == 'table' and pending[1] then return 0 end
if redis.call('HGET', KEYS[3], 'entry') ~= ARGV[1] then return 0 end
local entry = redis.call('XADD', KEYS[2], '*', unpack(found[2]))
redis.call('XDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[3], 'entry', entry)
redis.call('HDEL', KEYS[3], 'owner')
return 1
