"""End to end on the GPU: transformers' continuous batching (``model.generate_batch``) with ``paged|sdpa``,
``paged|flash_attention_4`` (when it runs) and ``paged|pagedprefill``, in one process, on the same batch.

The model is a randomly initialised Llama-3-8B-shaped ``LlamaForCausalLM`` in bfloat16, built from a
``LlamaConfig`` (hidden 4096, 32 heads, 8 key/value heads, head_dim 128, intermediate 14336, vocabulary 128256)
with fewer layers than the real 32 (``--layers``, 8 by default: the output says how many). No weights are
downloaded. The batch is ``--prompts`` prompts of random token ids with lengths drawn uniformly in
``[--min-len, --max-len]`` (32 of 2048-8192 by default), each generating ``--new-tokens`` tokens greedily
(128 by default; end-of-sequence disabled, so every request generates them all), under
``ContinuousBatchingConfig(block_size=256, max_batch_tokens=8192)`` with a cache that holds every request at
once (``--num-blocks``), so that each implementation schedules the same batches.

Each implementation first runs a short warm-up ``generate_batch``, then the whole batch ``--passes`` times (2 by
default), timing the last: the first pass compiles the kernels its steps need (one per tile the policy picks
for a step's shape, seconds each on a first run), which a server pays once at start-up, not per request. Times
come from transformers' own per-request records (``record_timestamps=True``): a request's creation time and the
time each of its tokens was generated, so the manager's start-up (and its CUDA-graph capture) is not counted.
Reported:

* prefill tokens/s: all prompt tokens over the time from the first request's creation to the moment every
  request has its first token (decode steps of early requests run inside that interval too);
* decode tokens/s: tokens generated after that moment, over the time until the last token;
* time to first token: per request, its first token's time minus its creation time (median, p90, max);
* whether the greedy tokens agree with ``paged|sdpa`` (requests with identical tokens; with random bf16
  weights the logits are nearly flat, so a near-tie may legitimately flip a token and the rest of a request);
* with ``--replay-fa4``: layer 0's attention calls of pagedprefill's first pass, each timed again on its own with
  pagedprefill and with FlashAttention-4's paged kernel on the same pages, table and lengths (FA4 on the same
  batches, where transformers' own ``paged|flash_attention_4`` does not run), totals for prefill and decode calls.

Usage: python ci/gpu/transformers_e2e.py [--layers N] [--prompts N] [--min-len N] [--max-len N]
       [--new-tokens N] [--impl NAME ...] [--passes N] [--check] [--host-times] [--replay-fa4] [--json PATH]
       [--png PATH]
       python ci/gpu/transformers_e2e.py --replot JSON --png PATH      (a chart of a written JSON, no GPU)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

IMPLEMENTATIONS = ("paged|sdpa", "paged|flash_attention_4", "paged|pagedprefill")
#: Llama-3-8B's sizes; only the number of layers is an option.
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (Llama-3-8B has 32; default 8)")
    parser.add_argument("--prompts", type=int, default=32, help="number of prompts (default 32)")
    parser.add_argument("--min-len", type=int, default=2048, help="shortest prompt, tokens (default 2048)")
    parser.add_argument("--max-len", type=int, default=8192, help="longest prompt, tokens (default 8192)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    parser.add_argument("--block-size", type=int, default=256, help="cache block size (default 256)")
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="token budget of a step (default 8192)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="cache blocks (default: enough for every request at once, plus 16)")
    parser.add_argument("--impl", nargs="+", default=list(IMPLEMENTATIONS), metavar="NAME",
                        help=f"attention implementations, in order (default: {' '.join(IMPLEMENTATIONS)})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts (default 0)")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    parser.add_argument("--png", type=Path, default=None,
                        help="write a chart of the results here (prefill and decode tokens/s, time to first token, "
                             "wall time per implementation; needs matplotlib)")
    parser.add_argument("--replot", type=Path, default=None, metavar="JSON",
                        help="run nothing: draw --png from a JSON this script wrote (no GPU needed)")
    parser.add_argument("--passes", type=int, default=2,
                        help="generate_batch runs of the whole batch per implementation, the last one timed "
                             "(default 2: the first compiles every kernel the batch's steps need)")
    parser.add_argument("--check", action="store_true",
                        help="run every attention call of paged|pagedprefill's first (untimed) pass also on the "
                             "reference backend and compare (needs --passes 2 or more)")
    parser.add_argument("--replay-fa4", action="store_true",
                        help="record layer 0's attention calls of paged|pagedprefill's first (untimed) pass, then time "
                             "each again on its own, on the same cache pages, with pagedprefill and with "
                             "FlashAttention-4's paged kernel (flash_attn.cute, when it imports): FA4 on the same "
                             "batches where transformers' own paged|flash_attention_4 does not run (needs --passes 2 "
                             "or more)")
    parser.add_argument("--host-times", action="store_true",
                        help="also time the host's side of every attention call of the timed runs (a timer around "
                             "the implementation's function, no synchronisation)")
    args = parser.parse_args(argv)
    if args.replot and not args.png:
        parser.error("--replot: expected --png, the chart to draw")
    if args.passes < 1:
        parser.error("--passes: expected at least 1")
    if args.check and args.passes < 2:
        parser.error("--check: runs on the first, untimed pass; expected --passes 2 or more")
    if args.replay_fa4 and args.passes < 2:
        parser.error("--replay-fa4: records the first, untimed pass; expected --passes 2 or more")
    if not 1 <= args.min_len <= args.max_len:
        parser.error("--min-len and --max-len: expected 1 <= min <= max")
    return args


def build_model(args):
    """The Llama-3-8B-shaped model with ``args.layers`` layers, random weights, bfloat16, on the GPU."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**LLAMA3_8B, num_hidden_layers=args.layers,
                                      max_position_embeddings=max(8192, args.max_len + args.new_tokens))
    torch.manual_seed(args.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def make_prompts(count, min_len, max_len, seed) -> list[list[int]]:
    """``count`` prompts of random token ids, their lengths uniform in ``[min_len, max_len]``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=g).tolist()
    return [torch.randint(1000, LLAMA3_8B["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def blocks_for(prompts, new_tokens, block_size) -> int:
    """Blocks for every request at once (with its new tokens), plus a margin."""
    return sum(math.ceil((len(p) + new_tokens) / block_size) for p in prompts) + 16


def generate(model, impl, prompts, new_tokens, cb_kwargs):
    """One ``generate_batch`` with ``impl``: the results in input order (GenerationOutput objects)."""
    import transformers

    model.set_attn_implementation(impl)
    generation = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                               pad_token_id=0)
    config = transformers.ContinuousBatchingConfig(**cb_kwargs)
    out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=config,
                               record_timestamps=True)
    return list(out.values())


def measure(results, prompts) -> dict:
    """Throughputs and times to first token from transformers' per-request timestamps."""
    start = min(r.created_time for r in results)
    firsts = [r.timestamps[0] for r in results]
    prefill_end = max(firsts)
    end = max(r.timestamps[-1] for r in results)
    prompt_tokens = sum(len(p) for p in prompts)
    decode_tokens = sum(1 for r in results for t in r.timestamps if t > prefill_end)
    ttft = sorted(f - r.created_time for f, r in zip(firsts, results))
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": sum(len(r.generated_tokens) for r in results),
        "prefill_s": prefill_end - start,
        "prefill_tokens_per_s": prompt_tokens / (prefill_end - start),
        "decode_s": end - prefill_end,
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / (end - prefill_end) if end > prefill_end else None,
        "ttft_median_s": statistics.median(ttft),
        "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "ttft_max_s": ttft[-1],
        "wall_s": end - start,
        "generated_tokens_per_s": sum(len(r.generated_tokens) for r in results) / (end - start),
    }


