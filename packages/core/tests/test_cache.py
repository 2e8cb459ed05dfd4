"""Paged KV-cache utilities: allocation in both layouts, writing tokens at slots, FP8 quantisation, gathering.

Expected cache contents are built element by element from the layout definitions (README: K is
``[num_blocks, Hkv, D // x, block_size, x]``, V is ``[num_blocks, Hkv, D, block_size]``, NHD is
``[num_blocks, block_size, Hkv, D]``) on nested Python lists, independently of the vectorised code.
"""

from __future__ import annotations

import math
import zlib

import pagedprefill as pp
import pytest
import torch
from pagedprefill.validation import expected_x

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: mantissa bits of each FP8 format: the relative rounding error of a normal value is at most 2^-(m+1)
FP8_MANTISSA = {"fp8_e4m3": 3, "fp8_e5m2": 2}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def fill_random(cache: pp.PagedKVCache, g) -> None:
    """Random N(0, 1) content everywhere (FP8 caches: random quantised values)."""
    for t in (cache.key, cache.value):
        if cache.dtype.is_fp8:
            t.copy_(pp.quantize_fp8(randn(g, *t.shape), 1.0, cache.dtype).view(t.dtype))
        else:
            t.copy_(randn(g, *t.shape, dtype=t.dtype))


