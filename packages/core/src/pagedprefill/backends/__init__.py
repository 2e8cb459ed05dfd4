"""Backends that ship inside core (only the reference) and the shared base of Triton backends."""
