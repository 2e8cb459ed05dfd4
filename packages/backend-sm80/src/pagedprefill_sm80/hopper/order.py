"""The order in which the Hopper kernel's programs take the launch's query tiles under ``SPREAD_LIGHT``.

Programs start in index order and the device keeps every multiprocessor busy with the next one. A tile of a
decode or speculative row (a sequence of at most ``LIGHT`` new tokens, which ``IDLE_HALF`` leaves to one
consumer) is bound by the bytes of keys and values it streams; a prefill tile by its MMAs. When a mixed batch
runs its light tiles back to back, a hundred of them share the memory's bandwidth at once, each holding a
multiprocessor for as long; spread evenly among the heavy tiles, a few at a time stream at a
multiprocessor's own rate while the others compute. So program ``pid`` of ``T`` takes a light tile when
``floor((pid + 1) M / T) > floor(pid M / T)`` (``M`` light tiles), a heavy one otherwise, each class from the
end of the batch first as under ``HEAVY_FIRST`` (a sequence's last tiles see the most keys).

Tile indices are core's (:func:`~pagedprefill.triton.blocks.locate_tile`: sequence ``s`` owns
``start[s + 1] // TPT - start[s] // TPT + 1`` of them from ``start[s] // TPT + s``); indices past the
sequences' (a grid larger than the batch) count as heavy and have nothing to compute. Each program reads the
starts in chunks of ``CHUNK`` sequences, twice: once to count the light tiles, once to find its own, the second
read replacing the binary search of :func:`~pagedprefill.triton.blocks.locate_tile`.

:func:`spread_order` is the same order in Python, the model the GPU tests hold the kernel's to.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

#: Sequences each program reads at a time.
CHUNK = gl.constexpr(1024)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _owned_and_light(query_start, s, num_seqs, TPT: gl.constexpr, LIGHT: gl.constexpr):
    """For sequences ``s``: the tile indices each owns and whether it is light (``(owned, light, exists)``)."""
    ok = s < num_seqs
    first_row = gl.load(query_start + s, mask=ok, other=0)
    end_row = gl.load(query_start + s + 1, mask=ok, other=0)
    owned = gl.where(ok, end_row // TPT - first_row // TPT + 1, 0)
    q_len = end_row - first_row
    light = ok & (q_len >= 1) & (q_len <= LIGHT)
    return owned, light, ok


@gluon.jit
def spread_tile(pid, grid, query_start, num_seqs, TPT: gl.constexpr, LIGHT: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Program ``pid``'s tile of a launch of ``grid`` programs (module docstring): ``(seq, tok0, found)``, its
    sequence and first token within it; ``found`` is false for an index past the sequences' (nothing to do)."""
    layout: gl.constexpr = gl.BlockedLayout([CHUNK // (32 * NUM_WARPS)], [32], [NUM_WARPS], [0])
    offs = gl.arange(0, CHUNK, layout)
    zero = gl.sum(gl.zeros([CHUNK], gl.int32, layout), axis=0)  # a run-time 0 (num_seqs may be a constant)
    light_tiles = zero
    for s0 in range(0, num_seqs, CHUNK):
        owned, light, _ = _owned_and_light(query_start, s0 + offs, num_seqs, TPT, LIGHT)
        light_tiles += gl.sum(gl.where(light, owned, 0), axis=0)
    # Corrupt starts could claim more light tiles than programs: the order then only has to stay in range.
    total = grid.to(gl.int64)
    m = gl.minimum(light_tiles.to(gl.int64), total)
    p = pid.to(gl.int64)
    light_before = p * m // total
    take_light = (p + 1) * m // total > light_before
    # The k-th tile of its class in index order, counted from the end of the batch.
    k = gl.where(take_light, m - 1 - light_before, total - m - 1 - (p - light_before)).to(gl.int32)
    seen = zero
    seq = zero - 1
    within = zero - 1
    for s0 in range(0, num_seqs, CHUNK):
        s = s0 + offs
        owned, light, ok = _owned_and_light(query_start, s, num_seqs, TPT, LIGHT)
        count = gl.where(gl.where(take_light, light, ok & ~light), owned, 0)
        after = gl.associative_scan(count, 0, _add)
        before = after - count
        local = k - seen
        hit = (count > 0) & (before <= local) & (local < after)
        seq = gl.maximum(seq, gl.max(gl.where(hit, s, -1), axis=0))
        within = gl.maximum(within, gl.max(gl.where(hit, local - before, -1), axis=0))
        seen += gl.sum(count, axis=0)
    found = seq >= 0
    return gl.maximum(seq, 0), gl.maximum(within, 0) * TPT, found


def spread_order(starts: list[int], tpt: int, light: int, grid: int) -> list[tuple[int, int, bool]]:
    """:func:`spread_tile` for every program of a launch, in Python: ``(seq, tok0, found)`` per program."""
    n = len(starts) - 1
    owned = [starts[s + 1] // tpt - starts[s] // tpt + 1 for s in range(n)]
    is_light = [1 <= starts[s + 1] - starts[s] <= light for s in range(n)]
    m = min(sum(o for o, lt in zip(owned, is_light) if lt), grid)
    order = []
    for pid in range(grid):
        light_before = pid * m // grid
        take_light = (pid + 1) * m // grid > light_before
        k = m - 1 - light_before if take_light else grid - m - 1 - (pid - light_before)
        seen, found = 0, (0, 0, False)
        for s in range(n):
            count = owned[s] if is_light[s] == take_light else 0
            if count and seen <= k < seen + count:
                found = (s, (k - seen) * tpt, True)
            seen += count
        order.append(found)
    return order