def agreement(tokens, reference) -> dict:
    """How far greedy tokens agree with the reference implementation's, request by request."""
    same = sum(a == b for a, b in zip(tokens, reference))
    prefixes = []
    for a, b in zip(tokens, reference):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
    return {"identical_requests": same, "requests": len(reference),
            "mean_common_prefix": statistics.mean(prefixes) if prefixes else 0.0}


def run_one(model, impl, prompts, warmup_prompts, args, cb_kwargs) -> dict:
    """Warm up, then time ``impl``; a row that says why when it does not run."""
    import torch

    row = {"impl": impl}
    try:
        warm = generate(model, impl, warmup_prompts, 4, cb_kwargs)
        errors = [r.error for r in warm if r.error]
        if errors or len(warm) != len(warmup_prompts):
            return {**row, "status": "not run", "reason": f"warm-up failed: {errors[0] if errors else 'no results'}"}
        for done in range(1, args.passes + 1):
            # Every pass but the last compiles what the timed batch's steps need (a kernel per tile the policy
            # picks for a step's shape); the last one is timed.
            last = done == args.passes
            times, restore = timed_attention(impl) if args.host_times and last else (None, None)
            errors = records = None
            restores = [restore] if restore is not None else []
            if args.check and done == 1 and impl == "paged|pagedprefill":
                errors, restore = checked_attention(impl)
                restores.append(restore)
            if args.replay_fa4 and done == 1 and impl == "paged|pagedprefill":
                records, restore = recorded_calls(model.config.num_hidden_layers)
                restores.append(restore)
            started = time.perf_counter()
            try:
                results = generate(model, impl, prompts, args.new_tokens, cb_kwargs)
            finally:
                for restore in reversed(restores):
                    restore()
            if not last:
                row.setdefault("untimed_passes_s", []).append(time.perf_counter() - started)
            if records is not None:
                row["replay"] = replay(records)
                print(f"{impl}: layer 0's attention calls of pass 1 timed again on their own: {row['replay']}",
                      flush=True)
                del records
            if errors is not None:
                row["check_against_reference"] = check_summary(errors)
                print(f"{impl}: every attention call of pass 1 against the reference backend: "
                      f"{row['check_against_reference']}", flush=True)
        if times is not None:
            row["attention_host"] = host_summary(times)
            print(f"{impl}: attention calls' host time {row['attention_host']}", flush=True)
    except Exception as err:  # an implementation that cannot run here is a row saying why, not a crash
        return {**row, "status": "not run", "reason": f"{type(err).__name__}: {err}".strip()}
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    errors = [r.error for r in results if r.error]
    if errors or len(results) != len(prompts) or any(not r.timestamps for r in results):
        return {**row, "status": "failed", "reason": errors[0] if errors else "missing results"}
    return {**row, "status": "ok", **measure(results, prompts), "tokens": [r.generated_tokens for r in results]}


