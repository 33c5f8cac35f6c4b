-- Read a worker's credits from a queue's streams, shared fairly among tenants:
-- at each priority level, every entry goes to the tenant with queued work that
-- has the fewest virtual tokens served (weighted fair queuing, the "virtual
-- token counter"), and is charged to it: the job's weight in tokens (prompt
-- estimate + max_new_tokens, the entry's 'w') over the tenant's weight. The
-- counters are the fleet's, so every worker of the queue deals from the same.
-- A tenant alone takes every credit of its level.
-- A tenant without queued work banks nothing: its counter is lifted to 'burst'
-- below the least counter of the tenants that have work, so when it comes back
-- it starts that far ahead (a short burst from a quiet tenant runs at once)
-- and then shares; a tenant new to the level starts at the least counter.
-- A level that has fewer entries than its credits leaves the rest to the
-- others, highest first (ARGV's order).
-- KEYS: per level: its counters (hash: tenant -> virtual tokens), then the
--       level's stream of each of its tenants
-- ARGV: 1 group, 2 consumer, 3 burst (virtual tokens), 4 m: how many levels,
--       then per level: its credits, k: how many streams, then per stream its
--       tenant's name and weight
-- Returns per stream that gave entries: {index of the stream in KEYS, entries
-- as XREADGROUP gives them}.
local group, consumer, burst = ARGV[1], ARGV[2], tonumber(ARGV[3])

local levels, key, arg = {}, 1, 5
for _ = 1, tonumber(ARGV[4]) do
  local level = {counters = KEYS[key], credits = tonumber(ARGV[arg]), tenants = {}}
  local k = tonumber(ARGV[arg + 1])
  arg = arg + 2
  for i = 1, k do
    level.tenants[i] = {key = key + i, name = ARGV[arg], weight = tonumber(ARGV[arg + 1]),
                        got = {}, empty = false}
    arg = arg + 2
  end
  key = key + k + 1
  levels[#levels + 1] = level
end

local function load(level)
  local names = {}
  for i, t in ipairs(level.tenants) do names[i] = t.name end
  local known = redis.call('HMGET', level.counters, unpack(names))
  local least
  for i, t in ipairs(level.tenants) do
    t.vt = tonumber(known[i])
    if t.vt and (not least or t.vt < least) then least = t.vt end
  end
  for _, t in ipairs(level.tenants) do
    if not t.vt then t.vt, t.changed = least or 0, true end
  end
end

-- The tenant with work (as far as known) that has the fewest virtual tokens.
local function next_tenant(level)
  local best, others = nil, 0
  for _, t in ipairs(level.tenants) do
    if not t.empty then
      others = others + 1
      if not best or t.vt < best.vt then best = t end
    end
  end
  return best, others - 1
end

-- Deal up to n credits at a level; returns how many were taken.
local function deal(level, n)
  local taken = 0
  while taken < n do
    local t, others = next_tenant(level)
    if not t then break end
    -- One by one while tenants compete (each entry moves the counters); the
    -- last tenant with work takes the rest in one read.
    local count = others == 0 and n - taken or 1
    local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count,
                             'STREAMS', KEYS[t.key], '>')
    local entries = reply and reply[1][2] or {}
    for _, entry in ipairs(entries) do
      t.got[#t.got + 1] = entry
      local w = 1
      local fields = entry[2]
      for f = 1, #fields, 2 do
        if fields[f] == 'w' then w = tonumber(fields[f + 1]) or 1 end
      end
      t.vt, t.changed = t.vt + w / t.weight, true
    end
    taken = taken + #entries
    if #entries < count then t.empty = true end
  end
  return taken
end

local short = 0
for _, level in ipairs(levels) do
  load(level)
  short = short + level.credits - deal(level, level.credits)
end
for _, level in ipairs(levels) do
  if short <= 0 then break end
  short = short - deal(level, short)
end

local out = {}
for _, level in ipairs(levels) do
  local floor
  for _, t in ipairs(level.tenants) do
    if not t.empty and (not floor or t.vt < floor) then floor = t.vt end
  end
  local updates = {}
  for _, t in ipairs(level.tenants) do
    if floor and t.empty and t.vt < floor - burst then t.vt, t.changed = floor - burst, true end
    if t.changed then
      updates[#updates + 1] = t.name
      updates[#updates + 1] = tostring(t.vt)
    end
    if #t.got > 0 then out[#out + 1] = {t.key, t.got} end
  end
  if #updates > 0 then redis.call('HSET', level.counters, unpack(updates)) end
end
return out