# -- allocate_cache ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, kv, want_x, storage", [
    (torch.float16, "auto", 8, torch.float16),
    (torch.bfloat16, "auto", 8, torch.bfloat16),
    (torch.float32, "auto", 4, torch.float32),
    (torch.float16, "fp8", 16, torch.uint8),
    (torch.float32, "fp8_e5m2", 16, torch.uint8),
])
@pytest.mark.parametrize("layout", ["split", "nhd"])
def test_allocate_shapes(dtype, kv, want_x, storage, layout):
    nb, bs, hkv, d = 5, 7, 3, 64
    c = pp.allocate_cache(nb, bs, hkv, d, dtype, layout=layout, kv_cache_dtype=kv, k_scale=0.25, v_scale=0.5)
    assert c.key.dtype == c.value.dtype == storage
    if layout == "split":
        assert c.key.shape == (nb, hkv, d // want_x, bs, want_x)
        assert c.value.shape == (nb, hkv, d, bs)
        assert c.x == want_x
        assert c.key.element_size() * want_x == 16
    else:
        assert c.key.shape == c.value.shape == (nb, bs, hkv, d)
        assert c.x == 1
    assert (c.num_blocks, c.block_size, c.num_kv_heads, c.head_size) == (nb, bs, hkv, d)
    assert c.layout is pp.KVLayout(layout)
    assert c.dtype is pp.KVCacheDType.parse(kv)
    assert (c.k_scale, c.v_scale) == (0.25, 0.5)
    assert c.key.is_contiguous() and c.value.is_contiguous()


@pytest.mark.parametrize("head_size, dtype, kv, want_x", [
    (24, torch.float16, "auto", 8),
    (12, torch.float16, "auto", 4),
    (6, torch.float32, "auto", 2),
    (1, torch.float16, "auto", 1),
    (3, torch.bfloat16, "auto", 1),
    (24, torch.float16, "fp8", 8),
    (40, torch.float16, "fp8", 8),
    (80, torch.float16, "fp8", 16),
    (36, torch.float32, "fp8_e5m2", 4),
    (80, torch.float16, "auto", 8),
    (96, torch.float32, "auto", 4),
])
def test_allocate_split_head_sizes_not_multiple_of_chunk(head_size, dtype, kv, want_x):
    """x is 16 bytes of elements, reduced so that it divides the head size."""
    c = pp.allocate_cache(3, 4, 2, head_size, dtype, layout="split", kv_cache_dtype=kv)
    assert c.key.shape == (3, 2, head_size // want_x, 4, want_x)
    assert c.value.shape == (3, 2, head_size, 4)
    assert c.x == want_x and c.head_size == head_size
    assert want_x == expected_x(head_size, c.key.element_size())
    assert head_size % want_x == 0 and 16 % (want_x * c.key.element_size()) == 0


@pytest.mark.parametrize("layout", ["split", "nhd"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_allocate_fill(layout, kv):
    c = pp.allocate_cache(2, 5, 2, 24, torch.float16, layout=layout, kv_cache_dtype=kv, fill=-1.5)
    for t in (c.key, c.value):
        values = t.view(FP8_DTYPES[kv]).float() if kv != "auto" else t.float()
        assert torch.equal(values, torch.full(t.shape, -1.5))
    k, v = pp.gather_kv(c, torch.tensor([1, 0]), 10)
    assert torch.equal(k, torch.full((10, 2, 24), -1.5)) and torch.equal(v, k)


@pytest.mark.parametrize("name, value", [("num_blocks", 0), ("block_size", 0), ("num_kv_heads", -1),
                                         ("head_size", 0), ("block_size", 2.0), ("num_blocks", None)])
def test_allocate_rejects_bad_geometry(name, value):
    args = dict(num_blocks=2, block_size=4, num_kv_heads=1, head_size=8)
    args[name] = value
    with pytest.raises(ValueError, match=rf"^{name}: expected an int >= 1, got {value!r}$"):
        pp.allocate_cache(**args)


def test_allocate_rejects_bad_names():
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        pp.allocate_cache(2, 4, 1, 8, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="'blocked' is not a valid KVLayout"):
        pp.allocate_cache(2, 4, 1, 8, layout="blocked")


# -- write_to_cache / gather_kv ----------------------------------------------------------------------


def expected_after_write(cache: pp.PagedKVCache, key, value, slots):
    """Nested lists of the cache tensors after writing ``key``/``value`` token by token at ``slots``
    (as float values: FP8 bytes are decoded; new values are rounded as the cache stores them)."""
    decode = (lambda t: t.view(cache.dtype.torch_dtype).double()) if cache.dtype.is_fp8 else (lambda t: t.double())
    kl, vl = decode(cache.key).tolist(), decode(cache.value).tolist()
    if cache.dtype.is_fp8:
        k_new = pp.quantize_fp8(key, cache.k_scale, cache.dtype).view(cache.dtype.torch_dtype).double().tolist()
        v_new = pp.quantize_fp8(value, cache.v_scale, cache.dtype).view(cache.dtype.torch_dtype).double().tolist()
    else:
        k_new = key.to(cache.key.dtype).double().tolist()
        v_new = value.to(cache.value.dtype).double().tolist()
    bs, x = cache.block_size, cache.x
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        b, off = divmod(slot, bs)
        for h in range(cache.num_kv_heads):
            for d in range(cache.head_size):
                if cache.layout is pp.KVLayout.SPLIT:
                    kl[b][h][d // x][off][d % x] = k_new[t][h][d]
                    vl[b][h][d][off] = v_new[t][h][d]
                else:
                    kl[b][off][h][d] = k_new[t][h][d]
                    vl[b][off][h][d] = v_new[t][h][d]
    return kl, vl


def naive_gather(cache: pp.PagedKVCache, row: list[int], length: int):
    """Read ``length`` tokens through the block table, element by element, as float64 ``[length, Hkv, D]``."""
    decode = (lambda t: t.view(cache.dtype.torch_dtype).double()) if cache.dtype.is_fp8 else (lambda t: t.double())
    kl, vl = decode(cache.key).tolist(), decode(cache.value).tolist()
    ks = float(cache.k_scale) if cache.dtype.is_fp8 else 1.0
    vs = float(cache.v_scale) if cache.dtype.is_fp8 else 1.0
    bs, x = cache.block_size, cache.x
    k = torch.empty(length, cache.num_kv_heads, cache.head_size, dtype=torch.float64)
    v = torch.empty_like(k)
    for j in range(length):
        b, off = row[j // bs], j % bs
        for h in range(cache.num_kv_heads):
            if cache.layout is pp.KVLayout.SPLIT:
                k[j, h] = torch.tensor([kl[b][h][d // x][off][d % x] for d in range(cache.head_size)])
                v[j, h] = torch.tensor([vl[b][h][d][off] for d in range(cache.head_size)])
            else:
                k[j, h] = torch.tensor(kl[b][off][h])
                v[j, h] = torch.tensor(vl[b][off][h])
    return k * ks, v * vs


def random_slots(g, n_tokens: int, n_slots: int, n_skipped: int) -> torch.Tensor:
    """Distinct random slots for ``n_tokens`` tokens, ``n_skipped`` of them negative (skipped)."""
    slots = torch.randperm(n_slots, generator=g)[:n_tokens]
    skip = torch.randperm(n_tokens, generator=g)[:n_skipped]
    slots[skip] = -1 - torch.arange(n_skipped)  # -1, -2, ...: every negative value skips
    return slots


def decoded(cache, t):
    return t.view(cache.dtype.torch_dtype).double() if cache.dtype.is_fp8 else t.double()


GEOMETRIES = [
    # (num_blocks, block_size, Hkv, D, tokens)
    (6, 8, 2, 32, 30),
    (5, 7, 2, 24, 29),
    (3, 544, 1, 16, 70),
    (9, 1, 3, 8, 9),
    (4, 3, 1, 12, 12),
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "nb{}-bs{}-hkv{}-d{}-n{}".format(*g))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nhd", "split"])
def test_write_then_gather_round_trip(geometry, dtype, layout):
    slot_dtype = torch.int32 if layout == "split" else torch.int64  # both index dtypes are accepted
    nb, bs, hkv, d, n = geometry
    g = gen(zlib.crc32(repr((geometry, dtype, layout)).encode()))
    cache = pp.allocate_cache(nb, bs, hkv, d, dtype, layout=layout)
    fill_random(cache, g)
    key, value = randn(g, n, hkv, d, dtype=dtype), randn(g, n, hkv, d, dtype=dtype)
    slots = random_slots(g, n, nb * bs, n_skipped=max(1, n // 5)).to(slot_dtype)
    want_k, want_v = expected_after_write(cache, key, value, slots.tolist())

    pp.write_to_cache(cache, key, value, slots)

    assert torch.equal(cache.key.double(), torch.tensor(want_k, dtype=torch.float64))
    assert torch.equal(cache.value.double(), torch.tensor(want_v, dtype=torch.float64))
    # every written token reads back exactly through a block table listing all blocks in a shuffled order
    row = torch.randperm(nb, generator=g)
    pos_of_block = {int(b): i for i, b in enumerate(row)}
    k_all, v_all = pp.gather_kv(cache, row.to(torch.int32), nb * bs, dtype=torch.float64)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            pos = pos_of_block[slot // bs] * bs + slot % bs
            assert torch.equal(k_all[pos], key[t].double()) and torch.equal(v_all[pos], value[t].double())
    # and the whole gather equals the element-by-element read
    nk, nv = naive_gather(cache, row.tolist(), nb * bs)
    assert torch.equal(k_all, nk) and torch.equal(v_all, nv)


@pytest.mark.parametrize("layout", ["nhd", "split"])
@pytest.mark.parametrize("bs, length", [(7, 0), (7, 1), (7, 7), (7, 8), (7, 20), (544, 600), (16, 33)])
def test_gather_lengths_and_partial_rows(layout, bs, length):
    """Gather reads only the blocks the length needs (later table entries may be junk) and cuts the last."""
    g = gen(bs * 1000 + length)
    nb, hkv, d = 4, 2, 24
    cache = pp.allocate_cache(nb, bs, hkv, d, torch.float16, layout=layout)
    fill_random(cache, g)
    need = -(-length // bs)
    row = torch.cat([torch.randperm(nb, generator=g)[:need], torch.tensor([10**6, -5])])
    k, v = pp.gather_kv(cache, row, length)
    assert k.shape == v.shape == (length, hkv, d) and k.dtype == torch.float32
    nk, nv = naive_gather(cache, row.tolist(), length)
    assert torch.equal(k.double(), nk) and torch.equal(v.double(), nv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_gather_output_dtype(dtype):
    g = gen(5)
    cache = pp.allocate_cache(3, 5, 1, 8, torch.bfloat16, layout="split")
    fill_random(cache, g)
    k, v = pp.gather_kv(cache, torch.tensor([2, 0, 1]), 13, dtype=dtype)
    assert k.dtype == v.dtype == dtype
    nk, nv = naive_gather(cache, [2, 0, 1], 13)
    assert torch.equal(k.double(), nk) and torch.equal(v.double(), nv)


@pytest.mark.parametrize("layout", ["nhd", "split"])
def test_write_only_negative_slots_changes_nothing(layout):
    g = gen(11)
    cache = pp.allocate_cache(3, 7, 2, 16, torch.float16, layout=layout)
    fill_random(cache, g)
    before_k, before_v = cache.key.clone(), cache.value.clone()
    key, value = randn(g, 4, 2, 16, dtype=torch.float16), randn(g, 4, 2, 16, dtype=torch.float16)
    pp.write_to_cache(cache, key, value, torch.tensor([-1, -1, -100, -2**40]))
    assert torch.equal(cache.key, before_k) and torch.equal(cache.value, before_v)


def test_write_converts_to_cache_dtype():
    """Model-dtype caches store the new values rounded to the cache dtype."""
    g = gen(12)
    cache = pp.allocate_cache(2, 4, 1, 8, torch.float16, layout="split", fill=0.0)
    key, value = randn(g, 3, 1, 8), randn(g, 3, 1, 8)  # float32 input
    pp.write_to_cache(cache, key, value, torch.tensor([5, 0, 7]))
    k, v = pp.gather_kv(cache, torch.tensor([0, 1]), 8)
    for t, slot in enumerate([5, 0, 7]):
        assert torch.equal(k[slot], key[t].half().float()) and torch.equal(v[slot], value[t].half().float())


# -- FP8 --------------------------------------------------------------------------------------------


def fp8_bound(kv: str, x: torch.Tensor, scale: float) -> torch.Tensor:
    """The largest rounding error of ``x`` quantised with ``scale``: half a unit in the last place of a
    normal value, or half the subnormal spacing near zero."""
    fmt = FP8_DTYPES[kv]
    m = FP8_MANTISSA[kv]
    smallest_subnormal = torch.finfo(fmt).smallest_normal * 2.0 ** -m
    # (+ a relative 1e-6: a float scale is applied in float32 when quantising and in float64 when reading)
    return x.abs().double() * (2.0 ** -(m + 1) + 1e-6) + 0.5 * smallest_subnormal * scale + 1e-12


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale_kind", ["float", "0d", "1elem"])
def test_quantize_fp8_precision(kv, scale_kind):
    g = gen(21)
    x = randn(g, 4000) * 3
    scale = pp.fp8_scale_for(x, kv)
    assert scale == pytest.approx(float(x.abs().max()) / torch.finfo(FP8_DTYPES[kv]).max, rel=1e-12)
    s = {"float": scale, "0d": torch.tensor(scale), "1elem": torch.tensor([scale])}[scale_kind]
    s_value = float(torch.tensor(scale)) if scale_kind != "float" else scale
    q = pp.quantize_fp8(x, s, kv)
    assert q.dtype == torch.uint8 and q.shape == x.shape
    back = q.view(FP8_DTYPES[kv]).double() * s_value
    err = (back - x.double()).abs()
    bound = fp8_bound(kv, x, s_value)
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"
    # the largest magnitude maps to (about) the format's largest value and nothing saturates wrongly
    assert float(back.abs().max()) == pytest.approx(float(x.abs().max()), rel=2.0 ** -FP8_MANTISSA[kv])


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_quantize_fp8_saturates(kv):
    fmt = FP8_DTYPES[kv]
    big = torch.finfo(fmt).max
    x = torch.tensor([1e9, -1e9, big * 4, 0.0, float("inf"), float("-inf")])
    back = pp.quantize_fp8(x, 1.0, kv).view(fmt).float()
    assert back.tolist() == [big, -big, big, 0.0, big, -big]
    # a scale divides first
    assert pp.quantize_fp8(torch.tensor([3.0]), 2.0, kv).view(fmt).float().item() == 1.5


def test_quantize_fp8_rejects_auto():
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: expected an FP8 format for quantize_fp8, got 'auto'$"):
        pp.quantize_fp8(torch.ones(2), 1.0, "auto")


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("layout", ["nhd", "split"])
@pytest.mark.parametrize("bs", [7, 16])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_fp8_cache_round_trip(kv, layout, bs, scale_kind):
    g = gen(bs + (layout == "split") + 2 * (kv == "fp8_e5m2"))
    nb, hkv, d, n = 5, 2, 40, 27
    key = randn(g, n, hkv, d, dtype=torch.float16) * 2
    value = randn(g, n, hkv, d, dtype=torch.float16) * 0.5
    ks, vs = pp.fp8_scale_for(key, kv), pp.fp8_scale_for(value, kv)
    if scale_kind == "tensor":
        ks, vs = torch.tensor(ks), torch.tensor([vs])
    cache = pp.allocate_cache(nb, bs, hkv, d, torch.float16, layout=layout, kv_cache_dtype=kv, k_scale=ks,
                              v_scale=vs)
    assert cache.key.dtype == torch.uint8 and cache.x == (8 if layout == "split" else 1)
    fill_random(cache, g)
    slots = random_slots(g, n, nb * bs, n_skipped=3)
    want_k, want_v = expected_after_write(cache, key, value, slots.tolist())
    pp.write_to_cache(cache, key, value, slots)
    assert torch.equal(decoded(cache, cache.key), torch.tensor(want_k, dtype=torch.float64))
    assert torch.equal(decoded(cache, cache.value), torch.tensor(want_v, dtype=torch.float64))

    row = torch.randperm(nb, generator=g)
    pos_of_block = {int(b): i for i, b in enumerate(row)}
    k_all, v_all = pp.gather_kv(cache, row, nb * bs, dtype=torch.float64)
    nk, nv = naive_gather(cache, row.tolist(), nb * bs)
    torch.testing.assert_close(k_all, nk, rtol=1e-15, atol=0)
    torch.testing.assert_close(v_all, nv, rtol=1e-15, atol=0)
    written = [(t, pos_of_block[s // bs] * bs + s % bs) for t, s in enumerate(slots.tolist()) if s >= 0]
    ts, ps = [t for t, _ in written], [p for _, p in written]
    for got, src, scale in ((k_all[ps], key[ts], cache.k_scale), (v_all[ps], value[ts], cache.v_scale)):
        scale = float(scale)
        err = (got - src.double()).abs()
        assert bool((err <= fp8_bound(kv, src, scale)).all())
        assert float(err.max()) > 0  # FP8 really rounds: the comparison is not vacuous


def test_fp8_cache_stored_as_float8_dtype():
    """A cache whose tensors are typed float8 (instead of uint8 bytes) is written and read the same way."""
    g = gen(31)
    nb, bs, hkv, d, n = 4, 5, 1, 16, 12
    key, value = randn(g, n, hkv, d, dtype=torch.bfloat16), randn(g, n, hkv, d, dtype=torch.bfloat16)
    slots = random_slots(g, n, nb * bs, 2)
    as_bytes = pp.allocate_cache(nb, bs, hkv, d, torch.bfloat16, layout="split", kv_cache_dtype="fp8",
                                 k_scale=0.01, v_scale=0.02, fill=0.25)
    typed = pp.PagedKVCache(as_bytes.key.clone().view(torch.float8_e4m3fn),
                            as_bytes.value.clone().view(torch.float8_e4m3fn), "split", "fp8", 0.01, 0.02)
    pp.write_to_cache(as_bytes, key, value, slots)
    pp.write_to_cache(typed, key, value, slots)
    assert typed.key.dtype == torch.float8_e4m3fn
    assert torch.equal(typed.key.view(torch.uint8), as_bytes.key)
    assert torch.equal(typed.value.view(torch.uint8), as_bytes.value)
    row = torch.tensor([3, 1, 0, 2])
    for a, b in zip(pp.gather_kv(typed, row, 17), pp.gather_kv(as_bytes, row, 17)):
        assert torch.equal(a, b)
    untouched = pp.gather_kv(as_bytes, row, nb * bs)[0]
    assert bool((untouched == 0.25 * 0.01).any())  # the fill, dequantised, survives where nothing was written


# -- write_to_cache errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["nhd", "split"])
@pytest.mark.parametrize("case", ["key_2d", "value_shape", "heads", "head_size", "slots_2d", "slots_length",
                                  "slots_float"])
def test_write_to_cache_errors(layout, case):
    g = gen(41)
    cache = pp.allocate_cache(3, 4, 2, 16, torch.float16, layout=layout)
    fill_random(cache, g)
    key, value = randn(g, 5, 2, 16, dtype=torch.float16), randn(g, 5, 2, 16, dtype=torch.float16)
    slots = torch.tensor([0, 3, 5, 11, -1])
    exc, pattern = {
        "key_2d": (ValueError, r"^key/value: expected two \[tokens, num_kv_heads, head_size\] tensors of one "
                               r"shape, got \(5, 32\) and \(5, 2, 16\)$"),
        "value_shape": (ValueError, r"^key/value: expected two .* of one shape, got \(5, 2, 16\) and \(5, 2, 8\)$"),
        "heads": (ValueError, r"^key: expected \[tokens, 2, 16\] to match the cache, got \(5, 1, 16\)$"),
        "head_size": (ValueError, r"^key: expected \[tokens, 2, 16\] to match the cache, got \(5, 2, 8\)$"),
        "slots_2d": (ValueError, r"^slot_mapping: expected shape \[5\], got \(1, 5\)$"),
        "slots_length": (ValueError, r"^slot_mapping: expected shape \[5\], got \(4,\)$"),
        "slots_float": (TypeError, r"^slot_mapping: expected dtype int32 or int64, got float32$"),
    }[case]
    if case == "key_2d":
        key = key.reshape(5, 32)
    elif case == "value_shape":
        value = value[..., :8]
    elif case == "heads":
        key, value = key[:, :1], value[:, :1]
    elif case == "head_size":
        key, value = key[..., :8], value[..., :8]
    elif case == "slots_2d":
        slots = slots[None]
    elif case == "slots_length":
        slots = slots[:4]
    elif case == "slots_float":
        slots = slots.float()
    before_k, before_v = cache.key.clone(), cache.value.clone()
    with pytest.raises(exc, match=pattern):
        pp.write_to_cache(cache, key, value, slots)
    assert torch.equal(cache.key, before_k) and torch.equal(cache.value, before_v)


def test_fp8_scale_for_edge_cases():
    assert pp.fp8_scale_for(torch.zeros(3)) == pytest.approx(1e-12 / 448.0)
    assert pp.fp8_scale_for(torch.empty(0)) == pytest.approx(1e-12 / 448.0)
    assert pp.fp8_scale_for(torch.tensor([-896.0, 1.0])) == 2.0
    assert pp.fp8_scale_for(torch.tensor([57344.0]), "fp8_e5m2") == 1.0
    assert math.isfinite(pp.fp8_scale_for(torch.tensor([1e30])))
