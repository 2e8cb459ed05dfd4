"""Instruction fingerprints of the sm90 code of every route the sm80 policy gives the Hopper kernel.

A refactor of the Hopper kernel (or of the building blocks it shares with core) must not change what it
compiles to. This compiles each route's kernel ahead of time for sm90 (no GPU needed), reads its SASS with the
``nvdisasm`` that ships with Triton (PTX where that is absent), and records the multiset of instructions: the
opcode with its modifiers, operands left out (register numbers and labels move with any edit). ``--compare``
reads a file written by an earlier run and lists every route whose multiset changed, with the difference;
by default with the kernel's parameter loads counted in words and its ``NOP`` padding left out, which move when
only the order or grouping of its parameters does (``--exact`` compares every instruction).

Routes: each cache layout, head size the kernel is built for, cache dtype and workload class (short calls and
long ones), plus one route per optional feature on the prefix-cached shape (the serving engine's call with
every key in the cache, a window, softcap, ALiBi, sinks, a non-causal call, an FP8 output, skip_decode, an FP8
query) and an fp16 call, decode rows (the idle second consumer) and a few long decode rows whose keys the policy
splits (the merge in the kernel).

``--kernel portable`` does the same for core's portable kernel on those routes (what the H200 runs when the
Hopper kernel is not chosen, and every other GPU); ``--device a100`` compiles them for sm80 with that
device's tiles.

Usage::

    python ci/codegen_fingerprint.py --out before.json
    python ci/codegen_fingerprint.py --compare before.json        # exit 1 when any route changed
    python ci/codegen_fingerprint.py --quick --compare before.json  # the six routes of the bench's rows
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)  # Gluon compiles for a GPU target, not for the interpreter

import torch  # noqa: E402
from pagedprefill.api import select_backend  # noqa: E402
from pagedprefill.backends.triton_base import spec_shape  # noqa: E402
from pagedprefill.cli.info import described_devices  # noqa: E402
from pagedprefill.triton.codegen import sass  # noqa: E402
from pagedprefill.workloads import LLAMA3_8B, BatchSpec, make_problem  # noqa: E402

#: The extents a policy sees for each workload class (the code is compiled for a short twin of the batch).
EXTENTS = {"long": dict(query_lens=(1024,) * 8, context_lens=(7168,) * 8),
           "short": dict(query_lens=(128,) * 64, context_lens=(2048,) * 64)}
FEATURES = {
    "engine": dict(kv_in_cache=True),
    "window": dict(sliding_window=4096),
    "softcap": dict(softcap=30.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "non-causal": dict(causal=False),
    "fp8-out": dict(fp8_out_scale=0.5),
    "skip-decode": dict(skip_decode=True),
    "fp16": dict(dtype=torch.float16),
    "mha": dict(num_kv_heads=32),  # one query head per KV head: the group size is specialised to a constant
    "block-128": dict(block_size=128),
    # an FP8 query on an e4m3 cache (the FP8 score MMAs), the engine's call
    "fp8-query": dict(fp8_query=True, kv_cache_dtype="fp8_e4m3", kv_in_cache=True),
    # decode rows: the second consumer idles on tiles whose half holds no query (IDLE_HALF)
    "decode": dict(query_lens=(1,) * 128, context_lens=(2048,) * 128, kv_in_cache=True),
    # a few long decode rows, each tile's keys split (TILE_CHANGES), merged in the kernel by the last split
    "split-keys": dict(query_lens=(1,) * 4, context_lens=(32768,) * 4, kv_in_cache=True),
}
#: Tile fields a route sets over the policy's: its key splits follow the block table's width, which the short
#: batch the code is compiled for does not have.
TILE_CHANGES = {"split-keys": dict(key_splits=4)}
#: Described devices the routes are compiled for, by name, with their compute capability.
DEVICES = {"h200": 90, "a100": 80}
QUICK = ("nhd/128/auto/long", "split/128/auto/long", "nhd/128/auto/short", "split/128/auto/short",
         "nhd/128/fp8_e4m3/long", "split/128/fp8_e4m3/long")


def routes(quick: bool = False) -> dict[str, BatchSpec]:
    base = BatchSpec(**LLAMA3_8B, spare_blocks=0)
    out = {}
    for layout in ("nhd", "split"):
        for head_size in (64, 96, 128, 256):
            for cache in ("auto", "fp8_e4m3", "fp8_e5m2"):
                for workload, extents in EXTENTS.items():
                    out[f"{layout}/{head_size}/{cache}/{workload}"] = base.replace(
                        layout=layout, head_size=head_size, kv_cache_dtype=cache, **extents)
        for name, change in FEATURES.items():
            out[f"{layout}/128/auto/long+{name}"] = base.replace(layout=layout, **{**EXTENTS["long"], **change})
    if quick:
        out = {name: out[name] for name in QUICK}
    return out


def twin(spec: BatchSpec) -> BatchSpec:
    """A short batch of the same kind: the code depends on shapes and flags, not on lengths."""
    n = min(len(spec.query_lens), 2)
    return spec.replace(query_lens=(33,) * n, context_lens=(70,) * n)


def instructions(text: str, is_sass: bool) -> Counter:
    """The multiset of opcodes (with modifiers, without operands) of a SASS or PTX listing."""
    found = Counter()
    for line in text.splitlines():
        if is_sass:
            match = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", line)
        else:
            match = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.:]*)[\s;]", line)
            if match and line.lstrip().startswith((".", "//")):
                match = None
        if match:
            found[match.group(1)] += 1
    return found


def fingerprint(spec: BatchSpec, device_name: str = "h200", tile_changes: dict = None) -> dict:
    device = described_devices()[device_name]
    backend = select_backend(device)
    shape = spec_shape(spec, twin(spec))
    config = backend.tile_config(shape, device).with_(**(tile_changes or {}))
    row = {"tile": config.to_dict()}
    problem = make_problem(twin(spec))
    compiled = backend.compile_for_target(problem, config, DEVICES[device_name])
    listing = sass(compiled)
    is_sass = listing is not None
    row.update(kernel=config.kernel, listing="sass" if is_sass else "ptx",
               instructions=dict(sorted(instructions(listing if is_sass else compiled.asm["ptx"], is_sass).items())))
    return row


#: Loads of kernel parameters from the constant bank, by the 32-bit words each moves.
PARAMETER_LOADS = {"LDC": 1, "ULDC": 1, "LDC.64": 2, "ULDC.64": 2, "LDC.128": 4}


def normalised(instructions: dict) -> Counter:
    """The multiset with what a kernel's parameter list alone decides folded away: parameter loads counted in
    32-bit words (``ptxas`` pairs two neighbouring parameters into one 64-bit load only when the first sits at a
    multiple of 8 bytes) and no ``NOP`` (alignment padding, which moves with the code before it)."""
    out = Counter()
    for op, n in instructions.items():
        if op in PARAMETER_LOADS:
            out["(parameter words loaded)"] += n * PARAMETER_LOADS[op]
        elif op != "NOP":
            out[op] += n
    return out


def _tile(row: dict) -> dict:
    """A row's tile, without the fields a file written before they existed lacks, where they hold their default
    (``key_splits``: 1)."""
    tile = dict(row.get("tile") or {})
    if tile.get("key_splits") == 1:
        del tile["key_splits"]
    return tile


def difference(before: dict, after: dict, exact: bool = False) -> str:
    """What changed between two routes' rows, in one line ('' when nothing did): the :func:`normalised`
    multisets, or with ``exact`` every instruction."""
    if _tile(before) != _tile(after) or before.get("kernel") != after.get("kernel"):
        return (f"tile or kernel {before.get('kernel')} {before.get('tile')} -> "
                f"{after.get('kernel')} {after.get('tile')}")
    a, b = Counter(before.get("instructions", {})), Counter(after.get("instructions", {}))
    if not exact:
        a, b = normalised(a), normalised(b)
    if a == b:
        return ""
    changed = sorted(set(a) | set(b), key=lambda op: -abs(b[op] - a[op]))
    return ", ".join(f"{op} {a[op]}->{b[op]}" for op in changed if a[op] != b[op])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="PATH", help="write the fingerprints as JSON")
    parser.add_argument("--compare", metavar="PATH", help="compare with fingerprints written earlier")
    parser.add_argument("--quick", action="store_true", help="only the routes of the bench's headline rows")
    parser.add_argument("--only", metavar="TEXT", help="only routes whose name contains TEXT")
    parser.add_argument("--exact", action="store_true",
                        help="compare every instruction, parameter loads and NOP padding included")
    parser.add_argument("--kernel", choices=("auto", "hopper", "portable"), default="auto",
                        help="sm80's kernel choice (PAGEDPREFILL_SM80_KERNEL): portable fingerprints core's kernel")
    parser.add_argument("--device", choices=sorted(DEVICES), default="h200",
                        help="the described device whose policy picks the tiles, compiled for its capability")
    args = parser.parse_args(argv)
    os.environ["PAGEDPREFILL_SM80_KERNEL"] = args.kernel
    before = json.load(open(args.compare)) if args.compare else None
    rows, changed, new_routes = {}, [], []
    for name, spec in routes(args.quick).items():
        if args.only and args.only not in name:
            continue
        started = time.perf_counter()
        try:
            rows[name] = fingerprint(spec, args.device, TILE_CHANGES.get(name.rpartition("+")[2]))
        except Exception as exc:  # a route that does not compile is a finding, not a crash of the report
            rows[name] = {"error": str(exc).strip().splitlines()[-1][:200]}
        row = rows[name]
        status = row.get("error") or f"{row.get('kernel')} {sum(row.get('instructions', {}).values())} instructions"
        if before is not None:
            if name not in before:
                status += "; not in the earlier file"
                new_routes.append(name)
            else:
                if "error" in row or "error" in before[name]:  # a route this target cannot compile, before too
                    diff = "" if row.get("error") == before[name].get("error") else row.get("error", "compiles now")
                else:
                    diff = difference(before[name], row, args.exact)
                status += "; same" if not diff else f"; CHANGED: {diff}"
                if diff:
                    changed.append(name)
        print(f"{name:<36} {time.perf_counter() - started:5.1f} s  {status}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1, sort_keys=True)
    if before is not None:
        compared = len(rows) - len(new_routes)
        print(f"{compared - len(changed)} of {compared} routes compile to the same instructions"
              + (f"; changed: {', '.join(changed)}" if changed else "")
              + (f"; {len(new_routes)} not in the earlier file" if new_routes else ""))
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
