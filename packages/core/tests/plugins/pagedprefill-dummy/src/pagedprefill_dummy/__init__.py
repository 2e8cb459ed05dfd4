"""Test plugin: the ``dummy`` backend, for devices whose vendor is ``dummyvendor`` (there are none)."""

VENDOR = "dummyvendor"
