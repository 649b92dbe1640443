"""Ask Linux for permission to use AMX tiles in every vLLM process, before any kernel runs.

On x86 CPUs with AMX, vLLM's CPU attention picks its AMX kernel for bfloat16 models
(`vllm/v1/attention/backends/cpu_attn.py`, `_get_attn_isa`). Linux (>= 5.16) hands out the AMX
register state only to a process that asked for it (`arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`); the first tile instruction of a process that did not ask is killed with
SIGILL. vLLM's workers are spawned (fork + exec, which drops the permission) and nothing in them
asks before the attention kernel runs unless oneDNN happened to take an AMX path first, so on
such CPUs a worker could die on a short prompt ("Worker proc died unexpectedly (exit code: -4)").

vLLM loads the `vllm.general_plugins` entry points in every process it starts, the workers
included (pyproject.toml registers this function there), which is the earliest hook it offers.
Idempotent and harmless where AMX is absent (the request is simply not made).
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

log = logging.getLogger("infermesh.cpu_amx")

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_GET_XCOMP_SUPP = 0x1021
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_amx_permission() -> bool:
    """True when this process may now use AMX tiles (asked now or before); False where the CPU
    or the kernel offers none, or off x86_64 Linux."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        supported = ctypes.c_ulong(0)
        if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_SUPP, ctypes.byref(supported)) != 0:
            return False
        if not supported.value & (1 << XFEATURE_XTILEDATA):
            return False
        if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
            log.warning("AMX permission refused (errno %d): vLLM's AMX kernels would die with SIGILL", ctypes.get_errno())
            return False
        return True
    except (OSError, AttributeError):
        return False
