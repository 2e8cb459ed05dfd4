"""Is a hardware target present? Prints ``present: ...`` (exit 0) or ``absent: reason`` (exit 3).

Used by the nox sessions ``sm80``, ``bi100`` and ``generic`` so they skip with a clear message on machines
without the hardware. Usage: ``python ci/detect_target.py {sm80,bi100,generic}``.
"""

import sys


def main(target: str) -> int:
    try:
        import torch
    except ImportError:
        print("absent: torch is not installed")
        return 3
    if not torch.cuda.is_available():
        print(f"absent: no GPU visible to torch {torch.__version__}; the {target} session needs one")
        return 3
    from pagedprefill import DeviceInfo

    info = DeviceInfo.detect()
    if target == "sm80" and not (info.vendor == "nvidia" and info.capability >= (8, 0)):
        print(f"absent: the sm80 target needs an NVIDIA GPU of capability >= 8.0, found {info.describe()}")
        return 3
    if target == "bi100" and info.vendor != "iluvatar":
        print(f"absent: the bi100 target needs an Iluvatar CoreX GPU, found {info.describe()}")
        return 3
    if target == "generic" and info.triton_backend is None:
        print(f"absent: Triton has no active driver for {info.describe()}")
        return 3
    print(f"present: {target} runs on {info.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
