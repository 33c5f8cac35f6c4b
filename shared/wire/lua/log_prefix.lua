-- A fragment, not a script: scripts that read or write a job's token log
-- include it (a line '-- include: log_prefix.lua'), so the log's id scheme is
-- written once.
--
-- A token event holds tokens [i, j) of a job (its index i and j - i token ids;
-- the output side coalesces the tokens a job made within a short window into
-- one event). Attempt a logs it at id '0-<(a - 1) * BAND + j>': the low ten
-- digits say where the event ends (the event says where it starts), the digits
-- above them which attempt wrote it. So the first attempt's events sit at
-- '0-<j>', the ids tokens always had; the top token entry says how many tokens
-- the log holds; and an event sent again (a reply lost) finds its own entry.
-- The end event is at '1-0', after every token.
--
-- The attempt in the id is the fence: Redis refuses an XADD at or below a
-- stream's last id, and a new attempt's resume (resume.lua) moves that id up to
-- its own band, so every later write of an older attempt fails by itself,
-- without a read of the job record. Attempts past BANDS share the last band;
-- their writes check the record instead. (The worker computes the same ids:
-- worker_scripts.log_entry_id.)
--
-- log_id(attempt, j): the id of an event of attempt (a string) ending at token j.
-- attempt_of(id): the attempt (a string) whose band id is in.
-- tokens_at(id): the token an entry at id ends at.
-- log_end(log): how many tokens the log holds (from its top token entry's id),
-- 0 for none.
-- log_prefix(log) reads the contiguous prefix of the token events: from index
-- 0, each event's index where the one before left off, each entry at the id
-- its end gives (in any attempt's band), with a list of integer token ids and
-- a text. The first gap or malformed event ends it. Returns {payloads, token
-- ids, text, next index}.
local BAND = 10000000000
-- (BANDS - 1) * BAND + BAND - 1 < 2^53: every id is a whole Lua number.
local BANDS = 900000

local function log_id(attempt, j)
  local a = math.max(1, math.min(tonumber(attempt) or 1, BANDS))
  return string.format('0-%d', (a - 1) * BAND + j)
end

local function tokens_at(id)
  return tonumber(string.sub(id, 3)) % BAND
end

local function attempt_of(id)
  return string.format('%d', math.floor(tonumber(string.sub(id, 3)) / BAND) + 1)
end

local function log_end(log)
  local top = redis.call('XREVRANGE', log, '0-18446744073709551615', '-', 'COUNT', 1)
  if #top == 0 then return 0 end
  return tokens_at(top[1][1])
end

local function log_prefix(log)
  local payloads, ids, texts, index = {}, {}, {}, 0
  for _, item in ipairs(redis.call('XRANGE', log, '0-1', '0-18446744073709551615')) do
    if item[2][1] ~= 'e' then break end
    -- cjson.decode raises on anything but JSON; nothing else runs in this pcall.
    local ok, event = pcall(cjson.decode, item[2][2])
    if not ok or type(event) ~= 'table' or event.index ~= index
       or type(event.text) ~= 'string' or type(event.token_ids) ~= 'table'
       or #event.token_ids == 0 or tokens_at(item[1]) ~= index + #event.token_ids then
      break
    end
    local whole = true
    for _, id in ipairs(event.token_ids) do
      if type(id) ~= 'number' or id ~= math.floor(id) or id < 0 then whole = false end
    end
    if not whole then break end
    for _, id in ipairs(event.token_ids) do ids[#ids + 1] = string.format('%d', id) end
    payloads[#payloads + 1] = item[2][2]
    texts[#texts + 1] = event.text
    index = index + #event.token_ids
  end
  return {payloads, ids, table.concat(texts), index}
end
