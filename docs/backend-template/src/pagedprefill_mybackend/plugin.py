"""Entry point of the ``mybackend`` backend.

pagedprefill imports this module when it discovers plugins, in every process that imports pagedprefill,
so it must stay cheap: no Triton import, no kernel compilation, no device query. The backend module is
imported inside the hook, and :meth:`MyBackend.supports` looks only at the :class:`DeviceInfo` it is given.

Detection is the one hook that looks at a device: it is called once per device, when pagedprefill first
describes it, and recognises this backend's hardware (see :mod:`.detect`).
"""

import pagedprefill


@pagedprefill.hookimpl
def pagedprefill_backends():
    from .backend import MyBackend

    return [MyBackend()]


@pagedprefill.hookimpl
def pagedprefill_detect_device(info):
    from .detect import detect_mine

    return detect_mine(info)
