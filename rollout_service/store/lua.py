"""The rollouts' layout in Redis and the Lua scripts that read and write it, one round trip each
(store/redis_store.py runs them).

Key layout of rollout ``R`` under prefix ``P`` (every key carries the hash tag ``{R}``, so one rollout
lives in one cluster slot and each Lua script touches a single slot)::

    P:{R}:meta          hash   turn (completed calls), nseg (segments), v (layout version),
                               born (incarnation: random, set when the rollout is created),
                               aid (id of the last append: a resent append that landed is a success),
                               ver (weight version of the last generated token), c (constrained
                               calls), mig (mid-turn migrations), at (last append, Unix ms): the
                               summary the recent index shows (store/recent.py);
                               st, why: the rollout's status (aborted, stale) and its reason
                               (``mark``; an aborted rollout takes no further turn)
    P:{R}:s<i>:ids      string token ids of segment i, packed little-endian int32, APPENDed per turn
    P:{R}:s<i>:lp       string logprobs, little-endian float32, APPENDed per turn
    P:{R}:s<i>:mask     string loss mask, uint8, APPENDed per turn
    P:{R}:s<i>:turns    list   one JSON TurnRecord per call (RPUSH)
    P:{R}:s<i>:msgs     list   one JSON canonical message per entry (RPUSH)
    P:{R}:s<i>:ctx      string JSON render_context (small; overwritten per turn)

Why this shape: rewriting a rollout's history on every turn costs O(history) per turn
(``scripts/bench_store.py``; figures in docs/benchmarks.md, "Figures kept out of the code"), so a turn only ever appends its own
bytes. Each operation is one Lua script (one round trip, atomic): the append checks the turn
counter, writes everything, bumps the counter and refreshes the expiry of every key; the load returns
a consistent snapshot even while another replica appends.

Scripts get the ``meta`` key in KEYS and derive the sibling keys from it: the reader does not know
the number of segments before reading, and derived keys share the hash tag, so they are in the
declared key's slot (which Redis 7 requires of undeclared keys, and which a cluster routes on).
"""

from __future__ import annotations

from typing import Any

from rollout_service.onpolicy.types import RolloutState
from rollout_service.store.codec import EncodedSegment, decode_state

LAYOUT_VERSION = 1
SEGMENT_FIELDS = ("ids", "lp", "mask", "turns", "msgs", "ctx")
MSGS_PER_RPUSH = 512  # keeps Lua's unpack() far below its C-stack limit on huge first prompts

# Shared by every script: sibling keys are the meta key with "meta" replaced.
LUA_KEYS = """
local meta = KEYS[1]
local base = string.sub(meta, 1, -5)
local FIELDS = {'ids', 'lp', 'mask', 'turns', 'msgs', 'ctx'}
local function seg_prefix(i) return base .. 's' .. i .. ':' end
local function expire_all(nseg, ms)
  redis.call('PEXPIRE', meta, ms)
  for i = 0, nseg - 1 do
    local p = seg_prefix(i)
    for _, f in ipairs(FIELDS) do redis.call('PEXPIRE', p .. f, ms) end
  end
end
"""

# ARGV: expected_turn, new_turn, segment_index, new_segment (0/1), ttl_ms, ids, lp, mask, record, ctx,
#       incarnation (stored only when this append creates the rollout), append id, last weight version
#       ('' = keep), constrained (0/1), migrations, now (Unix ms), the call was aborted (0/1), msgs...
# Returns {1, nseg} on success, {0, stored_turn} on a turn conflict, {-1, nseg} on a bad segment index,
# {-2, stored_turn} on an aborted rollout (only the call the abort ended, finish_reason abort, lands).
# Every check happens before the first write, so a refused append leaves no trace. The append id
# makes a retried append (the client resends a command whose answer it lost: store.retries) that
# had landed a success, not a conflict.
LUA_APPEND = LUA_KEYS + """
local m = redis.call('HMGET', meta, 'turn', 'nseg', 'aid', 'st')
local stored = tonumber(m[1] or '0')
if m[3] == ARGV[12] and stored == tonumber(ARGV[2]) then
  -- a resend of an append that landed: refresh the expiry (a write on this connection, so a WAIT
  -- after it covers the original append too) and report success
  expire_all(tonumber(m[2] or '0'), tonumber(ARGV[5]))
  return {1, tonumber(m[2] or '0')}
end
if stored ~= tonumber(ARGV[1]) then return {0, stored} end
if m[4] == 'aborted' and ARGV[17] ~= '1' then return {-2, stored} end
local nseg = tonumber(m[2] or '0')
local seg = tonumber(ARGV[3])
local new_segment = ARGV[4] == '1'
local want = nseg - 1
if new_segment then want = nseg end
if seg ~= want or want < 0 then return {-1, nseg} end
local p = seg_prefix(seg)
redis.call('APPEND', p .. 'ids', ARGV[6])
redis.call('APPEND', p .. 'lp', ARGV[7])
redis.call('APPEND', p .. 'mask', ARGV[8])
redis.call('RPUSH', p .. 'turns', ARGV[9])
redis.call('SET', p .. 'ctx', ARGV[10])
if stored == 0 then redis.call('HSET', meta, 'born', ARGV[11]) end
local i = 18
while i <= #ARGV do
  local j = math.min(i + %d - 1, #ARGV)
  redis.call('RPUSH', p .. 'msgs', unpack(ARGV, i, j))
  i = j + 1
end
if new_segment then nseg = nseg + 1 end
redis.call('HSET', meta, 'turn', ARGV[2], 'nseg', nseg, 'v', %d, 'aid', ARGV[12], 'at', ARGV[16])
if ARGV[13] ~= '' then redis.call('HSET', meta, 'ver', ARGV[13]) end
redis.call('HINCRBY', meta, 'c', ARGV[14])
redis.call('HINCRBY', meta, 'mig', ARGV[15])
expire_all(nseg, tonumber(ARGV[5]))
return {1, nseg}
""" % (MSGS_PER_RPUSH, LAYOUT_VERSION)

