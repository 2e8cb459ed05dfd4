"""The ``bi100`` backend: core's Triton kernel with the Iluvatar CoreX tiling policy.

It runs on Iluvatar CoreX GPUs only: BI-V100 (ivcore10, capability 7.0), BI-V150 / BI-V150S / MR-V50
(ivcore11, 7.1), and later parts (an ivcore20 reports 8.0), which it accepts with the table's fallback
limits. The device must be identified as Iluvatar, which this package's detection hook does (device name,
``+corex`` torch build, ``torch.corex``, or ``PAGEDPREFILL_VENDOR``; see :mod:`.detect`): capability alone
cannot tell a BI-V100 from an NVIDIA V100.

Every feature of core's kernel is available (GQA/MQA, ALiBi, sliding window, softcap, sinks,
fp16/bf16/fp32, head sizes up to 256, any block size) except FP8 KV caches, as Triton on this hardware
has no FP8 types. float32 with head sizes above 128 needs more than 48 KiB of shared memory per block even
with the smallest tile, so it is refused on BI-V100 (it runs on ivcore11 parts).
"""

from __future__ import annotations

from pagedprefill.backends.triton_base import TritonBackend
from pagedprefill.device import DeviceInfo
from pagedprefill.registry import UnsupportedFeatureError
from pagedprefill.types import PrefillProblem

from .detect import VENDOR
from .policy import bi100_policy


class Bi100Backend(TritonBackend):
    name = "bi100"
    priority = 200
    description = ("Iluvatar CoreX GPUs (BI-V100, BI-V150, MR-V50): Triton kernels with tiles fitted to their "
                   "shared memory; no FP8 KV cache")
    runs_in_interpreter = False
    policy = staticmethod(bi100_policy)
    #: Everything the shared kernel computes but an FP8 output or query: Triton on these parts has no FP8 types.
    supported_features = TritonBackend.supported_features - {"fp8_out_scale", "fp8_query"}

    def hardware_reasons(self, device: DeviceInfo) -> list[str]:
        if device.vendor != VENDOR:
            cap = f"{device.capability[0]}.{device.capability[1]}"
            return [
                f"for Iluvatar CoreX GPUs only, and {device.name!r} is vendor {device.vendor!r} (capability {cap} "
                f"alone does not identify an Iluvatar part); if this is an Iluvatar GPU that was not recognised, "
                f"set PAGEDPREFILL_VENDOR={VENDOR}"
            ]
        return []

    def check_problem(self, problem: PrefillProblem, device: DeviceInfo) -> None:
        kv_dtype = problem.cache.dtype
        if kv_dtype.is_fp8:
            raise UnsupportedFeatureError(
                f"backend 'bi100' does not support an FP8 KV cache (kv_cache_dtype={kv_dtype.value!r}): Triton on "
                f"Iluvatar CoreX GPUs has no FP8 types, so the cache cannot be loaded or converted in the kernel. "
                f"Alternatives: store the cache in the model dtype (fp16 or bf16) and pass kv_cache_dtype='auto', "
                f"or run this call on the reference backend (backend='reference' or "
                f"PAGEDPREFILL_BACKEND=reference), which dequantises FP8 in PyTorch (slow)."
            )
        super().check_problem(problem, device)  # the policy's (remembered) tile must fit shared memory
