-- Take entries from other workers' own streams (placement by prefix): those
-- that waited undelivered at least their stream's least age. A busy owner's
-- stream's least age is TOKENFLEET_AFFINITY_STEAL_MS, so no job waits long
-- behind it while this worker has a free slot; a dead or gone owner's is 0,
-- so its waiting jobs are taken over at once (its pending ones are reclaimed
-- as every dead consumer's are).
-- KEYS: the streams, all of one partition (one slot)
-- ARGV: 1 group, 2 consumer, 3 the most entries to take in all, then per
--       stream its least age (ms)
-- Returns per stream that gave entries {its index in KEYS, entries as
-- XREADGROUP gives them}, and last the ms until the next entry not yet old
-- enough will be ('' for none).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local left = tonumber(ARGV[3])
local out, due = {}, nil
for i, stream in ipairs(KEYS) do
  if left <= 0 then break end
  local age = tonumber(ARGV[3 + i])
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  local last
  if type(groups) == 'table' and not groups.err then
    for _, group in ipairs(groups) do
      local fields = {}
      for j = 1, #group, 2 do fields[group[j]] = group[j + 1] end
      if fields.name == ARGV[1] then last = fields['last-delivered-id'] end
    end
  end
  if last then
    -- Past the last entry delivered: the ones no worker has read yet, oldest first.
    local ripe = 0
    for _, entry in ipairs(redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', left)) do
      local ms = tonumber(string.match(entry[1], '^(%d+)'))
      if now - ms < age then
        if not due or ms + age - now < due then due = ms + age - now end
        break
      end
      ripe = ripe + 1
    end
    if ripe > 0 then
      local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ripe,
                             'STREAMS', stream, '>')
      if got and got[1] then
        out[#out + 1] = {i, got[1][2]}
        left = left - #got[1][2]
      end
    end
  end
end
out[#out + 1] = due and tostring(due) or ''
return out
