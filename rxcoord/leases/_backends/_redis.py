"""Leases in Redis (a server or a cluster): one Lua script per operation, pub/sub for waiters.

Keys:

* ``<prefix>{name}`` - the lease (on a cluster, ``<prefix>}{#name}`` for a name that starts
  with ``}``, which would leave ``{name}`` an empty hash tag): value ``token`` (or
  ``token:least_until_ms`` when ``at_least_for`` > 0), followed by ``!`` once a waiter marked
  it (see "Notifications" below), expiring after ``at_most_for`` (``PX``): Redis's clock
  decides expiry, and an expired or released lease leaves no key behind. Released inside
  ``at_least_for``, it becomes ``r:token`` until then.
* the token sequence, store-wide rather than per name, so that no key of a name outlives its
  lease and tokens still increase per name: ``<prefix>seq`` on a server; on a cluster, where
  one script may only touch keys of one hash slot, one ``<prefix>seq:{tag}`` per slot in use
  (``tag`` is chosen to hash to the lease key's slot), at most 16,384 keys however many names
  come and go. The sequence never expires, so tokens keep growing across grants, expiries and
  client restarts (and server restarts only with persistence: with ``appendonly yes`` +
  ``appendfsync always``; without it a restarted Redis forgets them). A per-name counter left by
  an older version (``<prefix>{name}:token``) is folded into the sequence and deleted the next
  time the name is granted, so tokens never go back; do not mix versions on one prefix.
* fleet permits (``_permits.py``), three keys per busy group, all under one hash tag
  ``{#group}`` so that a step's script may touch them together on a cluster (one slot; the
  ``#`` keeps the tag non-empty whatever the group is called), and the same slot's token
  sequence, from which permits take their fencing tokens like leases do (on a cluster, then, a
  permit's token exceeds every earlier grant's of its slot, leases whose keys hash there
  included, but not those of other slots: one script reaches one slot):

  - ``<prefix>fleet:{#group}:p``: the permits, a sorted set of ``token:tenant`` (the tenant
    last, so it may contain ``:``) scored by their ``until`` in ms of Redis's clock (``TIME``;
    durations are rounded up to whole ms, as for leases);
  - ``<prefix>fleet:{#group}:d``: the demand, a sorted set of tenants scored by ``until``;
  - ``<prefix>fleet:{#group}:t``: a hash of per-tenant state, ``n<tenant>`` (permits held),
    ``p<tenant>`` (the stride pass, a double written with 17 digits), ``l<tenant>`` (the
    tenant limit recorded with its demand), ``q<tenant>`` (with its demand, when it has a
    rate: from when, in us, it is within that rate), and of the group's: ``c`` (the clock, the
    latest grant's pass), ``r`` and ``d`` (the two sets' sizes: one ``HMGET`` reads them with
    the caller's state, and an idle group needs no expiry scan), ``x`` (the expiry given to
    the group's keys, ms);
  - ``<prefix>fleet:{#group}:q``: the rate buckets (GCRA, ``rxcoord/_core/rate.py``), a sorted
    set of ``g`` (the group's) and ``t<tenant>`` scored by their theoretical arrival time in
    us of Redis's clock; a bucket whose time has passed is full, i.e. the same as none, so
    the steps drop those and the key expires at its latest score.

  Expiry is by score: every step first drops what expired by the server's clock (so a crashed
  waiter's demand stops counting when it lapses). A tenant with neither permits nor demand
  loses its fields, and a group with neither loses the first three keys (the sorted sets
  vanish when emptied, the hash is deleted), so an idle group leaves only the sequence (and
  its rate buckets until full). Keys also carry a TTL no earlier than everything in them
  expires (``x``, set once per horizon, not per step), so a group nobody calls any more (a
  crashed fleet) goes by itself. The steps publish on the channel of the group's wait hub
  (``_channel(hub_name(group))``).

Each operation is one ``EVALSHA`` (falling back to ``EVAL`` once after a script-cache flush),
so the check, the grant and ``INCR`` of the token are one atomic step:

* grant: ``PTTL`` the lease; if it exists return its remaining time (a waiter's attempt marks
  it); else ``INCR`` the sequence and ``SET ... PX``;
* extend / release: compare the stored token; release ``DEL``s the key (or, inside
  ``at_least_for``, replaces it with a ``released`` marker expiring then) and, if a waiter
  marked the lease, ``PUBLISH``es on the name's channel, which wakes waiters in every process;
* fleet permits: acquire, release and extend are ``PermitGroup``'s steps, each one script,
  rates included (one round trip admits a job under its permit and its rates).

Notifications only when someone waits (as PostgreSQL's releases since the leases work): a
``PUBLISH`` costs the server a channel lookup and a fan-out on every release, and nobody listens
to most of them. A release publishes only if its lease's value ends with ``!``, the mark a
waiter leaves. A waiter's attempt (one for a name this provider's listener is subscribed to,
``Listener.watching``) marks: a grant it wins is written marked (the rest of its queue sleeps
until that lease is released), and if it gets nothing it marks the lease it found, in the same
script. Any other grant writes an unmarked value. Why no wake-up is lost: a waiter's attempts
after its subscription is confirmed (the waiting machinery always makes one) are all marking
ones, so a waiter sleeps only after a marking attempt, after its ``SUBSCRIBE`` took effect, and
until the remaining time that attempt read. Scripts run one at a time, so the lease that attempt
found (or its queue's head won) carries the mark from then on, and its release, a later script,
sees it and publishes after the subscription: the waiter hears it. Between the attempt and that
release no script can take the mark away but a new grant of the name, which needs the marked
lease gone first: released (published) or expired (the waiter's timer is due then, and its
next attempt marks whatever grant it finds). A lease released inside ``at_least_for`` becomes
``r:token`` and is never marked: its end is an expiry, which the waiter's timer covers.

Connections: redis-py's ``Connection`` objects, in a pool of this module's own (a deque of idle
connections). redis-py's client and pool wrap every command in machinery a lease does not need
(a retry wrapper, observability hooks, pool bookkeeping) that costs the client more time than
the Lua scripts cost the server: through it a try_acquire + release pair ran at about 0.8x the
raw ``SET NX PX`` + ``DEL`` pair on loopback; with plain connections it runs well above it.
Retries would be wrong anyway: retrying a release whose reply was lost finds the lease already
released and reports a false loss. A failed call raises ``LeaseStoreUnavailable``; an idle
connection the server has closed (a restart) is noticed before reuse and replaced, so the first
call after a restart succeeds. On a cluster, commands go through redis-py's ``RedisCluster``
(slot routing, ``MOVED``/``ASK``) with its retries turned off for the same reason, and the
listener subscribes on one node: classic pub/sub messages reach every node of a cluster.
Refusals no retry can fix (``WRONGPASS``, ``NOPERM``, ``NOAUTH``, a database index the server
does not have, a cluster node given to a plain provider) raise ``LeaseStoreMisconfigured``.
"""

