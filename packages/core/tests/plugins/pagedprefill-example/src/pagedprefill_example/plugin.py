"""Entry point of the ``example`` backend: the backend, and the detection of its hardware."""

import pagedprefill


@pagedprefill.hookimpl
def pagedprefill_backends():
    from .backend import ExampleBackend

    return [ExampleBackend()]


@pagedprefill.hookimpl
def pagedprefill_detect_device(info):
    from .detect import detect_example

    return detect_example(info)
