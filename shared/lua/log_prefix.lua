-- A fragment, not a script: scripts that read a job's token log include it
-- (a line '-- include: log_prefix.lua'), so the log's id scheme is written once.
--
-- A token event holds tokens [i, j) of a job (its index i and j - i token ids;
-- the output side coalesces the tokens a job made within a short window into
-- one event) and is logged at id '0-<j>': the id says where the event ends,
-- the event where it starts. So the top token entry's id is the number of
-- tokens logged, and an event sent again (a reply lost) finds its own entry.
-- A one-token event is at '0-<i+1>', the id tokens always had. The end event
-- is at '1-0', after every token.
--
-- log_end(log): how many tokens the log holds (its top token entry's id), 0
-- for none.
-- log_prefix(log) reads the contiguous prefix of the token events: from index
-- 0, each event's index where the one before left off, each entry at the id
-- its end gives, with a list of integer token ids and a text. The first gap or
-- malformed event ends it. Returns {payloads, token ids, text, next index}.
local function log_end(log)
  local top = redis.call('XREVRANGE', log, '0-18446744073709551615', '-', 'COUNT', 1)
  if #top == 0 then return 0 end
  return tonumber(string.sub(top[1][1], 3))
end

local function log_prefix(log)
  local payloads, ids, texts, index = {}, {}, {}, 0
  for _, item in ipairs(redis.call('XRANGE', log, '0-1', '0-18446744073709551615')) do
    if item[2][1] ~= 'e' then break end
    -- cjson.decode raises on anything but JSON; nothing else runs in this pcall.
    local ok, event = pcall(cjson.decode, item[2][2])
    if not ok or type(event) ~= 'table' or event.index ~= index
       or type(event.text) ~= 'string' or type(event.token_ids) ~= 'table'
       or #event.token_ids == 0 or item[1] ~= '0-' .. (index + #event.token_ids) then
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
