"""Adapters that make pagedprefill the attention of other libraries' serving paths (each an optional extra)."""
