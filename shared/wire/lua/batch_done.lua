-- Mark a batch's lines done and count them, each line once: two drivers that
-- collect the same line (a lease that lapsed during a long step), or a driver
-- that collects it again after a crash, count it once, so the batch never
-- ends before all its lines are done. A line stays in the running hash until
-- its job's keys are let go (the driver does that next): a crash in between
-- leaves it there, done, and the next collect lets it go.
-- KEYS: 1 the batch's record (hash), 2 its done bitmap
-- ARGV: triples: line index, 'out' or 'err', tokens its job generated
-- Returns the number of lines newly marked done.
local counts = {out = 0, err = 0}
local tokens = 0
local new = 0
for i = 1, #ARGV, 3 do
  if redis.call('SETBIT', KEYS[2], ARGV[i], 1) == 0 then
    counts[ARGV[i + 1]] = counts[ARGV[i + 1]] + 1
    tokens = tokens + tonumber(ARGV[i + 2])
    new = new + 1
  end
end
if counts.out > 0 then redis.call('HINCRBY', KEYS[1], 'completed', counts.out) end
if counts.err > 0 then redis.call('HINCRBY', KEYS[1], 'failed', counts.err) end
if tokens > 0 then redis.call('HINCRBY', KEYS[1], 'tokens', tokens) end
return new
