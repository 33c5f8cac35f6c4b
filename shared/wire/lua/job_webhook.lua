-- A fragment, not a script: the scripts that end a job (finish.lua, cancel.lua,
-- expire.lua) include it (a line '-- include: job_webhook.lua').
--
-- job_webhook(outbox, job, status, now): when the job's record names a
-- webhook_url (submit's webhook_url), add its end event to the queue's outbox
-- (Keys.job_webhooks: a stream in the queue's slot, so the script may write it
-- on a Redis Cluster too). Added in the step that writes the final state, which
-- runs once per job (a script that finds the job ended writes nothing), so the
-- event is added exactly once: never lost to a crash between two writes, never
-- twice. Its id comes from the job's, the same if anything were to repeat it.
local JOB_EVENTS = {succeeded = 'job.completed', failed = 'job.failed',
                    cancelled = 'job.cancelled', expired = 'job.expired'}

local function job_webhook(outbox, job, status, now)
  local cur = redis.call('HMGET', job, 'webhook_url', 'id', 'finish_reason', 'error', 'tenant')
  local url, id = cur[1], cur[2]
  if not url or not id or not JOB_EVENTS[status] then return end
  local data = {id = id, status = status, finished_at = tonumber(now)}
  if cur[3] and cur[3] ~= '' then data['finish_reason'] = cur[3] end
  if cur[4] and cur[4] ~= '' then data['error'] = cur[4] end
  -- The tenant picks the event's delivery lane and signing secret (none: the default's).
  redis.call('XADD', outbox, '*', 'id', 'msg_' .. string.gsub(id, '[^%w]', '_'),
             'type', JOB_EVENTS[status], 'data', cjson.encode(data), 'url', url,
             'tenant', cur[5] or 'default')
end
