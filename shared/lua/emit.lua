-- Append one step's token events to their jobs' logs and publish them.
-- Log entry ids are '0-<index+1>', so a token is logged once whoever writes it.
-- KEYS: per event: job hash, token log, event channel
-- ARGV: 1 result TTL, 2 now, then per event: attempt, index, event JSON
-- Returns the 0-based positions of events whose job this attempt no longer owns.
local fenced = {}
for i = 0, #KEYS / 3 - 1 do
  local job, log, chan = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local attempt, index, payload = ARGV[3 * i + 3], ARGV[3 * i + 4], ARGV[3 * i + 5]
  if redis.call('HGET', job, 'attempts') ~= attempt then
    fenced[#fenced + 1] = i
  else
    local added = redis.pcall('XADD', log, '0-' .. (tonumber(index) + 1), 'e', payload)
    if type(added) ~= 'table' or not added.err then
      redis.call('PUBLISH', chan, payload)
      if index == '0' then
        redis.call('HSET', job, 'first_token_at', ARGV[2])
        redis.call('EXPIRE', log, ARGV[1])
      end
    end
  end
end
return fenced
