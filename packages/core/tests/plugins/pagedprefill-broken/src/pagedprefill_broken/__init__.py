"""Test plugin whose entry-point module cannot be imported (as when a vendor runtime is missing)."""
