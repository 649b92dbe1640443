"""The AMX permission hook: registered where vLLM looks for it, and safe to call anywhere."""

import ctypes
from importlib.metadata import entry_points

from infermesh.sidecar import cpu_amx


def test_vllm_loads_the_hook_in_every_process():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "infermesh_amx_permission"]
    assert ep.load() is cpu_amx.request_amx_permission


def test_permission_is_granted_where_the_cpu_has_amx_and_calls_are_idempotent():
    libc = ctypes.CDLL(None, use_errno=True)
    supported = ctypes.c_ulong(0)
    has_amx = (cpu_amx.platform.machine() == "x86_64"
               and libc.syscall(cpu_amx.SYS_ARCH_PRCTL, cpu_amx.ARCH_GET_XCOMP_SUPP, ctypes.byref(supported)) == 0
               and bool(supported.value & (1 << cpu_amx.XFEATURE_XTILEDATA)))
    assert cpu_amx.request_amx_permission() is has_amx
    assert cpu_amx.request_amx_permission() is has_amx
