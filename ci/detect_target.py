"""Is a hardware target present? Prints ``present: ...`` (exit 0) or ``absent: reason`` (exit 3).

Used by the nox sessions ``sm80``, ``bi100`` and ``generic`` so they skip with a clear message on machines
without the hardware. Usage: ``python ci/detect_target.py {sm80,bi100,generic}``.

The target is a backend's name, and the answer is that backend's own ``supports()`` for the current
accelerator as detected through every installed backend's detection hook: this script knows no vendor.
"""

import sys


def main(target: str, device=None) -> int:
    """Print the verdict for ``target`` on ``device`` (default: the current accelerator); return the exit code."""
    try:
        import torch  # noqa: F401  (a clear message below when torch itself is missing)
    except ImportError:
        print("absent: torch is not installed")
        return 3
    from pagedprefill import BackendUnavailableError, DeviceInfo, get_registry

    info = DeviceInfo.detect(device)
    if info.type == "cpu":
        print(f"absent: no accelerator visible to torch {torch.__version__}; the {target} session needs one")
        return 3
    try:
        backend = get_registry().get(target)
    except BackendUnavailableError as exc:
        print(f"absent: {exc}")
        return 3
    reasons = backend.supports(info)
    if reasons:
        print(f"absent: the {target} backend cannot run on {info.describe()}: {'; '.join(reasons)}")
        return 3
    print(f"present: {target} runs on {info.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
