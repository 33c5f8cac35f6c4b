-- A fragment, not a script: scripts that read a job's token log include it
-- (a line '-- include: log_prefix.lua'), so the log's id scheme is written once.
--
-- A token event with first token at index i is logged at id '0-<i+1>'; the end
-- event at '1-0', after every token. log_prefix(log) reads the contiguous
-- prefix of the token events: from index 0, each entry at the id its index
-- gives, its index where the one before left off, with a list of integer
-- token ids and a text. The first gap or malformed event ends it.
-- Returns {payloads, token ids, text, next index}.
local function log_prefix(log)
  local payloads, ids, texts, index = {}, {}, {}, 0
  for _, item in ipairs(redis.call('XRANGE', log, '0-1', '0-18446744073709551615')) do
    if item[1] ~= '0-' .. (index + 1) or item[2][1] ~= 'e' then break end
    -- cjson.decode raises on anything but JSON; nothing else runs in this pcall.
    local ok, event = pcall(cjson.decode, item[2][2])
    if not ok or type(event) ~= 'table' or event.index ~= index
       or type(event.text) ~= 'string' or type(event.token_ids) ~= 'table'
       or #event.token_ids == 0 then
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
