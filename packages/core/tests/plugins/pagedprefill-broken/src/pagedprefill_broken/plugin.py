"""Entry point of the ``broken`` plugin: importing it fails, like a plugin whose runtime is not installed."""

raise ImportError("pagedprefill-broken needs libbrokenvendor.so, which is not installed")
