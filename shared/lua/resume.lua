-- Resume a job from its token log under the caller's new attempt: keep the
-- log's contiguous prefix and delete every entry after it. Entries past a gap
-- would otherwise sit at the ids the new attempt writes its tokens to (its
-- writes refused, or a consumer given tokens out of order); with them gone the
-- log stays gap-free and each token is logged exactly once. The stream's last
-- id goes back to the prefix's end ('0-<k>' for k tokens, log_prefix.lua), so
-- the next event's XADD ('0-<k+n>' for n tokens) lands.
-- KEYS: 1 job hash, 2 token log
-- ARGV: 1 attempt of the caller
-- Returns {'fenced'} when the attempt is no longer the caller's, else
-- {'ok', payload of each kept token event, in order}.
-- include: log_prefix.lua
local attempts = redis.call('HGET', KEYS[1], 'attempts')
if attempts ~= ARGV[1] then return {'fenced'} end
local kind = redis.call('TYPE', KEYS[2]).ok
if kind == 'none' then return {'ok'} end
if kind ~= 'stream' then
  return redis.error_reply('the token log is a ' .. kind .. ', not a stream')
end
local prefix = log_prefix(KEYS[2])
local last = '0-' .. prefix[4]
local rest = {}
for _, item in ipairs(redis.call('XRANGE', KEYS[2], '(' .. last, '+')) do
  rest[#rest + 1] = item[1]
end
if #rest > 0 then
  redis.call('XDEL', KEYS[2], unpack(rest))
  redis.call('XSETID', KEYS[2], last)
end
local out = {'ok'}
for _, payload in ipairs(prefix[1]) do out[#out + 1] = payload end
return out
