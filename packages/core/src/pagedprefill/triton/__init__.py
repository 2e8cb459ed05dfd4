"""Core's Triton library: building blocks, the shared prefill kernel and its launcher.

Importable only when Triton is installed; backends import it lazily, when they first run.
"""
