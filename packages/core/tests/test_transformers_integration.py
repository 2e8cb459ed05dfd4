"""``pagedprefill.integrations.transformers``: pagedprefill as the attention of transformers' continuous batching.

Randomly initialised tiny models in float32 run ``model.generate_batch`` (greedy) with ``paged|pagedprefill``
and with transformers' own paged implementation, and must give the same tokens and the same log-probabilities
of them (within float32 rounding):

* a Llama with GQA, pages of 16 and of 256 tokens, prompts of different lengths split into chunks by the
  token budget (mixed prefill/decode batches, chunked prefills reading their own cached chunks), a shared
  prefix (which transformers' prefix sharing serves from the same blocks), several decode steps;
* a Mistral whose every layer has a sliding window shorter than the prompts (the cache's rolling buffer, read
  on pages of ``gcd(window, block_size)``);
* a Gemma 3 with sliding and full-attention layers (two layer groups), one key/value head (MQA) and a scale
  that is not ``1/sqrt(head_dim)``, with pages of 256;
* a GPT-OSS (attention sinks, passed as ``s_aux``; alternating sliding and full layers), against
  ``paged|eager``: transformers' ``paged|sdpa`` ignores sinks and GPT-OSS refuses SDPA;
* the padded shapes transformers uses with CUDA graphs (padding tokens, sequences without tokens, a padded
  read index), forced on the CPU;
* a step compiled with ``torch.compile(fullgraph=True)`` and dynamic shapes (``aot_eager``): the attention
  traces without a graph break, so without a host read of a tensor;
* transformers' decode fast path (its block table, empty read/write indices), called directly: the same
  output and cache as the read-index path;
* the generic Triton backend in Triton's interpreter, on a one-layer model (a subprocess, as
  ``TRITON_INTERPRET`` must be set before Triton is imported).

Each comparison also checks, through a spy on the engine-form call, that the batches it claims were run
(reads from the cache, chunked prefills, decode steps, sinks, windows) were. Besides: ``register()`` is
idempotent, the module imports without transformers and then says what to install, and what pagedprefill
cannot compute is refused naming the model's setting.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest
import torch
from pagedprefill import BackendUnavailableError, UnsupportedFeatureError
from pagedprefill.integrations import transformers as integration
from pagedprefill.testing.generation import greedy, prompts
from pagedprefill.testing.interpreted import run_interpreted

REASON = "transformers is not installed (pip install \"pagedprefill[transformers]\")"
INSTALL = 'pip install "pagedprefill[transformers]"'
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tr():
    transformers = pytest.importorskip("transformers", reason=REASON)
    integration.register()
    return transformers


@pytest.fixture
def spy(monkeypatch):
    """Every engine-form call of the integration, as a dict of what it was asked (read on the host here)."""
    calls = []
    real = integration.context_attention_fwd

    def record(q, k, v, o, kv_cache_dtype, k_cache, v_cache, table, starts, seq_lens, *args, **kwargs):
        q_lens = (starts[1:] - starts[:-1]).tolist()
        calls.append({"kv_in_cache": k is None, "page": k_cache.shape[1], "q_lens": q_lens,
                      "ctx": [s - n for s, n in zip(seq_lens.tolist(), q_lens)],
                      "window": kwargs.get("sliding_window"), "sinks": kwargs.get("sinks") is not None,
                      "tokens": q.shape[0], "real_tokens": int(starts[-1])})
        return real(q, k, v, o, kv_cache_dtype, k_cache, v_cache, table, starts, seq_lens, *args, **kwargs)

    monkeypatch.setattr(integration, "context_attention_fwd", record)
    return calls


def generate(tr, model, impl, inputs, **cb):
    """Greedy ``generate_batch`` with ``impl``: each request's (tokens, log-probabilities)."""
    return greedy(tr, model, impl, inputs, NEW_TOKENS, **cb)


def assert_same(ours, theirs):
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs):
        assert len(a) == len(b) == NEW_TOKENS
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def tiny_llama(tr, layers=2, **sizes):
    torch.manual_seed(0)
    config = tr.LlamaConfig(**{"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": layers,
                               "vocab_size": 256, **sizes})
    return tr.LlamaForCausalLM(config).eval()


# ----------------------------------------------------------------------------------------------------------- #
# Registration, and transformers missing


