"""Test plugin: the ``example`` backend for "Example X" accelerators, which torch presents as ``xpu`` devices.

No such hardware exists; tests describe one to torch and Triton. Everything that makes the backend work
lives in this package: recognising the hardware (:mod:`.detect`), the backend (:mod:`.backend`) and its
tiling policy (:mod:`.policy`). Core is used as it is.
"""

VENDOR = "examplevendor"
