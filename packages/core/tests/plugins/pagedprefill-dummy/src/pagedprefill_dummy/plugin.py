"""Entry point of the ``dummy`` backend (imports nothing heavy)."""

import pagedprefill


@pagedprefill.hookimpl
def pagedprefill_backends():
    from .backend import DummyBackend

    return [DummyBackend()]