from __future__ import annotations

import binascii
import hashlib
import math
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from time import monotonic
from typing import TYPE_CHECKING, Any, Final

from rxcoord._errors import LeaseStoreMisconfigured, LeaseStoreUnavailable

from ..._core.checks import check_length
from .._base import LeaseProvider
from .._listing import LeaseEntry, StoreListing, group_entry
from .._notify import Listener, WaitHub
from .._permits import PermitReply, RateArgs, hub_name
from ._drivers import require, route_driver_logs

if TYPE_CHECKING:
    import redis
    import redis.cluster

__all__ = ["RedisLeases"]

# KEYS: lease, sequence, legacy per-name counter. ARGV: at_most_for ms, at_least_for ms, a
# waiter's attempt (1/0: mark the grant it wins or finds, see "Notifications" above).
# Returns the new token (> 0), or -1 - remaining_ms when the name is taken.
_GRANT: Final = """
local ttl = redis.call('PTTL', KEYS[1])
if ttl >= 0 then
  if ARGV[3] == '1' then
    local v = redis.call('GET', KEYS[1])
    if string.sub(v, -1) ~= '!' and string.sub(v, 1, 2) ~= 'r:' then
      redis.call('SET', KEYS[1], v .. '!', 'KEEPTTL')
    end
  end
  return -1 - ttl
end
if ttl == -1 then return -1001 end
local legacy = redis.call('GET', KEYS[3])
if legacy then
  if tonumber(legacy) > tonumber(redis.call('GET', KEYS[2]) or '0') then
    redis.call('SET', KEYS[2], legacy)
  end
  redis.call('DEL', KEYS[3])
end
local token = redis.call('INCR', KEYS[2])
local value = token
if ARGV[2] ~= '0' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  value = token .. ':' .. string.format('%d', now + tonumber(ARGV[2]))
end
if ARGV[3] == '1' then value = value .. '!' end
redis.call('SET', KEYS[1], value, 'PX', ARGV[1])
return token
"""

# KEYS: lease. Returns nil, or {token, remaining ms, released (0/1)}.
_HOLDER: Final = """
local v = redis.call('GET', KEYS[1])
if not v then return nil end
local ttl = redis.call('PTTL', KEYS[1])
local released = 0
local token = string.match(v, '^(%d+)!?$') or string.match(v, '^(%d+):%d+!?$')
if not token then
  released = 1
  token = string.match(v, '^r:(%d+)$') or '0'
end
return {tonumber(token), ttl, released}
"""