def test_register_is_idempotent_and_adds_the_implementation(tr):
    first, second = integration.register(), integration.register()
    assert first == second == "paged|pagedprefill" == integration.ATTN_IMPLEMENTATION
    interface = tr.AttentionInterface()
    assert interface.get_interface("paged|pagedprefill", None) is integration.paged_attention_forward
    assert list(interface).count("paged|pagedprefill") == 1


def test_without_transformers_register_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match=INSTALL.replace("[", r"\[").replace("]", r"\]")):
        integration.register()
    with pytest.raises(ImportError, match=INSTALL.replace("[", r"\[").replace("]", r"\]")):
        integration.paged_attention_forward(None, None, None, None, None)


def test_the_module_imports_without_transformers():
    script = textwrap.dedent("""
        import sys
        sys.modules["transformers"] = None
        import pagedprefill.integrations.transformers as integration
        try:
            integration.register()
        except ImportError as err:
            print(err)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert INSTALL in proc.stdout


def test_an_older_transformers_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="5.16.2"))
    with pytest.raises(ImportError, match=r"found transformers 5\.16\.2"):
        integration.register()


def test_a_later_transformers_is_refused_saying_why(monkeypatch):
    """5.18 reorganised the paged cache; from 5.20 continuous batching refuses a registered implementation."""
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="5.25.0"))
    with pytest.raises(ImportError, match=r"found transformers 5\.25\.0; later releases .* their own attention"):
        integration.register()


# ----------------------------------------------------------------------------------------------------------- #
# Generation: the same tokens as transformers' own paged attention


@pytest.mark.parametrize(("block_size", "num_blocks"), [(16, 64), (256, 12)])
def test_llama_gqa_gives_the_tokens_of_paged_sdpa(tr, spy, block_size, num_blocks):
    model, inputs = tiny_llama(tr), prompts(256)
    cb = {"block_size": block_size, "num_blocks": num_blocks, "max_batch_tokens": 128}
    theirs = generate(tr, model, "paged|sdpa", inputs, **cb)
    assert not spy
    ours = generate(tr, model, "paged|pagedprefill", inputs, **cb)
    assert_same(ours, theirs)

    assert all(c["kv_in_cache"] and c["page"] == block_size and c["window"] is None for c in spy)
    pairs = [(n, c) for call in spy for n, c in zip(call["q_lens"], call["ctx"])]
    assert any(n > 1 and c > 0 for n, c in pairs)  # a chunked prefill (or a shared prefix) read from the cache
    assert any(n > 1 and c == 0 for n, c in pairs)  # a first chunk
    assert any(set(call["q_lens"]) == {1} for call in spy)  # a decode-only batch
    assert any(1 in call["q_lens"] and max(call["q_lens"]) > 1 for call in spy)  # a mixed batch
    if block_size == 16:  # a prompt that shares 37 tokens starts from the two full blocks another one computed
        assert (39 - 32, 32) in pairs


def test_a_sliding_window_model_gives_the_tokens_of_paged_sdpa(tr, spy):
    torch.manual_seed(0)
    config = tr.MistralConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, num_hidden_layers=2, vocab_size=256, sliding_window=24)
    model, inputs = tr.MistralForCausalLM(config).eval(), prompts(256)
    cb = {"block_size": 16, "num_blocks": 64, "max_batch_tokens": 64}
    assert_same(generate(tr, model, "paged|pagedprefill", inputs, **cb),
                generate(tr, model, "paged|sdpa", inputs, **cb))

    assert spy and all(c["window"] == 24 and c["page"] == 8 and not c["kv_in_cache"] for c in spy)
    # Contexts past the window's reach: transformers keeps 23 tokens, read from a page boundary.
    assert max(max(c["ctx"]) for c in spy) > 23


def test_a_model_with_sliding_and_full_layers_gives_the_tokens_of_paged_sdpa(tr, spy):
    torch.manual_seed(0)
    config = tr.Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=1,
                                 head_dim=32, num_hidden_layers=2, vocab_size=256, sliding_window=20,
                                 query_pre_attn_scalar=20, layer_types=["sliding_attention", "full_attention"])
    model, inputs = tr.Gemma3ForCausalLM(config).eval(), prompts(256)
    assert model.model.layers[0].self_attn.scaling != 32 ** -0.5
    cb = {"block_size": 256, "num_blocks": 24, "max_batch_tokens": 64}
    assert_same(generate(tr, model, "paged|pagedprefill", inputs, **cb),
                generate(tr, model, "paged|sdpa", inputs, **cb))

    kinds = {(c["window"], c["page"], c["kv_in_cache"]) for c in spy}
    assert kinds == {(20, 4, False), (None, 256, True)}


def test_a_model_with_attention_sinks_gives_the_tokens_of_paged_eager(tr, spy):
    torch.manual_seed(0)
    config = tr.GptOssConfig(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, num_hidden_layers=2, vocab_size=256, sliding_window=24,
                             num_local_experts=4, num_experts_per_tok=2)
    model, inputs = tr.GptOssForCausalLM(config).eval(), prompts(256)
    with torch.no_grad():  # sinks far from zero, so that they change the tokens if ignored
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4) * 2)
    cb = {"block_size": 16, "num_blocks": 64, "max_batch_tokens": 64}
    ours = generate(tr, model, "paged|pagedprefill", inputs, **cb)
    assert_same(ours, generate(tr, model, "paged|eager", inputs, **cb))
    assert spy and all(c["sinks"] for c in spy)
    assert {(c["window"], c["kv_in_cache"]) for c in spy} == {(24, False), (None, True)}

    # The sinks matter: without them, the same model gives other log-probabilities.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    without = generate(tr, model, "paged|pagedprefill", inputs, **cb)
    assert [lp for _, lp in without] != [lp for _, lp in ours]


def test_the_padded_shapes_of_cuda_graphs_give_the_same_tokens(tr, spy, monkeypatch):
    from transformers.generation.continuous_batching import model_runner

    init = model_runner.ModelRunner.__init__

    def padded(self, *args, **kwargs):  # what CUDA graphs or compilation turn on, without either
        init(self, *args, **kwargs)
        self.pad_inputs = True

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", padded)
    torch.manual_seed(0)
    config = tr.Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, num_hidden_layers=2, vocab_size=256, sliding_window=20,
                                 layer_types=["full_attention", "sliding_attention"])
    model, inputs = tr.Gemma3ForCausalLM(config).eval(), prompts(256)
    cb = {"block_size": 16, "num_blocks": 64, "max_batch_tokens": 64, "q_padding_interval_size": 16,
          "kv_padding_interval_size": 32}
    assert_same(generate(tr, model, "paged|pagedprefill", inputs, **cb),
                generate(tr, model, "paged|sdpa", inputs, **cb))
    assert any(c["tokens"] > c["real_tokens"] for c in spy)  # padding tokens
    assert any(0 in c["q_lens"] for c in spy)  # padding sequences


def test_a_compiled_forward_traces_the_attention_in_one_graph(tr, monkeypatch):
    """transformers compiles the varlen step with ``fullgraph=True`` when asked: the attention must trace
    without a graph break (no host read of a tensor, no untraceable call), with dynamic shapes."""
    from pagedprefill.backends.reference import ReferenceBackend
    from transformers.generation.configuration_utils import CompileConfig

    runs, run = [], ReferenceBackend.run

    def counted(self, problem, device):  # at run time, inside the compiled graph's operator
        runs.append(problem.num_tokens)
        return run(self, problem, device)

    monkeypatch.setattr(ReferenceBackend, "run", counted)
    # the reference backend whatever the registry would select (generic, under TRITON_INTERPRET=1)
    monkeypatch.setitem(integration._settings, "backend", "reference")

    torch.manual_seed(0)
    config = tr.Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, num_hidden_layers=2, vocab_size=256, sliding_window=20,
                                 layer_types=["sliding_attention", "full_attention"])
    model, inputs = tr.Gemma3ForCausalLM(config).eval(), prompts(256, lengths=(5, 40, 17))
    cb = {"block_size": 16, "num_blocks": 64, "max_batch_tokens": 64}
    theirs = generate(tr, model, "paged|sdpa", inputs, **cb)
    compiled = CompileConfig(fullgraph=True, dynamic=True, backend="aot_eager")
    assert not runs
    assert_same(generate(tr, model, "paged|pagedprefill", inputs, varlen_compile_config=compiled, **cb), theirs)
    assert runs  # the compiled graph's operator ran pagedprefill's backend


def test_the_decode_fast_path_block_table_gives_the_read_index_result():
    """transformers' decode fast path passes its block table and no indices; with the same cache it must
    give what the read/write-index path gives, and write the same slots."""
    torch.manual_seed(0)
    block, blocks, kv_heads, heads, dim = 4, 10, 2, 4, 16
    past = [5, 11, 0]  # cached tokens per sequence, one new token each; a padding sequence follows
    tables = [[7, 2], [1, 8, 4], [3]]
    trash = (blocks + 1) * block

    def cache():
        g = torch.Generator().manual_seed(3)
        shape = ((blocks + 2) * block, kv_heads, dim)
        return types.SimpleNamespace(
            key_cache=[torch.randn(shape, generator=g)], value_cache=[torch.randn(shape, generator=g)],
            block_size=block, layer_index_to_group_indices={0: (0, 0)}, sliding_windows={0: 1},
            write_trash_index=trash)

    def slot(i, position):
        return tables[i][position // block] * block + position % block

    module = types.SimpleNamespace(layer_idx=0, scaling=dim ** -0.5, is_causal=True)
    q = torch.randn(1, heads, 4, dim)  # 3 tokens and one padding token
    k, v = torch.randn(1, kv_heads, 4, dim), torch.randn(1, kv_heads, 4, dim)
    cu_q = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 18, 19, 19], dtype=torch.int32)
    read = torch.tensor([slot(i, p) for i, n in enumerate(past) for p in range(n + 1)])
    write = torch.tensor([slot(i, n) for i, n in enumerate(past)] + [trash])
    by_index = cache()
    expected, _ = integration.paged_attention_forward(
        module, q, k, v, None, scaling=module.scaling, cache=by_index, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
        max_seqlen_q=1, max_seqlen_k=12, read_index=[read], write_index=[write], block_table=None)

    table = torch.full((1, 4, 3), -1, dtype=torch.int32)
    for i, row in enumerate(tables):
        table[0, i, :len(row)] = torch.tensor(row)
    by_table = cache()
    empty = torch.empty(0, dtype=torch.int64)
    got, _ = integration.paged_attention_forward(
        module, q, k, v, None, scaling=module.scaling, cache=by_table, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
        max_seqlen_q=1, max_seqlen_k=1, read_index=[empty], write_index=[empty], block_table=table)
    assert got.shape == (1, 4, heads, dim)
    torch.testing.assert_close(got[:, :3], expected[:, :3], atol=1e-6, rtol=1e-6)
    written = [slot(i, n) for i, n in enumerate(past)]
    torch.testing.assert_close(by_table.key_cache[0][written], by_index.key_cache[0][written], atol=0, rtol=0)
    torch.testing.assert_close(by_table.key_cache[0][:trash], by_index.key_cache[0][:trash], atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------------- #
# Refusals


def _direct_arguments():
    module = types.SimpleNamespace(layer_idx=0, scaling=0.25, is_causal=True,
                                   config=types.SimpleNamespace())
    shape = (2 * 4, 2, 16)
    cache = types.SimpleNamespace(key_cache=[torch.zeros(shape)], value_cache=[torch.zeros(shape)], block_size=4,
                                  layer_index_to_group_indices={0: (0, 0)}, sliding_windows={0: 1},
                                  write_trash_index=4)
    kwargs = {"cache": cache, "cu_seq_lens_q": torch.tensor([0, 2], dtype=torch.int32),
              "cu_seq_lens_k": torch.tensor([0, 2], dtype=torch.int32), "max_seqlen_q": 2, "max_seqlen_k": 2,
              "read_index": [torch.empty(0, dtype=torch.int64)], "write_index": [torch.tensor([0, 1])],
              "block_table": None}
    return module, torch.randn(1, 4, 2, 16), torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16), kwargs


def test_what_pagedprefill_cannot_compute_is_refused_naming_the_setting(monkeypatch):
    module, q, k, v, kwargs = _direct_arguments()
    with pytest.raises(UnsupportedFeatureError, match="attention dropout 0.1 .config.attention_dropout"):
        integration.paged_attention_forward(module, q, k, v, None, dropout=0.1, **kwargs)
    with pytest.raises(UnsupportedFeatureError, match="value head_dim 8 .e.g. config.v_head_dim"):
        integration.paged_attention_forward(module, q, k, v[..., :8], None, **kwargs)
    with pytest.raises(UnsupportedFeatureError, match=r"is not causal \(module.is_causal=False\)"):
        integration.paged_attention_forward(types.SimpleNamespace(**{**vars(module), "is_causal": False}), q, k, v,
                                            None, **kwargs)
    sliding = dict(kwargs, cache=types.SimpleNamespace(**{**vars(kwargs["cache"]), "sliding_windows": {0: 8}}))
    with pytest.raises(UnsupportedFeatureError, match="sliding-window layer of 8 tokens .config.sliding_window."):
        integration.paged_attention_forward(module, q, k, v, None, sliding_window=4, **sliding)
    with pytest.raises(UnsupportedFeatureError, match="was given an attention mask"):
        integration.paged_attention_forward(module, q, k, v, torch.zeros(1, 1, 2, 2), **kwargs)

    # A backend's refusal is restated with the model's settings.
    def refuse(*args, **kw):
        raise UnsupportedFeatureError("backend 'x' does not run sinks")

    monkeypatch.setattr(integration, "context_attention_fwd", refuse)
    with pytest.raises(UnsupportedFeatureError,
                       match=r"layer 0 of SimpleNamespace \(attention sinks .the model's s_aux., head_dim=16, .*"
                             r"cannot run here: backend 'x' does not run sinks"):
        integration.paged_attention_forward(module, q, k, v, None, s_aux=torch.zeros(4), **kwargs)


def test_a_call_outside_continuous_batching_is_refused(tr):
    module, q, k, v, kwargs = _direct_arguments()
    with pytest.raises(ValueError, match="without a paged attention cache: it runs inside continuous batching"):
        integration.paged_attention_forward(module, q, k, v, None, **dict(kwargs, cache=None))


def test_a_direct_call_matches_the_reference_and_writes_the_cache():
    module, q, k, v, kwargs = _direct_arguments()
    out, weights = integration.paged_attention_forward(module, q, k, v, None, **kwargs)
    assert weights is None and out.shape == (1, 2, 4, 16)
    torch.testing.assert_close(kwargs["cache"].key_cache[0][:2], k[0].transpose(0, 1))
    keys = k[0].repeat_interleave(2, dim=0)
    values = v[0].repeat_interleave(2, dim=0)
    dense = torch.nn.functional.scaled_dot_product_attention(q[0], keys, values, is_causal=True, scale=0.25)
    torch.testing.assert_close(out[0], dense.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_calls_on_names_a_backend_for_the_block_only(tr, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # generic then cannot run on the CPU
    module, q, k, v, kwargs = _direct_arguments()
    integration.register(backend="generic")
    try:
        with integration.calls_on("reference"):
            out, _ = integration.paged_attention_forward(module, q, k, v, None, **kwargs)
        keys, values = k[0].repeat_interleave(2, dim=0), v[0].repeat_interleave(2, dim=0)
        dense = torch.nn.functional.scaled_dot_product_attention(q[0], keys, values, is_causal=True, scale=0.25)
        torch.testing.assert_close(out[0], dense.transpose(0, 1), atol=1e-5, rtol=1e-5)
        with pytest.raises(BackendUnavailableError, match="generic"):
            integration.paged_attention_forward(module, q, k, v, None, **kwargs)
    finally:
        integration.register()


# ----------------------------------------------------------------------------------------------------------- #
# The generic backend, in Triton's interpreter

GENERIC_SCRIPT = """
import torch
import transformers as tr
import pagedprefill
from pagedprefill.integrations import transformers as integration
integration.register(backend="generic")
assert pagedprefill.select_backend("cpu", "generic").name == "generic"
torch.manual_seed(0)
config = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_hidden_layers=1, vocab_size=128)
model = tr.LlamaForCausalLM(config).eval()
g = torch.Generator().manual_seed(1)
inputs = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 19, 11)]
generation = tr.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
for impl in ("paged|sdpa", "paged|pagedprefill"):
    model.set_attn_implementation(impl)
    cb = tr.ContinuousBatchingConfig(block_size=16, num_blocks=16, max_batch_tokens=16, return_logprobs=True)
    out = model.generate_batch(inputs, generation_config=generation, continuous_batching_config=cb)
    for r in out.values():
        print(impl, r.error, r.generated_tokens, " ".join(f"{x:.6f}" for x in r.logprobs))
"""


def test_the_generic_backend_serves_a_one_layer_model_in_the_interpreter(tr):
    proc = run_interpreted(GENERIC_SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split(" ", 2) for line in proc.stdout.splitlines() if line.startswith("paged|")]
    theirs = [r[2] for r in rows if r[0] == "paged|sdpa"]
    ours = [r[2] for r in rows if r[0] == "paged|pagedprefill"]
    assert len(theirs) == len(ours) == 3 and all(r[1] == "None" for r in rows)
    for a, b in zip(ours, theirs):
        tokens_a, logprobs_a = a.split("]")
        tokens_b, logprobs_b = b.split("]")
        assert tokens_a == tokens_b
        torch.testing.assert_close(torch.tensor([float(x) for x in logprobs_a.split()]),
                                   torch.tensor([float(x) for x in logprobs_b.split()]), atol=1e-4, rtol=0)
