"""Page-locking the host pool for CUDA copies, with a fallback to pageable memory.

A device-to-host copy into pageable memory goes through the driver's own staging buffer and blocks
the thread that issued it; into page-locked memory it is one DMA that runs while the host goes on.
The pool is registered in place (``cudaHostRegister``) rather than allocated by torch's pinned
allocator, because it may be a /dev/shm file that outlives the process (a RAM tier with a ``path``),
and because it is allocated once and never handed back to a caching allocator.

Containers, WSL and locked-memory limits may refuse. Under ``host.pinned: auto`` the pool then stays
pageable (captures still work, at the driver's staging speed), a warning is logged once per process,
and CUDA's last-error state is cleared: a failed runtime call leaves its error behind, and torch's
check after the next kernel launch would report it as that kernel's.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from tierckpt.errors import ConfigError
from tierckpt.units import format_size

log = logging.getLogger("tierckpt")

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device of the process, not only the current one
_warned = False


def pin(address: int, nbytes: int, mode: str | bool, *, what: str | None = None) -> bool:
    """Page-lock ``nbytes`` at ``address`` as ``host.pinned`` = ``mode`` asks; True when it is now pinned.
    ``what`` names the memory in messages (default: ``the <size> host pool``).

    Raises:
        ConfigError: ``mode`` is True and CUDA is unavailable or the registration was refused.
    """
    global _warned
    if mode is False or nbytes == 0:
        return False
    if not torch.cuda.is_available() or torch.cuda._is_in_bad_fork():
        # (A child fork()ed from a process that used CUDA cannot use it: torch refuses to start it again.)
        if mode is True:
            raise ConfigError("host.pinned is true but CUDA is not available in this process; use auto or false", key="host.pinned")
        return False
    result = _register(address, nbytes)
    if int(result) == 0:
        return True
    clear_error()
    why = f"page-locking {what or f'the {format_size(nbytes)} host pool'} failed: {_describe(result)}"
    if mode is True:
        raise ConfigError(
            f"host.pinned: {why}; lower host.capacity, raise the locked-memory limit, or set host.pinned: auto "
            "to go on with pageable memory (slower captures)",
            key="host.pinned",
        )
    if not _warned:
        _warned = True
        log.warning("tierckpt: %s; going on with pageable host memory: captures from CUDA devices will be slower", why)
    return False


def unpin(address: int) -> None:
    """Undo :func:`pin` (before the memory is unmapped)."""
    result = _unregister(address)
    if int(result) != 0:
        clear_error()
        log.warning("tierckpt: unpinning the host pool failed: %s", _describe(result))


def clear_error() -> None:
    """Reset CUDA's last error (per thread), so that the next kernel launch does not report it as its own."""
    # Torch may have loaded two copies of the runtime (one found by LD_LIBRARY_PATH, one from the
    # nvidia wheels by path), each with its own error state: reset each.
    for library in _cudart_libraries():
        library.cudaGetLastError()
    # And where the runtime is linked statically: the check after a kernel launch (the fill) reads,
    # and so resets, the error. Harmless when nothing is pending.
    try:
        torch.ones(1, device="cuda")
    except RuntimeError:
        pass


def _register(address: int, nbytes: int) -> Any:
    return torch.cuda.cudart().cudaHostRegister(address, nbytes, _PORTABLE)


def _unregister(address: int) -> Any:
    return torch.cuda.cudart().cudaHostUnregister(address)


def _describe(result: Any) -> str:
    try:
        text = torch.cuda.cudart().cudaGetErrorString(result)
    except Exception:  # the binding only takes its own enum; an injected int has no text
        text = "CUDA error"
    return f"{text} (cudaError {int(result)})"


def _cudart_libraries() -> list[ctypes.CDLL]:
    """Every shared CUDA runtime library this process has mapped (torch's among them)."""
    paths: dict[str, None] = {}
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and "/libcudart.so" in fields[5]:
                    paths[fields[5].strip()] = None
    except OSError:
        pass
    libraries = []
    for path in paths:
        try:
            libraries.append(ctypes.CDLL(path))
        except OSError:  # unmapped since, or not loadable by path
            pass
    return libraries