# KEYS: lease. ARGV: token, at_most_for ms. Returns 1 if extended, 0 if not ours.
_EXTEND: Final = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] or v == ARGV[1] .. '!' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not v then return 0 end
local token, least = string.match(v, '^(%d+):(%d+)!?$')
if token ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
local left = tonumber(least) - (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local ms = tonumber(ARGV[2])
if left > ms then ms = left end
redis.call('PEXPIRE', KEYS[1], ms)
return 1
"""

# KEYS: lease. ARGV: token, channel. Returns 1 if released, 0 if not ours. Publishes only if a
# waiter marked the lease ('!' at the end of its value).
_RELEASE: Final = """
local v = redis.call('GET', KEYS[1])
local marked = false
if v == ARGV[1] then
  redis.call('DEL', KEYS[1])
elseif v == ARGV[1] .. '!' then
  redis.call('DEL', KEYS[1])
  marked = true
else
  if not v then return 0 end
  local token, least, mark = string.match(v, '^(%d+):(%d+)(!?)$')
  if token ~= ARGV[1] then return 0 end
  marked = mark == '!'
  local t = redis.call('TIME')
  local left = tonumber(least) - (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
  if left > 0 then
    redis.call('SET', KEYS[1], 'r:' .. token, 'PX', string.format('%d', left))
  else
    redis.call('DEL', KEYS[1])
  end
end
if marked then redis.call('PUBLISH', ARGV[2], '') end
return 1
"""

# KEYS: a group's permits, demand, state. Read-only, for rxcoord inspect: Redis's clock (ms),
# then the three keys as they are (expired entries included: the caller filters by the clock).
_PERMITS_READ: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {tostring(now), redis.call('HGETALL', KEYS[3]),
        redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'),
        redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')}
"""

# -- fleet permits (the table of _permits.py; see "Keys" above) ----------------------------------
# KEYS of every permit script: permits (ZSET "token:tenant" -> until ms), demand (ZSET tenant ->
# until ms), state (HASH: "r" permits out, "d" tenants in demand, "c" the clock, and per tenant
# "n"..tenant permits held, "p"..tenant its pass, "l"..tenant its recorded tenant limit).
# The counters "r" and "d" are the two sets' sizes, kept in the hash so that one HMGET reads
# them with the caller's tenant state: a redis.call costs the server far more than the
# command it runs, and an idle group (no hash) then skips every expiry scan.
#
# Every script opens with this: Redis's clock, the counters (with the fields in FIELDS, at 3...),
# then PermitGroup.expire: permits and demand until <= now are dropped, and a tenant left with
# neither forgets its pass and limit. `changed`: the counters must be written back.
_PERMITS_EXPIRE: Final = """
local P, D, T = KEYS[1], KEYS[2], KEYS[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local head = redis.call('HMGET', T, 'r', 'd', unpack(FIELDS))
local running = tonumber(head[1]) or 0
local demand = tonumber(head[2]) or 0
local gone = {}
local lost = {}
if running > 0 then
  local expired = redis.call('ZRANGEBYSCORE', P, '-inf', now)
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', P, '-inf', now)
    running = running - #expired
    for _, member in ipairs(expired) do
      local owner = string.match(member, '^%d+:(.*)$')
      if not lost[owner] then
        lost[owner] = 0
        gone[#gone + 1] = owner
      end
      lost[owner] = lost[owner] + 1
    end
    for _, owner in ipairs(gone) do
      if redis.call('HINCRBY', T, 'n' .. owner, -lost[owner]) <= 0 then
        redis.call('HDEL', T, 'n' .. owner)
      end
    end
  end
end
if demand > 0 then
  local lapsed = redis.call('ZRANGEBYSCORE', D, '-inf', now)
  if #lapsed > 0 then
    redis.call('ZREMRANGEBYSCORE', D, '-inf', now)
    demand = demand - #lapsed
    for _, owner in ipairs(lapsed) do gone[#gone + 1] = owner end
  end
end
local forgot = {}
for _, owner in ipairs(gone) do
  if not forgot[owner] and not redis.call('HGET', T, 'n' .. owner)
      and (demand == 0 or not redis.call('ZSCORE', D, owner)) then
    redis.call('HDEL', T, 'p' .. owner, 'l' .. owner)
    forgot[owner] = true
  end
end
local changed = #gone > 0
"""

# The group's keys expire once everything in them has: `x` in the state hash is the time (ms)
# they were given, at least the latest permit's and demand's `until`. When a step writes a later
# `until` it gives every key of the group twice that horizon (so this costs a few calls once
# per horizon, not per step); a key a step creates gets the current `x`. A group nobody calls
# any more (a crashed fleet) then goes by itself. `need`: the latest `until` this step wrote;
# `madeP`/`madeD`: the step created that key.
_PERMITS_KEEP: Final = """
if running > 0 or demand > 0 then  -- else the state hash is gone: the group is idle
  local x = tonumber(head[XAT])
  if not x and head[1] then
    -- A group written before its keys had an expiry: its latest until, read once.
    for _, k in ipairs({P, D}) do
      local top = redis.call('ZRANGE', k, -1, -1, 'WITHSCORES')[2]
      if top and tonumber(top) > need then need = tonumber(top) end
    end
  end
  if need > now and (not x or need > x) then
    x = need + math.max(need - now, 1000)
    redis.call('HSET', T, 'x', x)
    for _, k in ipairs({P, D, T}) do redis.call('PEXPIREAT', k, x) end
  elseif x then
    if madeP then redis.call('PEXPIREAT', P, x) end
    if madeD then redis.call('PEXPIREAT', D, x) end
  end
end
"""

# Rates (GCRA, rxcoord/_core/rate.py) in microseconds of Redis's clock: `avail` starts may pass
# back to back at `now`, `rwait` until the n-th of them may. EPS: rate.EPSILON in microseconds.
_RATE_FUNCTIONS: Final = """
local EPS = 0.001
local function rwait(tat, now, iv, burst, n)
  local late = math.max(tat, now) + (n - 1) * iv - (burst - 1) * iv - now
  if late > EPS then return late end
  return 0
end
local function avail(tat, now, iv, burst)
  if tat <= now then return burst end
  local slack = (burst - 1) * iv + EPS - (tat - now)
  if slack < 0 then return 0 end
  local n = math.min(burst, math.floor(slack / iv) + 1)
  while n < burst and rwait(tat, now, iv, burst, n + 1) == 0 do n = n + 1 end
  while n > 0 and rwait(tat, now, iv, burst, n) > 0 do n = n - 1 end
  return n
end
"""

# KEYS: permits, demand, state, token sequence, rates (ZSET "g" -> the group's tat, "t"..tenant
# -> the tenant's, in us; the key expires with its latest tat: a full bucket is a fresh one).
# ARGV: tenant, want, weight, tenant limit, limit, most ms, demand_for ms, more (0/1), channel,
# group rate interval us (0: none), its burst, tenant rate interval us (0: none), its burst.
# PermitGroup.acquire, step by step (the state hash also keeps "q"..tenant, the time in us from
# which a waiting tenant is within its own rate, written with its demand).
# Returns {first token, tokens granted, running, tenant running, wake_in ms or -1,
#          rate wait us, group rate wait us, now us}.
_PERMITS_ACQUIRE: Final = (
    "local FIELDS = {'n' .. ARGV[1], 'p' .. ARGV[1], 'c', 'x'}\nlocal XAT = 6"
    + _PERMITS_EXPIRE
    + _RATE_FUNCTIONS
    + """
local tenant = ARGV[1]
local want = tonumber(ARGV[2])
local limit = tonumber(ARGV[5])
local gi, gb = tonumber(ARGV[10]), tonumber(ARGV[11])
local ti, tb = tonumber(ARGV[12]), tonumber(ARGV[13])
local nowus = tonumber(t[1]) * 1000000 + tonumber(t[2])
local mine = (tonumber(head[3]) or 0) - (lost[tenant] or 0)
local clock = tonumber(head[5]) or 0
local pass = clock
if not forgot[tenant] then pass = tonumber(head[4]) or clock end
if pass < clock then pass = clock end
local running0, demand0 = running, demand
local free = limit - running
local gtat, ttat = 0, 0
if gi > 0 or ti > 0 then
  local s = redis.call('ZMSCORE', KEYS[5], 'g', 't' .. tenant)
  gtat, ttat = tonumber(s[1]) or 0, tonumber(s[2]) or 0
  if gi > 0 then free = math.min(free, avail(gtat, nowus, gi, gb)) end
end
local grant = math.min(want, tonumber(ARGV[4]) - mine, free)
if ti > 0 then grant = math.min(grant, avail(ttat, nowus, ti, tb)) end
local better = 0
if grant > 0 and demand > 0 then
  -- Leave a permit (and a group token) for each other waiting tenant further behind (smaller
  -- pass) that is below its own tenant limit and within its own rate now.
  for _, other in ipairs(redis.call('ZRANGE', D, 0, -1)) do
    if other ~= tenant then
      local o = redis.call('HMGET', T, 'p' .. other, 'n' .. other, 'l' .. other, 'q' .. other)
      local theirs = tonumber(o[1]) or clock
      if theirs < clock then theirs = clock end
      if theirs < pass and (tonumber(o[2]) or 0) < (tonumber(o[3]) or 0)
          and (not o[4] or tonumber(o[4]) <= nowus + EPS) then
        better = better + 1
      end
    end
  end
  grant = math.min(grant, free - better)
end
local first = 0
if grant > 0 then
  first = redis.call('INCRBY', KEYS[4], grant) - grant + 1
  local untl = string.format('%d', now + tonumber(ARGV[6]))
  local step = 1.0 / tonumber(ARGV[3])
  local batch = {}
  for i = 0, grant - 1 do
    batch[#batch + 1] = untl
    batch[#batch + 1] = string.format('%d', first + i) .. ':' .. tenant
    if #batch >= 1000 or i == grant - 1 then
      redis.call('ZADD', P, unpack(batch))
      batch = {}
    end
    clock = pass
    pass = pass + step
  end
  running = running + grant
  mine = mine + grant
  if gi > 0 or ti > 0 then
    -- The starts the rates count: now, with the permits, in this very step.
    local z = {}
    if gi > 0 then
      gtat = math.max(gtat, nowus) + grant * gi
      z[#z + 1], z[#z + 2] = string.format('%.17g', gtat), 'g'
    end
    if ti > 0 then
      ttat = math.max(ttat, nowus) + grant * ti
      z[#z + 1], z[#z + 2] = string.format('%.17g', ttat), 't' .. tenant
    end
    redis.call('ZADD', KEYS[5], unpack(z))
    redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', nowus)  -- others' buckets full again
    local top = redis.call('ZRANGE', KEYS[5], -1, -1, 'WITHSCORES')[2]
    redis.call('PEXPIREAT', KEYS[5], math.ceil(tonumber(top) / 1000))
  end
else
  grant = 0
end
-- Passes are doubles: '%.17g' keeps every bit (Lua's own tostring keeps 14 digits).
local fields = {'r', running, 'd', 0, 'p' .. tenant, string.format('%.17g', pass)}
if grant > 0 then
  fields[7], fields[8] = 'n' .. tenant, mine
  fields[9], fields[10] = 'c', string.format('%.17g', clock)
end
local waits = grant < want or ARGV[8] == '1'
local need = 0
if grant > 0 then need = now + tonumber(ARGV[6]) end
if waits then
  demand = demand + redis.call(
    'ZADD', D, 'GT', string.format('%d', now + tonumber(ARGV[7])), tenant)
  need = math.max(need, now + tonumber(ARGV[7]))
  fields[#fields + 1] = 'l' .. tenant
  fields[#fields + 1] = ARGV[4]
  if ti > 0 then
    fields[#fields + 1] = 'q' .. tenant
    fields[#fields + 1] = string.format('%.17g', ttat - (tb - 1) * ti)
  end
elseif demand > 0 and redis.call('ZREM', D, tenant) == 1 then
  demand = demand - 1
  -- A withdrawal: a waiter may have left this free permit to it.
  if want == 0 and running < limit then redis.call('PUBLISH', ARGV[9], '') end
end
fields[4] = demand
if running == 0 and demand == 0 then
  redis.call('DEL', T)  -- the group is idle: nothing of it stays
elseif mine == 0 and not waits then
  redis.call('HDEL', T, 'p' .. tenant, 'l' .. tenant, 'q' .. tenant)  -- the tenant is idle
  redis.call('HSET', T, 'r', running, 'd', demand)
else
  redis.call('HSET', T, unpack(fields))
end
local madeP, madeD = running0 == 0 and running > 0, demand0 == 0 and demand > 0
"""
    + _PERMITS_KEEP
    + """
local wake = -1
local rw, gw = 0, 0
if grant < want then
  local soonest = nil
  if running > 0 then soonest = tonumber(redis.call('ZRANGE', P, 0, 0, 'WITHSCORES')[2]) end
  if demand > 0 then
    local d = redis.call('ZRANGE', D, 0, 1, 'WITHSCORES')
    local other = d[2]
    if d[1] == tenant then other = d[4] end
    if other and (not soonest or tonumber(other) < soonest) then soonest = tonumber(other) end
  end
  if soonest then wake = math.max(0, soonest - now) end
  if gi > 0 then
    gw = rwait(gtat, nowus, gi, gb, 1)
    -- The next group token nobody further behind has a claim on.
    local beyond = math.ceil(rwait(gtat, nowus, gi, gb, better + 1) / 1000)
    if beyond > 0 and (wake < 0 or beyond < wake) then wake = beyond end
  end
  rw = gw
  if ti > 0 then rw = math.max(rw, rwait(ttat, nowus, ti, tb, 1)) end
end
return {first, grant, running, mine, wake, math.ceil(rw), math.ceil(gw), nowus}
"""
)

# KEYS: permits, demand, state. ARGV: channel, then token, tenant pairs.
# Returns how many of the pairs were still held; publishes if any was.
_PERMITS_RELEASE: Final = (
    "local FIELDS = {}"
    + _PERMITS_EXPIRE
    + """
local held = 0
local owners = {}
local freed = {}
if running > 0 then
  for i = 2, #ARGV, 2 do
    local owner = ARGV[i + 1]
    if redis.call('ZREM', P, ARGV[i] .. ':' .. owner) == 1 then
      held = held + 1
      if not freed[owner] then
        freed[owner] = 0
        owners[#owners + 1] = owner
      end
      freed[owner] = freed[owner] + 1
    end
  end
  running = running - held
end
if running == 0 and demand == 0 then
  if held > 0 or changed then redis.call('DEL', T) end  -- the group is idle
else
  for _, owner in ipairs(owners) do
    if redis.call('HINCRBY', T, 'n' .. owner, -freed[owner]) <= 0 then
      if demand == 0 or not redis.call('ZSCORE', D, owner) then
        redis.call('HDEL', T, 'n' .. owner, 'p' .. owner, 'l' .. owner)  -- the tenant is idle
      else
        redis.call('HDEL', T, 'n' .. owner)
      end
    end
  end
  if held > 0 or changed then redis.call('HSET', T, 'r', running, 'd', demand) end
end
if held > 0 then redis.call('PUBLISH', ARGV[1], '') end
return held
"""
)

# KEYS: permits, demand, state. ARGV: most ms, then token, tenant pairs.
# Returns the tokens of the pairs no longer held.
_PERMITS_EXTEND: Final = (
    "local FIELDS = {'x'}\nlocal XAT = 3"
    + _PERMITS_EXPIRE
    + """
local untl = string.format('%d', now + tonumber(ARGV[1]))
local missing = {}
local i = 2
while i <= #ARGV do
  -- In chunks: unpack() of too many values overflows Lua's stack.
  local members, tokens = {}, {}
  while i <= #ARGV and #members < 500 do
    members[#members + 1] = ARGV[i] .. ':' .. ARGV[i + 1]
    tokens[#tokens + 1] = ARGV[i]
    i = i + 2
  end
  local scores = {}
  if running > 0 then scores = redis.call('ZMSCORE', P, unpack(members)) end
  local batch = {}
  for j, member in ipairs(members) do
    if scores[j] then
      batch[#batch + 1] = untl
      batch[#batch + 1] = member
    else
      missing[#missing + 1] = tokens[j]
    end
  end
  if #batch > 0 then redis.call('ZADD', P, 'XX', unpack(batch)) end
end
if changed then
  if running == 0 and demand == 0 then
    redis.call('DEL', T)  -- everything expired: nothing of the group stays
  else
    redis.call('HSET', T, 'r', running, 'd', demand)
  end
end
local need, madeP, madeD = 0, false, false
if running > 0 then need = tonumber(untl) end
"""
    + _PERMITS_KEEP
    + """
return missing
"""
)


_SLOTS: Final = 16384
# Replies no retry will fix: credentials, ACLs, a cluster node given to a plain provider (or
# keys the cluster cannot run together), a command the server lacks (no scripting, or renamed
# or disabled), a database it does not have. Without their "ERR ", which redis-py drops
# (``_error`` drops it too, for clients that keep it); redis-py raises AuthenticationError for
# the "ERR" replies about passwords.
_PERMANENT_REPLIES: Final = (
    "WRONGPASS",
    "NOAUTH",
    "NOPERM",
    "MOVED",
    "ASK ",
    "CROSSSLOT",
    "unknown command",
    "DB index is out of range",
)
_slot_tags: list[str] | None = None


def _tag_for_slot(slot: int) -> str:
    """A short string whose hash slot is ``slot``: names the per-slot sequence of a cluster."""
    global _slot_tags
    tags = _slot_tags
    if tags is None:
        # CRC16/XMODEM of the whole tag (no braces in it), as Redis Cluster hashes keys.
        found: list[str | None] = [None] * _SLOTS
        missing = _SLOTS
        i = 0
        crc = binascii.crc_hqx
        while missing:  # about 160,000 CRC16s, once per process (a tenth of a second)
            tag = b"%x" % i
            at = crc(tag, 0) % _SLOTS
            if found[at] is None:
                found[at] = tag.decode()
                missing -= 1
            i += 1
        tags = _slot_tags = [tag for tag in found if tag is not None]
    return tags[slot]


def _sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a SCAN ``MATCH`` pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _reply_dict(flat: Any) -> dict[str, str]:
    """A flat ``[key, value, ...]`` script reply (HGETALL, ZRANGE WITHSCORES) as a dict."""
    items = [v.decode() if isinstance(v, bytes) else str(v) for v in flat or ()]
    return dict(zip(items[::2], items[1::2], strict=True))


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _rate_argv(rate: RateArgs | None) -> tuple[str, int]:
    """A rate as two script arguments: its interval in microseconds (exact text) and burst."""
    if rate is None:
        return "0", 0
    return repr(rate[0] * 1e6), rate[1]


def _pairs(permits: Sequence[tuple[int, str]]) -> list[object]:
    """``(token, tenant)`` pairs as a script's ARGV: token, tenant, token, tenant..."""
    args: list[object] = []
    for token, tenant in permits:
        args += (token, tenant)
    return args


class RedisLeases(LeaseProvider):
    """Leases in Redis; waiters are woken by pub/sub.

    Args:
        url: ``redis://[user:password@]host:port/db`` (or ``rediss://``, ``unix://``); with
            ``cluster=True``, the address of any node of the cluster.
        prefix: Prefix of every key and channel this provider uses (no ``{`` or ``}``: the
            name's hash tag must be the first one in its key).
        client: Take the connection settings (address, credentials, TLS, connection class)
            from this redis-py client instead of ``url``. Its pool, retry policy, socket
            timeouts and ``decode_responses`` are not used, and ``close()`` leaves it open. A
            ``redis.cluster.RedisCluster`` client implies ``cluster=True``.
        timeout: Socket connect and read timeout in seconds: a hung server fails with
            ``LeaseStoreUnavailable`` instead of blocking forever. Keep-alive renewals wait at
            most as long as their lease has left, so a loss is reported by its expiry (on a
            cluster, at most ``timeout``).
        cluster: The server is a Redis Cluster: route each name to the node of its hash slot,
            and keep one token sequence per slot (see the module docstring).

    Limits: names of at most 4,096 bytes of UTF-8 (Redis takes keys of up to 512 MB; the bound
    keeps keys and channel names sane), durations of at most 1e9 seconds.

    Raises:
        ImportError: redis-py is missing (``pip install rxcoord[redis]``).
        ValueError: Empty prefix or bad timeout.
    """

    backend = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "rxcoord:lease:",
        client: redis.Redis | redis.cluster.RedisCluster | None = None,
        timeout: float = 5.0,
        cluster: bool = False,
    ) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("prefix must be a non-empty str")
        if "{" in prefix or "}" in prefix:
            raise ValueError(
                f"prefix must not contain '{{' or '}}' ({prefix!r}): the name's hash tag must be "
                "the first one in its key"
            )
        seconds = check_length(timeout, "timeout")
        redis_mod = require("redis", "redis")
        route_driver_logs("redis")
        from redis.backoff import NoBackoff
        from redis.cluster import RedisCluster
        from redis.retry import Retry

        self._errors: type[Exception] = redis_mod.RedisError
        self._no_script: type[Exception] = redis_mod.exceptions.NoScriptError
        self._redis = redis_mod
        self.prefix = prefix
        self.cluster = cluster or isinstance(client, RedisCluster)
        if isinstance(client, RedisCluster):
            node: Any = client.get_default_node()  # type: ignore[no-untyped-call]
            pool = redis_mod.ConnectionPool(
                host=node.host, port=node.port, **client.nodes_manager.connection_kwargs
            )
            self.url = repr(client)
        elif client is None:
            # Only a holder of connection settings: connections are made by _Connections.
            pool = redis_mod.ConnectionPool.from_url(url)
            self.url = url
        else:
            pool = client.connection_pool
            self.url = repr(client)
        connection_class: Callable[..., Any] = pool.connection_class
        self._db = pool.connection_kwargs.get("db", 0)  # named by the error for a missing one
        settings = {
            **pool.connection_kwargs,
            "socket_timeout": seconds,
            "socket_connect_timeout": seconds,
            "retry": Retry(NoBackoff(), 0),  # see the module docstring: retries would be wrong
            "health_check_interval": 0,
            # Replies are compared as bytes (pub/sub kinds and channels); a client configured
            # with decode_responses=True would turn them into str that never match.
            "decode_responses": False,
        }
        self._op_timeout = seconds
        self._connections: _Connections | _ClusterCommands
        if self.cluster:
            _tag_for_slot(0)  # build the slot table now (~0.1 s once), not in the first grant
            node_settings = {
                key: value
                for key, value in settings.items()
                if key not in ("host", "port", "db", "connection_class", "path")
            }
            self._connections = _ClusterCommands(
                RedisCluster(
                    host=pool.connection_kwargs.get("host", "127.0.0.1"),
                    port=int(pool.connection_kwargs.get("port", 6379)),
                    **node_settings,
                )
            )
        else:

            def connect() -> Any:
                return connection_class(**settings)

            self._connections = _Connections(
                connect, redis_mod.ResponseError, redis_mod.RedisError, seconds
            )

        def connect_listener() -> Any:
            # On a cluster, any node will do: PUBLISH reaches the subscribers of every node.
            return connection_class(**{**settings, "protocol": 2})  # pub/sub replies as arrays

        self._listener = _RedisListener(lambda: self._hub, connect_listener, self._channel)
        super().__init__(WaitHub(self._listener), poll=(0.01, 0.25))

    def _describe(self) -> str:
        return f"prefix={self.prefix!r}"

    def _listener_counts(self) -> tuple[int, int]:
        return self._listener.notifications, self._listener.reconnects

    def _channel(self, name: str) -> str:
        return f"{self.prefix}{{{name}}}:released"

    def _eval(
        self,
        script: str,
        sha: str,
        numkeys: int,
        *args: object,
        action: str,
        timeout: float | None = None,
    ) -> Any:
        connections = self._connections
        try:
            if timeout is None:
                try:
                    return connections.call("EVALSHA", sha, numkeys, *args)
                except self._no_script:
                    # The server lost its script cache (restart, SCRIPT FLUSH): EVAL runs and
                    # caches it again. Safe to repeat: EVALSHA did not run anything.
                    return connections.call("EVAL", script, numkeys, *args)
            deadline = monotonic() + timeout
            try:
                return connections.call_within(timeout, "EVALSHA", sha, numkeys, *args)
            except self._no_script:
                return connections.call_within(
                    deadline - monotonic(), "EVAL", script, numkeys, *args
                )
        except self._errors as exc:
            raise self._error(exc, action) from exc

    def _error(
        self, exc: Exception, action: str
    ) -> LeaseStoreUnavailable | LeaseStoreMisconfigured:
        """Map a redis-py error: an outage, or a refusal that no retry will fix."""
        exceptions = self._redis.exceptions
        text = str(exc)
        reply = text.lstrip().removeprefix("ERR ")
        cluster_mismatch = isinstance(
            exc, exceptions.ClusterCrossSlotError | exceptions.MovedError | exceptions.AskError
        )
        permanent = (
            isinstance(
                exc,
                exceptions.AuthenticationError
                | exceptions.AuthenticationWrongNumberOfArgsError
                | exceptions.NoPermissionError,
            )
            or cluster_mismatch
            or (isinstance(exc, exceptions.ResponseError) and reply.startswith(_PERMANENT_REPLIES))
        )
        if not permanent:
            return LeaseStoreUnavailable(
                f"Redis lease store failed to {action}: {type(exc).__name__}: {exc} "
                "(the provider reconnects once the server is reachable again)"
            )
        if cluster_mismatch or text.startswith(("MOVED", "ASK ", "CROSSSLOT")):
            fix = "the server is a Redis Cluster: pass cluster=True to RedisLeases"
        elif isinstance(exc, exceptions.NoPermissionError) or text.startswith("NOPERM"):
            fix = (
                "grant the user EVALSHA, EVAL, PUBLISH and SUBSCRIBE on the prefix's keys "
                "and channels (ACL SETUSER ... ~prefix* &prefix* +@scripting +@pubsub)"
            )
        elif "DB index is out of range" in text:
            fix = (
                f"the server has no database {self._db}: name one it has in the URL "
                "(redis://host:port/0; the server's 'databases' setting, 16 by default, bounds "
                "the index), or raise 'databases' in its configuration"
            )
        elif reply.startswith("unknown command"):
            fix = (
                "the server refuses a command the leases need (EVAL, EVALSHA, PUBLISH, "
                "SUBSCRIBE): it lacks Lua scripting (use Redis 6.2 or later) or the command was "
                "renamed or disabled (rename-command in its configuration)"
            )
        else:
            fix = (
                "fix the user name or password in the URL (redis://user:password@host:port); "
                "retrying with the same settings fails the same way"
            )
        return LeaseStoreMisconfigured(
            f"Redis lease store refused to {action}: {type(exc).__name__}: {text} [{fix}]"
        )

    def _store_try_grant(
        self, name: str, at_most_for: float, at_least_for: float
    ) -> tuple[int, float]:
        key = self._key(name)
        least = _ms(at_least_for) if at_least_for > 0 else 0
        value = int(
            self._eval(
                _GRANT,
                _GRANT_SHA,
                3,
                key,
                self._sequence_key(key),
                key + ":token",
                _ms(at_most_for),
                least,
                # A name this provider's waiters wait for: mark the grant (see "Notifications").
                1 if self._listener.watching(name) else 0,
                action="grant a lease",
            )
        )
        if value > 0:
            return value, 0.0
        return 0, (-value - 1) / 1000.0

    def _store_extend(
        self, name: str, token: int, at_most_for: float, *, timeout: float | None = None
    ) -> bool:
        key = self._key(name)
        return bool(
            self._eval(
                _EXTEND,
                _EXTEND_SHA,
                1,
                key,
                token,
                _ms(at_most_for),
                action="extend a lease",
                timeout=timeout,
            )
        )

    def _store_release(
        self, name: str, token: int, *, timeout: float | None = None, kept: bool = True
    ) -> bool:
        key = self._key(name)
        return bool(
            self._eval(
                _RELEASE,
                _RELEASE_SHA,
                1,
                key,
                token,
                self._channel(name),
                action="release a lease",
                timeout=timeout,
            )
        )

    def _key(self, name: str) -> str:
        """The lease key of ``name`` (see the module docstring's "Keys")."""
        if self.cluster and name[:1] == "}":
            # A cluster hashes a key by its first "{...}", and "{}" (empty) means the whole
            # key: the lease key and the legacy counter beside it would land in two slots, which
            # one script may not touch. A key of its own namespace ("}" never follows the
            # prefix otherwise) with the tag "#" keeps them in one slot. Only on a cluster,
            # where such names never worked: a server keeps the layout its leases already use.
            return f"{self.prefix}}}{{#{name}}}"
        return f"{self.prefix}{{{name}}}"

    def _sequence_key(self, key: str) -> str:
        """The token sequence for the lease key ``key``: store-wide, or per slot on a cluster."""
        if not self.cluster:
            return self.prefix + "seq"
        from redis.crc import key_slot

        return f"{self.prefix}seq:{{{_tag_for_slot(key_slot(key.encode()))}}}"

    def _store_holder(self, name: str) -> tuple[int, float, bool] | None:
        key = self._key(name)
        reply = self._eval(_HOLDER, _HOLDER_SHA, 1, key, action="read a lease")
        if not reply:
            return None
        token, ttl, released = (int(part) for part in reply)
        if ttl < 0:  # expired between the GET and the PTTL, or (never) without expiry
            return None
        return token, ttl / 1000.0, bool(released)

    def _store_close(self) -> None:
        self._connections.close()

    def _store_list(self) -> StoreListing:
        """SCAN the prefix's keys (every primary of a cluster), then read each lease and group
        with a read-only script. Redis records no holder and marks no waiters."""
        leases: list[LeaseEntry] = []
        groups = []
        try:
            keys = sorted(set(self._scan(_glob_escape(self.prefix) + "*")))
        except self._errors as exc:
            raise self._error(exc, "list the leases") from exc
        for key in keys:
            rest = key[len(self.prefix) :]
            if rest.startswith("fleet:{#") and rest.endswith("}:t"):
                group = rest[len("fleet:{#") : -len("}:t")]
                entry = self._read_group(group)
                if entry is not None:
                    groups.append(entry)
                continue
            if rest.startswith("}{#") and rest.endswith("}") and self.cluster:
                name = rest[3:-1]  # a name starting with "}" on a cluster (see _key)
            elif rest.startswith("{") and rest.endswith("}"):
                name = rest[1:-1]
            else:
                continue  # the token sequence, a legacy counter, a group's sets
            found = self._store_holder(name)
            if found is not None:
                token, left, released = found
                leases.append(LeaseEntry(name, token, left, released))
        leases.sort(key=lambda entry: entry.name)
        return StoreListing(
            "redis", tuple(leases), tuple(groups), holders=False, waiter_marks=False
        )

    def _scan(self, pattern: str) -> list[str]:
        connections = self._connections
        if isinstance(connections, _ClusterCommands):
            found = connections._cluster.scan_iter(match=pattern, count=1000)
            return [k.decode() if isinstance(k, bytes) else str(k) for k in found]
        keys: list[str] = []
        cursor: Any = 0
        while True:
            cursor, batch = connections.call("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
            keys.extend(k.decode() if isinstance(k, bytes) else str(k) for k in batch)
            if int(cursor) == 0:
                return keys

    def _read_group(self, group: str) -> Any:
        reply = self._eval(
            _PERMITS_READ, _PERMITS_READ_SHA, 3, *self._permit_keys(group), action="list a group"
        )
        now = float(reply[0])
        state = _reply_dict(reply[1])
        permits = [
            (member.split(":", 1)[1], float(score))
            for member, score in _reply_dict(reply[2]).items()
        ]
        demand = {tenant: float(until) for tenant, until in _reply_dict(reply[3]).items()}
        limits = {field[1:]: int(value) for field, value in state.items() if field.startswith("l")}
        return group_entry(
            group,
            now / 1000.0,
            ((t, u / 1000.0) for t, u in permits),
            limits,
            {t: u / 1000.0 for t, u in demand.items()},
        )

    # -- fleet permits (see _permits.py and the module docstring's "Keys") ------------------

    def _permit_keys(self, group: str) -> tuple[str, str, str]:
        # One hash tag for the group's keys (one slot on a cluster); '#' keeps the tag
        # non-empty whatever the group's name ('' or one starting with '}' would otherwise
        # leave each key in a slot of its own).
        base = f"{self.prefix}fleet:{{#{group}}}:"
        return base + "p", base + "d", base + "t"

    def _rate_key(self, group: str) -> str:
        """The group's rate buckets (a sorted set of tats), in the group's hash slot."""
        return f"{self.prefix}fleet:{{#{group}}}:q"

    def _permits_acquire(
        self,
        group: str,
        tenant: str,
        want: int,
        weight: float,
        tenant_limit: int,
        limit: int,
        most: float,
        demand_for: float,
        more: bool,
        *,
        rate: RateArgs | None = None,
        tenant_rate: RateArgs | None = None,
    ) -> PermitReply:
        keys = self._permit_keys(group)
        first, count, running, mine, wake, rate_wait, group_wait, now = self._eval(
            _PERMITS_ACQUIRE,
            _PERMITS_ACQUIRE_SHA,
            5,
            *keys,
            self._sequence_key(keys[0]),
            self._rate_key(group),
            tenant,
            want,
            repr(float(weight)),  # the shortest text that reads back as the same double
            tenant_limit,
            limit,
            _ms(most),
            _ms(demand_for),
            1 if more else 0,
            self._channel(hub_name(group)),
            *_rate_argv(rate),
            *_rate_argv(tenant_rate),
            action="acquire fleet permits",
        )
        return PermitReply(
            tuple(range(first, first + count)),
            None if wake < 0 else wake / 1000.0,
            running,
            mine,
            rate_wait / 1e6,
            group_wait / 1e6,
            now / 1e6,
        )

    def _permits_release(
        self, group: str, permits: Sequence[tuple[int, str]], *, timeout: float | None = None
    ) -> int:
        return int(
            self._eval(
                _PERMITS_RELEASE,
                _PERMITS_RELEASE_SHA,
                3,
                *self._permit_keys(group),
                self._channel(hub_name(group)),
                *_pairs(permits),
                action="release fleet permits",
                timeout=timeout,
            )
        )

    def _permits_extend(
        self,
        group: str,
        permits: Sequence[tuple[int, str]],
        most: float,
        *,
        timeout: float | None = None,
    ) -> list[int]:
        lost = self._eval(
            _PERMITS_EXTEND,
            _PERMITS_EXTEND_SHA,
            3,
            *self._permit_keys(group),
            _ms(most),
            *_pairs(permits),
            action="extend fleet permits",
            timeout=timeout,
        )
        return [int(token) for token in lost]


_GRANT_SHA: Final = _sha(_GRANT)
_HOLDER_SHA: Final = _sha(_HOLDER)
_EXTEND_SHA: Final = _sha(_EXTEND)
_RELEASE_SHA: Final = _sha(_RELEASE)
_PERMITS_ACQUIRE_SHA: Final = _sha(_PERMITS_ACQUIRE)
_PERMITS_RELEASE_SHA: Final = _sha(_PERMITS_RELEASE)
_PERMITS_EXTEND_SHA: Final = _sha(_PERMITS_EXTEND)
_PERMITS_READ_SHA: Final = _sha(_PERMITS_READ)


class _Connections:
    """A minimal pool of redis-py connections: idle ones wait in a deque.

    ``deque.pop``/``append`` are atomic, so checkout and checkin take no lock. Before reuse, an
    idle connection with something to read has been closed by the server (or is out of step):
    it is reconnected, as redis-py's own pool does.
    """

    __slots__ = ("_closed", "_connect", "_errors", "_idle", "_response_error", "_timeout")

    def __init__(
        self,
        connect: Callable[[], Any],
        response_error: type[Exception],
        errors: type[Exception],
        timeout: float,
    ) -> None:
        self._connect = connect
        self._response_error = response_error
        self._errors = errors
        self._timeout = timeout  # every connection's socket timeout
        self._idle: deque[Any] = deque()
        self._closed = False

    def call(self, *args: object) -> Any:
        """Send one command and read its reply (one round trip)."""
        conn = self._checkout()
        try:
            conn.send_command(*args, check_health=False)
            reply = conn.read_response()
        except self._response_error:
            self._checkin(conn)  # the command failed, the connection is fine
            raise
        except BaseException:
            conn.disconnect()  # a reply may be in flight: never reuse the connection
            raise
        self._checkin(conn)
        return reply

    def call_within(self, timeout: float, *args: object) -> Any:
        """:meth:`call`, waiting at most ``timeout`` seconds (when shorter than the socket's).

        Raises:
            redis.TimeoutError: No reply in time (the connection is discarded).
        """
        if timeout >= self._timeout:
            return self.call(*args)
        cap = max(0.001, timeout)
        try:
            conn = self._idle.pop()
        except IndexError:
            conn = None
        fresh = True
        if conn is not None:
            try:
                conn.connect()  # no-op when connected
                fresh = bool(conn.can_read())  # unexpected input: the server closed it
            except (self._errors, OSError):
                pass
            if fresh:
                conn.disconnect()
            else:
                conn._sock.settimeout(cap)  # redis-py has no per-call read timeout
        if fresh:
            # Connecting (and the handshake) within the cap too. Its parser remembers the short
            # timeout, so this connection is closed afterwards, not pooled.
            conn = self._connect()
            conn.socket_timeout = cap
            conn.socket_connect_timeout = cap
        try:
            if fresh:
                conn.connect()
            conn.send_command(*args, check_health=False)
            reply = conn.read_response()
        except self._response_error:
            self._checkin_capped(conn, fresh)
            raise
        except BaseException:
            conn.disconnect()
            raise
        self._checkin_capped(conn, fresh)
        return reply

    def _checkin_capped(self, conn: Any, fresh: bool) -> None:
        if fresh:
            conn.disconnect()
            return
        conn._sock.settimeout(self._timeout)
        self._checkin(conn)

    def _checkout(self) -> Any:
        try:
            conn = self._idle.pop()
        except IndexError:
            conn = self._connect()
        try:
            conn.connect()  # no-op when connected
            if conn.can_read():
                raise ConnectionError("an idle connection has unexpected input")
        except (self._errors, OSError):
            conn.disconnect()
            conn.connect()  # raises if the server is still away
        return conn

    def _checkin(self, conn: Any) -> None:
        if self._closed:
            conn.disconnect()
        else:
            self._idle.append(conn)

    def close(self) -> None:
        self._closed = True
        while self._idle:
            with suppress(Exception):
                self._idle.pop().disconnect()


class _ClusterCommands:
    """:class:`_Connections`'s interface over redis-py's ``RedisCluster`` (slot routing)."""

    __slots__ = ("_cluster",)

    def __init__(self, cluster: Any) -> None:
        self._cluster = cluster

    def call(self, *args: object) -> Any:
        return self._cluster.execute_command(*args)

    def call_within(self, timeout: float, *args: object) -> Any:
        # RedisCluster has no per-call timeout: each node's socket timeout (the provider's
        # `timeout`) bounds the call instead.
        return self._cluster.execute_command(*args)

    def close(self) -> None:
        with suppress(Exception):
            self._cluster.close()


class _RedisListener(Listener):
    """SUBSCRIBEs to the channels of the names being waited for, on a connection of its own."""

    def __init__(
        self,
        hub_ref: Callable[[], WaitHub | None],
        connect: Callable[[], Any],
        channel_of: Callable[[str], str],
    ) -> None:
        super().__init__(hub_ref, "rxcoord-redis-lease-listener")
        self._new_connection = connect
        self._channel_of = channel_of
        self._names: dict[bytes, str] = {}  # channel -> name
        self._conn: Any = None

    def _connect(self) -> None:
        conn = self._new_connection()
        conn.connect()
        self._conn = conn

    def _fileno(self) -> int:
        # redis-py has no public accessor for the socket; poll() needs its descriptor.
        return int(self._conn._sock.fileno())

    def _apply(self, subscribe: list[str], unsubscribe: list[str]) -> None:
        for command, names in (("SUBSCRIBE", subscribe), ("UNSUBSCRIBE", unsubscribe)):
            if not names:
                continue
            channels = []
            for name in names:
                channel = self._channel_of(name).encode()
                self._names[channel] = name
                channels.append(channel)
            self._conn.send_command(command, *channels, check_health=False)
        # Acknowledged by the server's replies, read by _drain.

    def _drain(self) -> None:
        conn = self._conn
        while conn.can_read(timeout=0):
            reply = conn.read_response()
            if not isinstance(reply, list) or len(reply) < 3:
                continue
            kind, channel = reply[0], reply[1]
            name = self._names.get(channel)
            if name is None:
                continue
            if kind == b"message":
                self._released(name)
            elif kind == b"subscribe":
                self._acked(name)
            elif kind == b"unsubscribe":
                self._acked(name)
                if not self._is_tracked(name):
                    self._names.pop(channel, None)

    def _is_tracked(self, name: str) -> bool:
        with self._lock:
            return name in self._subs

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        self._names.clear()
        if conn is not None:
            with suppress(Exception):
                conn.disconnect()


# -- registry entry (see rxcoord/leases/_registry.py) ------------------------------------------
# Kept in one block with its imports, so that a backend's registration reads as one unit.

from typing import Any as _Any  # noqa: E402
from typing import Final as _Final  # noqa: E402

from .._registry import LeaseBackend  # noqa: E402


def _from_url(url: str, rest: str, **options: _Any) -> RedisLeases:
    """``redis://...``, ``rediss://...`` or ``unix://...``: redis-py's URL forms."""
    return RedisLeases(url, **options)


BACKEND: _Final = LeaseBackend(
    name="redis",
    provider=RedisLeases,
    schemes=("redis", "rediss", "unix"),
    from_url=_from_url,
    server=True,
)
