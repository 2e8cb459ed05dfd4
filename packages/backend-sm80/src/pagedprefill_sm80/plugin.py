"""Entry point of the ``sm80`` backend (cheap: imports no Triton)."""

import pagedprefill


@pagedprefill.hookimpl
def pagedprefill_backends():
    from .backend import Sm80Backend

    return [Sm80Backend()]
