"""What the Hopper kernel's partitions share, as aggregates: the compile-time configuration, the query tile's
rows, the key tiles it walks and the shared-memory ring. Each partition takes them as they are, so that its
argument list is written once; constexpr fields stay constexpr inside every partition."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.core import _aggregate as aggregate

#: A run-time value, or one Triton specialised to a constant (an integer argument equal to 1, a bound that
#: is 0 when a feature is off).
_Value = (gl.tensor, gl.constexpr)
#: A TMA descriptor passed to the kernel.
_Descriptor = tma.tensor_descriptor


@gluon.constexpr_function
def _value(x):
    """``x`` as an aggregate field takes it: a constant that reached here as a plain Python number (an integer
    argument equal to 1 is specialised to one) becomes a constexpr."""
    return gl.constexpr(x) if isinstance(x, (bool, int, float)) else x


@aggregate
class KernelConfig:
    """The launch's constexprs (:mod:`.arguments`, core's ``Features`` and ``ScaleFromTensor``, the resolved
    :class:`~.schedule.Schedule`) and what follows from them: ``CONSUMERS`` partitions of ``CONSUMER_WARPS``
    warps with ``ROWS`` rows each, ``TOKENS_PER_TILE`` tokens per tile, ``PADDED`` (the head is narrower than
    the tile), ``PANELS``: a padded head's columns as two power-of-two panels (``HEAD_PANELS``), ``WIDE`` and
    ``NARROW`` columns (64 and 32 of head size 96), which the MMAs and the accumulators cover instead of the
    tile's width (without panels ``WIDE`` is the tile's width and ``NARROW`` 0), ``WRITTEN``: cached tiles the
    producer writes with its own instructions (the split layout's copies and stores, widened FP8 tiles), which
    the consumers fence before their MMAs read them, and ``BOX``: the keys of one TMA box of a cached tile (a
    page, or the whole tile when a page holds several).
    :meth:`tile_bytes` is what one ``[BLOCK_N, HEAD_SIZE]`` tile of a type occupies, which a barrier expects.

    ``BLOCK_N`` and ``HEAD_SIZE`` (``TILE``'s and ``LAYOUT``'s) are fields of their own: the key tile's two
    dimensions, which nearly every load and store reads, and constexprs wherever they are used. A field of
    ``TILE`` or ``LAYOUT`` reads in a jit function as a plain Python number, which a shape handed to a jit
    function (``gl.zeros``) cannot hold."""

    TILE: gl.constexpr
    LAYOUT: gl.constexpr
    FEATURES: gl.constexpr
    SCALE_FROM_TENSOR: gl.constexpr
    SCHEDULE: gl.constexpr
    CONSUMERS: gl.constexpr
    CONSUMER_WARPS: gl.constexpr
    ROWS: gl.constexpr
    TOKENS_PER_TILE: gl.constexpr
    PADDED: gl.constexpr
    PANELS: gl.constexpr
    WIDE: gl.constexpr
    NARROW: gl.constexpr
    WRITTEN: gl.constexpr
    BOX: gl.constexpr
    BLOCK_N: gl.constexpr
    HEAD_SIZE: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, TILE, LAYOUT, FEATURES, SCALE_FROM_TENSOR, SCHEDULE):
        self.TILE = gl.constexpr(TILE)
        self.LAYOUT = gl.constexpr(LAYOUT)
        self.FEATURES = gl.constexpr(FEATURES)
        self.SCALE_FROM_TENSOR = gl.constexpr(SCALE_FROM_TENSOR)
        self.SCHEDULE = gl.constexpr(SCHEDULE)
        tile, layout, schedule = gl.constexpr(TILE).value, gl.constexpr(LAYOUT).value, gl.constexpr(SCHEDULE).value
        consumers = 2 if schedule.PINGPONG else 1
        self.CONSUMERS = gl.constexpr(consumers)
        self.CONSUMER_WARPS = gl.constexpr(tile.NUM_WARPS // consumers)
        self.ROWS = gl.constexpr(tile.BLOCK_M // consumers)
        self.TOKENS_PER_TILE = gl.constexpr(tile.BLOCK_M // tile.HEADS_PER_TILE)
        padded = layout.HEAD_DIM < layout.HEAD_SIZE
        panels = padded and schedule.HEAD_PANELS
        self.PADDED = gl.constexpr(padded)
        self.PANELS = gl.constexpr(panels)
        wide = layout.HEAD_SIZE // 2 if panels else layout.HEAD_SIZE
        narrow = layout.HEAD_DIM - wide if panels else 0
        assert narrow & (narrow - 1) == 0 and narrow < wide, f"head size {layout.HEAD_DIM}: no two panels"
        self.WIDE = gl.constexpr(wide)
        self.NARROW = gl.constexpr(narrow)
        self.WRITTEN = gl.constexpr(layout.SPLIT or layout.FP8_CACHE)
        self.BOX = gl.constexpr(layout.PAGE if layout.PAGE < tile.BLOCK_N else tile.BLOCK_N)
        self.BLOCK_N = gl.constexpr(tile.BLOCK_N)
        self.HEAD_SIZE = gl.constexpr(layout.HEAD_SIZE)

    @gluon.constexpr_function
    def tile_bytes(self, dtype):
        """The bytes of one ``[BLOCK_N, HEAD_SIZE]`` tile (K, V or V^T) of element type ``dtype``."""
        return self.BLOCK_N.value * self.HEAD_SIZE.value * dtype.primitive_bitwidth // 8


@aggregate
class TileRows:
    """Where the query tile's rows are: its first token ``tok0`` within sequence positions ``ctx_len ..
    ctx_len + q_len``, whose first row in q/out is ``seq_row0``; its KV head and chunk of that head's query
    heads (``group_size`` per KV head); ``num_tokens`` rows in q/out."""

    tok0: _Value
    kv_head: _Value
    chunk: _Value
    group_size: _Value
    seq_row0: _Value
    num_tokens: _Value
    ctx_len: _Value
    q_len: _Value

    @gluon.constexpr_function
    def __init__(self, tok0, kv_head, chunk, group_size, seq_row0, num_tokens, ctx_len, q_len):
        self.tok0 = _value(tok0)
        self.kv_head = _value(kv_head)
        self.chunk = _value(chunk)
        self.group_size = _value(group_size)
        self.seq_row0 = _value(seq_row0)
        self.num_tokens = _value(num_tokens)
        self.ctx_len = _value(ctx_len)
        self.q_len = q_len


@aggregate
class Sources:
    """Where the producer reads key tiles from: TMA descriptors over the cached keys and values (``k_cache``,
    ``v_cache``: the NHD layout's, or under ``FP8_BOXES`` the split layout's FP8 keys by pages), the new tokens'
    keys and values (``k_new``, ``v_new``) and the split layout's values as V^T pages (``v_cache_t``); and the split
    layout's caches as pointers with their strides (``split_keys``: ``(key cache, block, head, chunk strides)``,
    ``split_values``: ``(value cache, rows per block, row stride)``). A layout's unused descriptors are
    placeholders."""

    k_cache: _Descriptor
    v_cache: _Descriptor
    k_new: _Descriptor
    v_new: _Descriptor
    v_cache_t: _Descriptor
    split_keys: gl.tuple
    split_values: gl.tuple

    @gluon.constexpr_function
    def __init__(self, k_cache, v_cache, k_new, v_new, v_cache_t, split_keys, split_values):
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.k_new = k_new
        self.v_new = v_new
        self.v_cache_t = v_cache_t
        self.split_keys = split_keys
        self.split_values = split_values


@aggregate
class KeyWalk:
    """The key tiles the query tile visits, which the producer fills and the consumers drain in the same order:
    ``cache_tiles`` cached tiles from position ``cache_start``, then ``new_tiles`` tiles of new tokens from
    index ``new_start`` among them. ``pos_first`` is the tile's first query position and ``full_from`` the lowest
    key every row sees without a window mask."""

    cache_start: _Value
    cache_tiles: _Value
    new_start: _Value
    new_tiles: _Value
    pos_first: _Value
    full_from: _Value

    @gluon.constexpr_function
    def __init__(self, cache_start, cache_tiles, new_start, new_tiles, pos_first, full_from):
        self.cache_start = _value(cache_start)
        self.cache_tiles = _value(cache_tiles)
        self.new_start = _value(new_start)
        self.new_tiles = _value(new_tiles)
        self.pos_first = _value(pos_first)
        self.full_from = full_from


@aggregate
class Channel:
    """One kind of tile's hand-off through the ring's ``STAGES`` buffers, between the producer and the consumers:
    ``ready`` completes when a buffer's tile has landed, ``empty`` when every consumer is done with it.

    Key tile ``it`` of a walk goes through buffer ``stage(it)``, on that buffer's ``it // STAGES``-th round; a
    barrier completes once per round, so a wait for tile ``it`` waits for the parity ``phase(it)``. The methods
    carry that rule: the consumers :meth:`wait_ready` and :meth:`release`, the producer :meth:`wait_empty`
    before it refills a buffer, whose loads then complete its ``ready``."""

    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    STAGES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ready, empty, STAGES):
        self.ready = ready
        self.empty = empty
        self.STAGES = gl.constexpr(STAGES)

    @gluon.jit
    def stage(self, it):
        """The buffer key tile ``it`` goes through."""
        return it % self.STAGES

    @gluon.jit
    def phase(self, it):
        """The parity the barriers of tile ``it``'s buffer complete with on its round."""
        return (it // self.STAGES) & 1

    @gluon.jit
    def wait_ready(self, it):
        """Wait until tile ``it`` has landed in its buffer."""
        mbarrier.wait(self.ready.index(self.stage(it)), self.phase(it))

    @gluon.jit
    def release(self, it):
        """One consumer is done with tile ``it``'s buffer (every consumer's arrival frees it)."""
        mbarrier.arrive(self.empty.index(self.stage(it)), count=1)

    @gluon.jit
    def wait_empty(self, it):
        """The producer: wait until every consumer released the buffer tile ``it`` is to fill, on its previous
        round (the first round passes at once: the parity before any completion)."""
        mbarrier.wait(self.empty.index(self.stage(it)), self.phase(it) ^ 1)


@gluon.jit
def allocate_channel(STAGES: gl.constexpr, ARRIVALS: gl.constexpr, CONSUMERS: gl.constexpr):
    """A :class:`Channel` of ``STAGES`` buffers, initialised: a buffer is ready after ``ARRIVALS`` arrivals (with
    its expected bytes) and empty once each of ``CONSUMERS`` consumers released it."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=ARRIVALS)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return Channel(ready, empty, STAGES)


@aggregate
class Ring:
    """The K/V buffers of ``STAGES`` key tiles and their channels: ``k`` and ``v`` in the 16-bit type the MMAs
    read, ``vt`` the split layout's cached values as V^T pages (``v`` itself in NHD), ``k8``/``v8`` an FP8 cache's
    tiles as they land (``k``/``v`` themselves for a 16-bit cache). ``keys`` hands a buffer's tile over and back
    (its keys and values together); under ``SOFTMAX_UNDER_PV`` the values have a channel of their own,
    ``values`` (``keys`` then counts the keys alone), otherwise ``values`` is ``keys``. ``ready8`` (FP8 caches,
    seen by the producer only) completes when a buffer's FP8 bytes have landed: :meth:`wait_landed`.
    :meth:`stage` is the channels' rule (:class:`Channel`)."""

    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    vt: gl.shared_memory_descriptor
    k8: gl.shared_memory_descriptor
    v8: gl.shared_memory_descriptor
    keys: Channel
    values: Channel
    ready8: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, k, v, vt, k8, v8, keys, values, ready8):
        self.k = k
        self.v = v
        self.vt = vt
        self.k8 = k8
        self.v8 = v8
        self.keys = keys
        self.values = values
        self.ready8 = ready8

    @gluon.jit
    def stage(self, it):
        """The buffer key tile ``it`` goes through."""
        return self.keys.stage(it)

    @gluon.jit
    def wait_landed(self, it):
        """The producer, with an FP8 cache: wait until tile ``it``'s FP8 bytes have landed in the FP8 ring."""
        mbarrier.wait(self.ready8.index(self.stage(it)), self.keys.phase(it))