def timed_attention(impl: str):
    """Wrap ``impl``'s attention function in transformers' registry with a host timer (no synchronisation: the
    time the host spends in each call, launches included). Returns the list the call times go to and a function
    that puts the original back."""
    import time

    import transformers

    mapping = transformers.AttentionInterface._global_mapping
    name = impl.removeprefix("paged|")
    key = impl if impl in mapping else name
    original, times = mapping[key], []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)

    mapping[key] = timed
    return times, lambda: mapping.__setitem__(key, original)


def checked_attention(impl: str):
    """Wrap ``impl``'s attention function (``paged|pagedprefill``) so that every call is also run on the reference
    backend on the same inputs (:func:`pagedprefill.integrations.transformers.calls_on`) and compared with it
    within the conformance tolerance of the output's dtype. Returns the list the comparisons go to and a function
    that puts the original back."""
    import transformers
    from pagedprefill.cli.bench import output_error
    from pagedprefill.integrations.transformers import calls_on, paged_attention_forward

    mapping = transformers.AttentionInterface._global_mapping
    original, errors = mapping[impl], []

    def checked(*args, **kwargs):
        out, weights = original(*args, **kwargs)
        with calls_on("reference"):
            expected, _ = paged_attention_forward(*args, **kwargs)
        errors.append(output_error(out, expected.float()))
        return out, weights

    mapping[impl] = checked
    return errors, lambda: mapping.__setitem__(impl, original)


def recorded_calls(layers: int):
    """Record every ``layers``-th engine-form call of the integration (layer 0's, as a step calls its layers in
    order) with pagedprefill's own backend: the query, block table, starts and lengths cloned, the cache pages as
    they are (their values change as the run goes on: the replay times the same shapes and lengths, not the same
    numbers). Calls the reference backend makes for ``--check`` are left out. Returns the list the records go to
    and a function that puts the original call back."""
    from pagedprefill.integrations import transformers as integration

    real, records, seen = integration.context_attention_fwd, [], [0]

    def recording(q, k, v, o, kv_cache_dtype, k_pages, v_pages, table, starts, seq_lens, *args, **kwargs):
        if kwargs.get("backend") != "reference":
            if seen[0] % layers == 0:
                records.append(dict(q=q.clone(), k_pages=k_pages, v_pages=v_pages, table=table.clone(),
                                    starts=starts.clone(), seq_lens=seq_lens.clone(), sm_scale=kwargs.get("sm_scale"),
                                    window=kwargs.get("sliding_window"), sinks=kwargs.get("sinks"),
                                    softcap=kwargs.get("softcap") or 0.0))
            seen[0] += 1
        return real(q, k, v, o, kv_cache_dtype, k_pages, v_pages, table, starts, seq_lens, *args, **kwargs)

    integration.context_attention_fwd = recording
    return records, lambda: setattr(integration, "context_attention_fwd", real)


