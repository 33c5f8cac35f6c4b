-- Count one request of an API key against its per-minute limits, atomically: a
-- sliding window of the last ARGV[2] seconds holds at most rpm requests and tpm
-- tokens, whichever gateway admitted them (every gateway runs this on the same keys).
-- KEYS: 1 the key's requests (sorted set: member request id, score its time),
--       2 its token charges (sorted set: member '<request id> <tokens>', score its time),
--       3 the sum of those charges (counter, kept with them)
-- ARGV: 1 now (s, the fleet's clock), 2 window (s), 3 rpm (0: none), 4 tpm (0: none),
--       5 request id, 6 requests asked (1; 0 only reads the state), 7 tokens asked
-- Returns {verdict, requests in the window, tokens in the window, retry after (s),
--          until the requests' window is empty (s), until the tokens' window is empty (s)}
--   verdict 'ok' (counted), 'requests' or 'tokens' (over that limit: nothing counted),
--   'oversize' (the request alone asks more tokens than tpm: it can never pass)
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local rpm, tpm = tonumber(ARGV[3]), tonumber(ARGV[4])
local asked_requests, asked_tokens = tonumber(ARGV[6]), tonumber(ARGV[7])
local since = now - window

local function tokens_of(member) return tonumber(string.match(member, ' (%-?%d+)$')) end

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', since)
-- Charges leave the total as they leave the window.
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', since)
for _, member in ipairs(expired) do total = total - tokens_of(member) end
if #expired > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', since) end
local requests = redis.call('ZCARD', KEYS[1])

local verdict, retry = 'ok', 0
if asked_requests > 0 and rpm > 0 and requests + asked_requests > rpm then
  -- Room comes back when the request at this rank leaves the window.
  local frees = redis.call('ZRANGE', KEYS[1], requests - rpm, requests - rpm, 'WITHSCORES')
  verdict, retry = 'requests', tonumber(frees[2]) + window - now
elseif tpm > 0 and asked_tokens > tpm then
  verdict = 'oversize'
elseif tpm > 0 and asked_tokens > 0 and total + asked_tokens > tpm then
  -- Walk the oldest charges until enough would have left the window.
  local need = total + asked_tokens - tpm
  local charges = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  verdict, retry = 'tokens', window
  for i = 1, #charges, 2 do
    need = need - tokens_of(charges[i])
    if need <= 0 then retry = tonumber(charges[i + 1]) + window - now break end
  end
end

if verdict == 'ok' then
  if asked_requests > 0 then
    redis.call('ZADD', KEYS[1], now, ARGV[5])
    requests = requests + 1
  end
  if asked_tokens > 0 then
    redis.call('ZADD', KEYS[2], now, ARGV[5] .. ' ' .. asked_tokens)
    total = total + asked_tokens
  end
end
-- Everything is gone once the window has passed: no key outlives it by much.
local ttl_ms = math.ceil(window * 1000) + 1000
redis.call('SET', KEYS[3], total, 'PX', ttl_ms)
redis.call('PEXPIRE', KEYS[1], ttl_ms)
redis.call('PEXPIRE', KEYS[2], ttl_ms)

local function empties(key)
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #newest == 0 then return 0 end
  return math.max(0, tonumber(newest[2]) + window - now)
end
return {verdict, tostring(requests), tostring(total), tostring(math.max(0, retry)),
        tostring(empties(KEYS[1])), tostring(empties(KEYS[2]))}
