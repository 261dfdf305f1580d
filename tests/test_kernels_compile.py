"""The Triton kernels compile for NVIDIA GPUs (sm_80, sm_90) without one, and do not spill registers.

The interpreter checks what the kernels compute; this catches what only the GPU compiler sees (tl.dot shape
rules, layouts, register pressure). Compilation needs Triton's bundled NVIDIA toolchain, not a GPU.
"""

import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

from dynvocab.kernels import gathered_head_triton as gathered  # noqa: E402

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(TOOLS, "cuobjdump")),
                                reason="Triton's NVIDIA toolchain is not installed")


def python_function(kernel):
    """The plain Python function under @triton.autotune / @triton.jit (compiled or interpreted)."""
    while not callable(kernel) or hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


def compile_resources(kernel, signature: dict, constants: dict, config=None, arch: int = 90) -> tuple[int, int]:
    """Compile for ``sm_<arch>``; returns (registers, spill stack bytes) of the cubin."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    warps, stages = (config.num_warps, config.num_stages) if config else (4, 2)
    consts = {**constants, **(config.kwargs if config else {})}
    source = ASTSource(fn=JITFunction(python_function(kernel)), signature=signature, constexprs=consts)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": True})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-res-usage", path],
                               capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    return int(regs), int(stack)


def head_signature(dtype: str) -> dict:
    return {"h_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "idx_ptr": "*i64", "out_ptr": "*fp32", "M": "i32",
            "n": "i32", "d": "i32", "stride_h": "i32", "stride_w": "i32", "stride_out": "i32", "M_BUCKET": "i32",
            "N_BUCKET": "i32", "DOT_FP32": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
            "BLOCK_K": "constexpr"}


def first_config(block_m: int):
    return next(c for c in gathered.GATHERED_CONFIGS if c.kwargs["BLOCK_M"] == block_m)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("block_m", [1, 4, 16, 64])
def test_gathered_logits_kernel_compiles(dtype, block_m):
    """Each code path: the GEMV reduction (BLOCK_M 1, 4) and tl.dot (16, 64)."""
    config = first_config(block_m)
    regs, spill = compile_resources(gathered.gathered_logits_kernel, head_signature(dtype),
                                    {"DOT_FP32": dtype == "fp32"}, config)
    assert spill == 0, f"{config} spills {spill} bytes ({regs} registers)"