def replay(records: list[dict], rep_ms: int = 20) -> dict:
    """Each recorded call timed on its own (median of ``triton.testing.do_bench``) with pagedprefill's engine-form
    drop-in and, where ``flash_attn.cute`` imports and takes the call, FA4's paged kernel on the same pages,
    table and lengths (after comparing the two outputs); totals over the prefill calls (a step with a sequence of
    more than one new token) and the decode calls."""
    import torch
    import triton.testing
    from pagedprefill import PrefillProblem
    from pagedprefill.cli import fa4 as fa4_peer
    from pagedprefill.vllm import context_attention_fwd

    fa4, line = fa4_peer.load()
    totals = {kind: {"calls": 0, "pagedprefill_ms": 0.0, "fa4_ms": 0.0, "fa4_calls": 0}
              for kind in ("prefill", "decode")}
    why_not, max_diff = set(), 0.0
    for r in records:
        out = torch.empty_like(r["q"])
        seq_lens = r["seq_lens"].to(torch.int32)
        q_lens = r["starts"][1:] - r["starts"][:-1]
        kind = "prefill" if int(q_lens.max()) > 1 else "decode"

        def ours(r=r, out=out, seq_lens=seq_lens):
            context_attention_fwd(r["q"], None, None, out, "auto", r["k_pages"], r["v_pages"], r["table"], r["starts"],
                                  seq_lens, None, None, 1.0, 1.0, sliding_window=r["window"], sm_scale=r["sm_scale"],
                                  sinks=r["sinks"], softcap=r["softcap"])
            return out

        t = totals[kind]
        t["calls"] += 1
        t["pagedprefill_ms"] += triton.testing.do_bench(ours, warmup=5, rep=rep_ms, return_mode="median")
        if fa4 is None:
            why_not.add(line)
            continue
        problem = PrefillProblem.from_tensors(r["q"], None, None, out, r["k_pages"], r["v_pages"], r["table"],
                                              r["starts"], seq_lens, None,
                                              sm_scale=r["sm_scale"], sliding_window=r["window"], sinks=r["sinks"],
                                              softcap=r["softcap"])
        reason = fa4_peer.unsupported(problem)
        if reason:
            why_not.add(reason)
            continue
        theirs = fa4_peer.paged_call(fa4, problem)
        real_rows = int(r["starts"][-1])  # padding tokens past the last start are nobody's
        max_diff = max(max_diff, float((ours()[:real_rows].float() - theirs()[:real_rows].float()).abs().max()))
        t["fa4_ms"] += triton.testing.do_bench(theirs, warmup=5, rep=rep_ms, return_mode="median")
        t["fa4_calls"] += 1
    return {**totals, "fa4_max_abs_diff": max_diff, "fa4_not_run": sorted(why_not)}


def check_summary(errors: list[dict]) -> dict:
    """Calls compared, how many were beyond the tolerance, and the largest errors."""
    return {"calls": len(errors), "beyond_tolerance": sum(not e["within_tolerance"] for e in errors),
            "max_rel_l2": max((e.get("rel_l2", float("inf")) for e in errors), default=None),
            "max_abs_err": max((e.get("max_abs_err", float("inf")) for e in errors), default=None)}


#: A call whose host time passes this compiled a kernel or waited for the GPU.
SLOW_CALL_S = 0.05


def host_summary(times: list[float]) -> dict:
    """Calls, total seconds, the median and 90th percentile in microseconds of the attention calls' host times, and
    the calls slower than :data:`SLOW_CALL_S` (how many, and their seconds)."""
    ordered = sorted(times)
    slow = [t for t in times if t > SLOW_CALL_S]
    return {"calls": len(times), "host_s": sum(times), "median_us": 1e6 * statistics.median(ordered) if times else None,
            "p90_us": 1e6 * ordered[int(0.9 * (len(ordered) - 1))] if times else None,
            "slow_calls": len(slow), "slow_calls_s": sum(slow)}


def environment() -> dict:
    """Date, commit, GPU, versions and the backend pagedprefill selects for the GPU."""
    import pagedprefill
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    try:
        backend = pagedprefill.select_backend(torch.device("cuda")).name
    except Exception as err:  # reported, not fatal: paged|pagedprefill's row then says why it did not run
        backend = f"none ({err})"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "pagedprefill_backend": backend}


