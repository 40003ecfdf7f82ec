"""GPU kernels compile for Hopper (sm_90) on a machine without a GPU: the invariant attention in each launch form,
B12's GEMM with its packed PTX decode.

The interpreter runs the kernels' Python, not their lowering: a form whose code the interpreter accepts can still
fail to compile for the GPU (a loop-carried value Triton cannot lower, a layout it cannot convert), and B12's
inline PTX is never assembled there at all. Triton compiles for an explicit target with the ptxas its wheel
ships, so CI catches that before a device run does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import b12_codegen  # noqa: E402

from specpilot.kernels import slot_attention as sa  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "part_o_ptr": "*fp32",
            "part_lse_ptr": "*fp32", "slot_ptr": "*i32", "q_start_ptr": "*i32", "q_len_ptr": "*i32",
            "kv_len_ptr": "*i32", "pos_ptr": "*i64", "table_ptr": "*i32", "pages_ptr": "*i32"}
# (head_dim, group, block_m, split_grid, tree, per_token, prefetch): the forms the engine and the benchmarks launch
FORMS = [
    (64, 3, 16, True, False, False, False),  # the embedded model's decode and chain verify
    (128, 4, 32, False, False, False, False),  # Llama-8B's chain verify of many requests
    (64, 3, 16, True, True, False, False),  # trees, packed rows
    (64, 3, 16, True, True, True, False),  # trees, a program per token
    (64, 3, 16, False, True, False, True),  # trees, loads a tile ahead
    (128, 4, 32, False, True, False, True),
]


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton install has no ptxas")
@pytest.mark.parametrize("form", FORMS, ids=lambda f: "-".join(str(int(x)) for x in f))
def test_the_invariant_attention_compiles_for_hopper(form) -> None:
    from triton.backends.compiler import GPUTarget

    head_dim, group, block_m, split_grid, tree, per_token, prefetch = form
    kernel = sa._slot_attn_invariant_kernel
    consts = dict(NUM_KV_HEADS=8, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=sa.INVARIANT_BLOCK_N,
                  SPLIT=sa.SPLIT_KEYS, TABLE=sa.TREE_TABLE_KEYS, SPLIT_GRID=split_grid, TREE=tree,
                  PER_TOKEN=per_token, PREFETCH=prefetch, PAGE=64, PAGED=True, DOT_PRECISION="tf32")
    signature = {name: "constexpr" if name in consts else POINTERS.get(name, "fp32" if name == "qk_scale" else "i32")
                 for name in kernel.arg_names}
    # as the JIT specializes a launch: pointers and strides 16-aligned
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if signature[name].startswith("*") or (name.startswith("stride_") and name != "stride_pages")}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 2, "enable_fp_fusion": False})
    assert compiled.asm["cubin"]


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton install has no ptxas")
@pytest.mark.parametrize("mnk", [(1, 6144, 4096), (16, 4096, 14336), (64, 1000, 1000)], ids=str)
def test_b12_gemm_and_its_packed_decode_compile_for_hopper(mnk) -> None:
    """Llama-8B's qkv at M=1 and down at M=16, and a K with a short last block (its element-wise nibbles)."""
    _, ptx, cubin = b12_codegen.compile_for(*mnk)
    assert cubin and "prmt.b32" in ptx  # the packed decode's byte permutes reached the PTX


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton install has no ptxas")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_training_cross_entropy_compiles_for_hopper(dtype: str) -> None:
    from triton.backends.compiler import GPUTarget

    from specpilot.kernels import cross_entropy as ce

    kernel = ce._cross_entropy_rows_kernel
    signature = {"x_ptr": f"*{dtype}", "stride_row": "i32", "n_cols": "i32", "target_ptr": "*i64",
                 "loss_ptr": "*fp32", "rank_ptr": "*i64", "BLOCK": "constexpr"}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs={"BLOCK": ce.BLOCK})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert compiled.asm["cubin"]