# snapshot(m) for m = HMGET(meta, turn, nseg, born, st, why):
# {turn, nseg, born, st, why, then per segment: ids, lp, mask, ctx, turns[], msgs[]}.
LUA_SNAPSHOT = """
local function snapshot(m)
  local nseg = tonumber(m[2] or '0')
  local out = {m[1], m[2] or '0', m[3] or '', m[4] or '', m[5] or ''}
  for i = 0, nseg - 1 do
    local p = seg_prefix(i)
    out[#out + 1] = redis.call('GET', p .. 'ids') or ''
    out[#out + 1] = redis.call('GET', p .. 'lp') or ''
    out[#out + 1] = redis.call('GET', p .. 'mask') or ''
    out[#out + 1] = redis.call('GET', p .. 'ctx') or ''
    out[#out + 1] = redis.call('LRANGE', p .. 'turns', 0, -1)
    out[#out + 1] = redis.call('LRANGE', p .. 'msgs', 0, -1)
  end
  return out
end
"""

# Returns false for an unknown rollout, else the snapshot.
LUA_LOAD = LUA_KEYS + LUA_SNAPSHOT + """
local m = redis.call('HMGET', meta, 'turn', 'nseg', 'born', 'st', 'why')
if not m[1] then return false end
return snapshot(m)
"""

# ARGV: known_turn, known incarnation ('' = not checked), known status ('' = none). Returns false for an
# unknown rollout, {turn} when the caller's copy is current (O(1): no history leaves the server), else
# the snapshot.
LUA_LOAD_IF_CHANGED = LUA_KEYS + LUA_SNAPSHOT + """
local m = redis.call('HMGET', meta, 'turn', 'nseg', 'born', 'st', 'why')
if not m[1] then return false end
if tonumber(m[1]) == tonumber(ARGV[1]) and (ARGV[2] == '' or (m[3] or '') == ARGV[2])
   and (m[4] or '') == ARGV[3] then return {m[1]} end
return snapshot(m)
"""

# ARGV: status (aborted | stale), reason, ttl_ms ('' = an unknown rollout stays unknown). Returns 0
# for an unknown rollout (unless ttl_ms: then it is created with no turn, marked, expiring in ttl_ms),
# 2 when it is already aborted (kept as it was: the first abort's reason stands; an abort is never
# undone), else 1.
LUA_MARK = """
local meta = KEYS[1]
local m = redis.call('HMGET', meta, 'turn', 'st')
if not m[1] then
  if ARGV[3] == '' then return 0 end
  redis.call('HSET', meta, 'turn', 0, 'nseg', 0, 'v', %d, 'st', ARGV[1], 'why', ARGV[2])
  redis.call('PEXPIRE', meta, tonumber(ARGV[3]))
  return 1
end
if m[2] == 'aborted' then return 2 end
redis.call('HSET', meta, 'st', ARGV[1], 'why', ARGV[2])
return 1
""" % LAYOUT_VERSION

# Returns the number of keys removed (0: unknown rollout).
LUA_DELETE = LUA_KEYS + """
local nseg = tonumber(redis.call('HGET', meta, 'nseg') or '0')
local n = redis.call('DEL', meta)
for i = 0, nseg - 1 do
  local p = seg_prefix(i)
  for _, f in ipairs(FIELDS) do n = n + redis.call('DEL', p .. f) end
end
return n
"""

# ARGV: ttl_ms. Returns 1 if the rollout exists (and its expiry was restarted), else 0.
LUA_TOUCH = LUA_KEYS + """
local nseg = redis.call('HGET', meta, 'nseg')
if not nseg then return 0 end
expire_all(tonumber(nseg), tonumber(ARGV[1]))
return 1
"""

def decode_snapshot(rollout_id: str, reply: Any) -> RolloutState | None:
    """The reply of ``snapshot()`` in the Lua scripts (false/None for an unknown rollout)."""
    if not reply:
        return None
    turn, nseg, incarnation = int(reply[0]), int(reply[1]), reply[2].decode()
    status, reason = reply[3].decode() or None, reply[4].decode() or None
    segments = []
    for i in range(nseg):
        ids, lp, mask, ctx, turns, msgs = reply[5 + 6 * i : 11 + 6 * i]
        segments.append(EncodedSegment(ids=ids, logprobs=lp, mask=mask, render_context=ctx, turns=turns, messages=msgs))
    state = decode_state(rollout_id, turn, segments, incarnation=incarnation)
    state.status, state.status_reason = status, reason
    return state


# A call's claim on its rollout shared by every replica (store.RedisRolloutStore.claim_call): KEYS[1]
# the claim key, ARGV[1] the holder's token; renewed (ARGV[2]: its expiry, ms) or released only by
# its holder.
LUA_RENEW_CALL = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

LUA_RELEASE_CALL = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
