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
-- A stored response's job (its record names the response): OpenAI's events, whose
-- data is the response's id (a receiver reads the response with it).
local RESPONSE_EVENTS = {succeeded = 'response.completed', failed = 'response.failed',
                         cancelled = 'response.cancelled', expired = 'response.failed'}

local function job_webhook(outbox, job, status, now)
  local cur = redis.call('HMGET', job, 'webhook_url', 'id', 'finish_reason', 'error', 'tenant',
                         'response_id')
  local url, id, response = cur[1], cur[2], cur[6]
  -- A background response's event goes to the fleet's URL where it names none
  -- (an empty url: the deliverer's TOKENFLEET_WEBHOOK_URL, as a batch's).
  if not (url or response) or not id or not JOB_EVENTS[status] then return end
  local kind, data = JOB_EVENTS[status], {id = id, status = status, finished_at = tonumber(now)}
  if response then
    kind, data = RESPONSE_EVENTS[status], {id = response}
    if status == 'succeeded' and cur[3] == 'length' then kind = 'response.incomplete' end
    id = response
  else
    if cur[3] and cur[3] ~= '' then data['finish_reason'] = cur[3] end
    if cur[4] and cur[4] ~= '' then data['error'] = cur[4] end
  end
  -- The tenant picks the event's delivery lane and signing secret (none: the default's).
  redis.call('XADD', outbox, '*', 'id', 'msg_' .. string.gsub(id, '[^%w]', '_'),
             'type', kind, 'data', cjson.encode(data), 'url', url or '',
             'tenant', cur[5] or 'default')
end