def chart(payload: dict, path: Path) -> Optional[Path]:
    """A chart of the ``ok`` rows of a run's results (the JSON's payload): one panel each for prefill tokens/s,
    decode tokens/s, the median time to first token and the wall time, a bar per implementation. None if
    matplotlib is missing or no row ran."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in payload["rows"] if r["status"] == "ok"]
    if not rows:
        return None
    panels = (("prefill_tokens_per_s", "prefill tok/s"), ("decode_tokens_per_s", "decode tok/s"),
              ("ttft_median_s", "time to first token, median (s)"), ("wall_s", "wall (s)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6))
    names = [r["impl"].removeprefix("paged|") for r in rows]
    for ax, (key, label) in zip(axes, panels):
        values = [r.get(key) or 0.0 for r in rows]
        bars = ax.bar(names, values, color=[f"C{i}" for i in range(len(rows))])
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 1000 else f"{v:.3g}" for v in values], fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    env = payload.get("environment", {})
    fig.suptitle(f"transformers continuous batching, {payload.get('layers')} layers of Llama-3-8B shapes, "
                 f"{payload.get('prompts')} prompts, {payload.get('new_tokens')} new tokens each; "
                 f"{env.get('gpu', '?')}, transformers {env.get('transformers', '?')}, "
                 f"{str(env.get('date', ''))[:10]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        drawn = chart(json.loads(args.replot.read_text()), args.png)
        print(f"wrote {drawn}" if drawn else "no chart: matplotlib is missing or no row ran")
        return 0 if drawn else 1
    import torch

    if not torch.cuda.is_available():
        print("transformers_e2e: no CUDA device; this script measures the GPU", file=sys.stderr)
        return 1
    from pagedprefill.integrations.transformers import register

    register()
    env = environment()
    prompts = make_prompts(args.prompts, args.min_len, args.max_len, args.seed)
    warmup_prompts = make_prompts(4, min(512, args.min_len), min(1024, args.max_len), args.seed + 1)
    num_blocks = args.num_blocks or blocks_for(prompts, args.new_tokens, args.block_size)
    cb_kwargs = {"block_size": args.block_size, "max_batch_tokens": args.max_batch_tokens, "num_blocks": num_blocks}
    print(f"model: Llama-3-8B shapes, {args.layers} of 32 layers (random weights, bfloat16); "
          f"{len(prompts)} prompts of {args.min_len}-{args.max_len} tokens ({sum(map(len, prompts))} in all), "
          f"{args.new_tokens} new tokens each; ContinuousBatchingConfig(block_size={args.block_size}, "
          f"max_batch_tokens={args.max_batch_tokens}, num_blocks={num_blocks})")
    print(f"{env['gpu']}, torch {env['torch']}, transformers {env['transformers']}, "
          f"pagedprefill backend: {env['pagedprefill_backend']}, commit {env['commit']}")
    model = build_model(args)

    rows = []
    for impl in args.impl:
        row = run_one(model, impl, prompts, warmup_prompts, args, cb_kwargs)
        rows.append(row)
        print(format_row(row), flush=True)
    reference = next((r for r in rows if r["impl"] == "paged|sdpa" and r["status"] == "ok"), None)
    for row in rows:
        if row["status"] == "ok" and reference is not None and row is not reference:
            row["agreement_with_paged_sdpa"] = agreement(row["tokens"], reference["tokens"])
            a = row["agreement_with_paged_sdpa"]
            print(f"{row['impl']}: greedy tokens identical to paged|sdpa for {a['identical_requests']} of "
                  f"{a['requests']} requests (mean common prefix {a['mean_common_prefix']:.1f} tokens)")
    payload = {"environment": env, "layers": args.layers, "prompts": len(prompts),
               "prompt_lengths": [len(p) for p in prompts], "new_tokens": args.new_tokens,
               "continuous_batching": cb_kwargs, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json}")
    if args.png:
        drawn = chart(payload, args.png)
        print(f"wrote {drawn}" if drawn else "no chart: matplotlib is missing or no row ran")
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def format_row(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['impl']:<24} {row['status']}: {row['reason']}"
    decode = row["decode_tokens_per_s"]
    return (f"{row['impl']:<24} prefill {row['prefill_tokens_per_s']:10.0f} tok/s   decode "
            f"{decode if decode is not None else float('nan'):8.1f} tok/s   time to first token median "
            f"{row['ttft_median_s']:.2f} s, p90 {row['ttft_p90_s']:.2f} s, max {row['ttft_max_s']:.2f} s   "
            f"wall {row['wall_s']:.2f} s ({row['generated_tokens_per_s']:.1f} generated tok/s)")


if __name__ == "__main__":
    sys.exit(main())
