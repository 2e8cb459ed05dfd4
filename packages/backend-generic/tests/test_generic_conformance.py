"""The core conformance suite run on the generic backend (interpreter on CPU, real kernels on GPUs)."""

from pagedprefill.testing import ConformanceSuite


class TestGenericConformance(ConformanceSuite):
    backend = "generic"
