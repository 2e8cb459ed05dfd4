"""transformers' continuous batching on the GPU with ``paged|pagedprefill``, on the backend selected for the GPU
(sm80 on NVIDIA: its Hopper kernel for 16-bit calls at head sizes 64, 96, 128 and 256 on sm90, the portable
kernel for the rest, float32 among them). Randomly initialised tiny models run ``model.generate_batch``:

* in float32, greedy tokens and log-probabilities equal to transformers' own ``paged|sdpa`` on the same GPU (a
  GQA Llama at head sizes 32 and 128, pages of 16 and 256, chunked prefills, mixed batches, a shared prefix);
* in bfloat16 at head sizes 64, 96 and 128, every attention call of the run also computed by the reference
  backend on the very inputs the model gave it (``calls_on("reference")``) and within the conformance tolerance
  of bfloat16. Greedy tokens are not compared in bfloat16: with random weights the logits are nearly flat, and
  one rounding difference flips a near-tie and the rest of the request with it.

The CPU tests (``packages/core/tests/test_transformers_integration.py``) cover the model kinds (sliding windows,
sinks, CUDA graphs' padded shapes, ``torch.compile``) on the reference and generic backends.
"""

from __future__ import annotations

import pytest
import torch
from pagedprefill.cli.bench import output_error
from pagedprefill.integrations import transformers as integration
from pagedprefill.testing.generation import greedy, prompts

NEW_TOKENS = 8
#: The CPU tests' prompt lengths and one of more than a page of 128 tokens.
LENGTHS = (5, 70, 17, 40, 3, 29, 130)
REASON = "transformers is not installed (pip install \"pagedprefill[transformers]\")"


@pytest.fixture(scope="module")
def tr():
    transformers = pytest.importorskip("transformers", reason=REASON)
    integration.register()
    return transformers


def tiny_llama(tr, gpu, dtype, head_dim: int, layers: int = 2):
    torch.manual_seed(0)
    config = tr.LlamaConfig(hidden_size=4 * head_dim, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=head_dim, num_hidden_layers=layers, vocab_size=256)
    return tr.LlamaForCausalLM(config).eval().to(device=gpu, dtype=dtype)


def generate(tr, model, impl, inputs, **cb):
    return greedy(tr, model, impl, inputs, NEW_TOKENS, **cb)


@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize(("block_size", "num_blocks"), [(16, 96), (256, 16)])
def test_float32_gives_the_tokens_of_paged_sdpa(tr, gpu, head_dim, block_size, num_blocks):
    model, inputs = tiny_llama(tr, gpu, torch.float32, head_dim), prompts(256, LENGTHS)
    cb = {"block_size": block_size, "num_blocks": num_blocks, "max_batch_tokens": 128}
    ours = generate(tr, model, "paged|pagedprefill", inputs, **cb)
    theirs = generate(tr, model, "paged|sdpa", inputs, **cb)
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs):
        assert len(a) == len(b) == NEW_TOKENS
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("block_size", [16, 256])
def test_bfloat16_calls_match_the_reference_backend(tr, gpu, monkeypatch, head_dim, block_size):
    """Every attention call of a bfloat16 run, on the GPU's backend and on the reference with the same inputs."""
    errors, kinds = [], set()
    real = integration.paged_attention_forward
    mapping = tr.AttentionInterface._global_mapping

    def checked(module, query, key, value, attention_mask, **kwargs):
        out, weights = real(module, query, key, value, attention_mask, **kwargs)
        with integration.calls_on("reference"):
            expected, _ = real(module, query, key, value, attention_mask, **kwargs)
        errors.append(output_error(out, expected.float()))
        kinds.add("decode" if query.shape[-2] == len(kwargs["cu_seq_lens_q"]) - 1 else "prefill")
        return out, weights

    monkeypatch.setitem(mapping, integration.ATTN_IMPLEMENTATION, checked)
    model, inputs = tiny_llama(tr, gpu, torch.bfloat16, head_dim), prompts(256, LENGTHS)
    # No CUDA graphs: the comparison reads its result on the host, which a capture cannot.
    generate(tr, model, integration.ATTN_IMPLEMENTATION, inputs, block_size=block_size,
             num_blocks=96 if block_size == 16 else 16, max_batch_tokens=128, use_cuda_graph=False)
    assert errors and kinds == {"prefill", "decode"}, kinds
    beyond = [e for e in errors if not e["within_tolerance"]]
    assert not beyond, f"{len(beyond)} of {len(errors)} calls beyond bf16's tolerance, e.g. {beyond[:3]}"
