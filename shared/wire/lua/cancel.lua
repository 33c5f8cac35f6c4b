-- Cancel a job. A queued one ends here and now, keeping what earlier attempts
-- generated (a job handed back by a drain, or queued again after a reclaim, has
-- tokens in its log that stream() already delivered: its text and token ids are
-- that log's contiguous prefix). A running one is flagged and its worker told on
-- the cancels channel (it leaves the batch within one step, with its text).
-- A queued job past its deadline is not cancelled: it can no longer start, and
-- readers report it expired (the worker that reads its entry, or a repair, ends
-- its record so): 'ended'.
-- Returns 'cancelled', 'requested', 'ended' (nothing to cancel) or 'missing'.
-- PUBLISH: SPUBLISH on a Redis Cluster, else PUBLISH (set before the source: scripts.py),
-- for the job's channels; the cancels channel, one for the fleet, is a classic one.
-- KEYS: 1 job hash, 2 token log, 3 event channel, 4 queue stream, 5 backlog counter,
--       6 end channel, 7 the queue's webhook outbox (job_webhook.lua)
-- ARGV: 1 now, 2 result TTL, 3 end event JSON, 4 cancels channel, 5 job id, 6 group
-- include: log_prefix.lua
-- include: job_webhook.lua
local cur = redis.call('HMGET', KEYS[1], 'status', 'deadline_at')
local status = cur[1]
if not status then return 'missing' end
if status == 'queued' and cur[2] and tonumber(cur[2]) <= tonumber(ARGV[1]) then
  return 'ended'
end
if status == 'queued' then
  local text, token_ids = '', '[]'
  local log_kind = redis.call('TYPE', KEYS[2]).ok
  if log_kind == 'stream' then
    local prefix = log_prefix(KEYS[2])
    text, token_ids = prefix[3], '[' .. table.concat(prefix[2], ',') .. ']'
  end
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finish_reason', 'cancelled',
             'finished_at', ARGV[1], 'text', text, 'token_ids', token_ids)
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  if log_kind == 'stream' or log_kind == 'none' then
    -- '1-0' sorts after every token entry ('0-<n>', log_prefix.lua): the end
    -- is always last. An end already there (a cancel that raced this one) is kept.
    local added = redis.pcall('XADD', KEYS[2], '1-0', 'e', ARGV[3])
    if type(added) == 'table' and added.err and not string.find(added.err, 'equal or smaller', 1, true) then
      return redis.error_reply(added.err)
    end
    redis.call('EXPIRE', KEYS[2], ARGV[2])
  end
  redis.call(PUBLISH, KEYS[3], ARGV[3])
  redis.call(PUBLISH, KEYS[6], ARGV[3])
  job_webhook(KEYS[7], KEYS[1], 'cancelled', ARGV[1])
  -- Off the queue now, so it no longer counts against max_queue. If a worker
  -- has read it but not yet taken it, that worker finds it cancelled and acks.
  -- The record names its live entry (submit and requeue keep it so).
  local entry = redis.call('HGET', KEYS[1], 'entry')
  redis.call('DECRBY', KEYS[5], redis.call('HGET', KEYS[1], 'weight') or 0)
  if entry then
    redis.call('XACK', KEYS[4], ARGV[6], entry)
    redis.call('XDEL', KEYS[4], entry)
  end
  return 'cancelled'
end
if status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
  redis.call('PUBLISH', ARGV[4], ARGV[5])
  return 'requested'
end
return 'ended'
