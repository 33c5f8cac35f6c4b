-- Forget a worker that owns streams of its own (placement by prefix) and is no
-- longer live, once those streams hold nothing (no job waiting there, none
-- pending: a finished entry is deleted): the streams go, with its place among
-- the owners and the prefixes it held. A live one, or one whose streams still
-- hold jobs (its peers take them over first), is left as it is.
-- KEYS: 1 the owners (hash), 2 the owned levels (set), 3 its held prefixes,
--       4 the queue's live workers (sorted set)
-- ARGV: 1 its tag, 2 the key its streams' names start with ('<ns>:q:{<queue>}'),
--       3 the score a live worker has at least
-- Returns 1 when it was forgotten, else 0.
local info = redis.call('HGET', KEYS[1], ARGV[1])
if info then
  local ok, owner = pcall(cjson.decode, info)
  local worker = ok and type(owner) == 'table' and owner.worker
  if type(worker) == 'string' then
    local seen = redis.call('ZSCORE', KEYS[4], worker)
    if seen and tonumber(seen) >= tonumber(ARGV[3]) then return 0 end
  end
end
local streams = {}
for _, level in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local rest, tag = string.match(level, '^[^:]+:(.+):(w%x+)$')
  if tag == ARGV[1] then
    local key = ARGV[2] .. ':' .. rest .. ':' .. tag
    if redis.call('XLEN', key) > 0 then return 0 end
    streams[#streams + 1] = {level, key}
  end
end
for _, stream in ipairs(streams) do
  redis.call('SREM', KEYS[2], stream[1])
  redis.call('DEL', stream[2])
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[3])
return 1
