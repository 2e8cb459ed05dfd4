"""Entry point of the ``generic`` backend (cheap: imports no Triton)."""

import pagedprefill


@pagedprefill.hookimpl
def pagedprefill_backends():
    from .backend import GenericBackend

    return [GenericBackend()]
