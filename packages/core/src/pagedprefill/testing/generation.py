"""Greedy generation with transformers' continuous batching, for tests that hold an attention implementation to
another on the same model: the prompts they share, and each request's tokens and log-probabilities. Needs
transformers (``pip install "pagedprefill[transformers]"``); the caller passes the module it imported."""

from __future__ import annotations

import torch


def prompts(vocab: int, lengths=(5, 70, 17, 40, 3, 29), shared: int = 37, seed: int = 1) -> list[list[int]]:
    """Prompts of the given lengths, then two that share a ``shared``-token prefix (scheduled after the others,
    so that the prefix's blocks are complete when they arrive)."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
    prefix = torch.randint(1, vocab, (shared,), generator=g).tolist()
    return out + [prefix + [7, 9], prefix + [11]]


def greedy(transformers, model, impl: str, inputs: list[list[int]], new_tokens: int, **batching) -> list[tuple]:
    """``model.generate_batch`` of ``inputs`` with attention ``impl``, greedy, ``new_tokens`` per request (no end
    token), ``batching`` the ``ContinuousBatchingConfig``'s fields: each request's (tokens, log-probabilities).
    Fails naming the requests that ended in an error."""
    model.set_attn_implementation(impl)
    config = transformers.ContinuousBatchingConfig(return_logprobs=True, **batching)
    generation = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                               pad_token_id=0)
    out = model.generate_batch(inputs, generation_config=generation, continuous_batching_config=config)
    results = list(out.values())
    assert len(results) == len(inputs), (len(results), len(inputs))
    failed = {i: r.error for i, r in enumerate(results) if r.error is not None}
    assert not failed, f"{impl}: requests ended in an error: {failed}"
    return [(r.generated_tokens, r.logprobs) for r in results]
