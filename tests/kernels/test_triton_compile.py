"""The kernels compile for Hopper (sm_90) without register spills, using the launch configs the wrappers pick.

The interpreter accepts code the compiler rejects, so this is the GPU-free check that the real path builds.
Compiling needs no GPU (Triton ships ptxas); it runs in a subprocess because kernels decorated under
TRITON_INTERPRET=1 cannot be compiled. Run directly: `python tests/kernels/test_triton_compile.py`.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def compile_one(fn, dtype: str, meta: dict, pointers: dict | None = None) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    meta = dict(meta)
    num_warps = meta.pop("num_warps")
    ptr_dtypes = {"part_out": "fp32", "part_lse": "fp32", "block_tables": "i32", "context_lens": "i32",
                  "cu_seqlens_q": "i32", "slot_mapping": "i64", "k_scale": "fp32", "v_scale": "fp32",
                  **(pointers or {})}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in meta:
            signature[name] = "constexpr"
        elif name == "scale_log2":
            signature[name] = "fp32"
        elif name.startswith("stride") or name.endswith("_stride") or name in ("split_len", "num_heads"):
            signature[name] = "i32"
            # strides over head_dim rows: the JIT sees multiples of 16, but for a quantized cache's rows (head_dim
            # codes and a 2-byte scale)
            packed = "k_bytes" in ptr_dtypes and name in ("stride_kslot", "stride_kh")
            if name not in ("stride_bt", "num_heads") and not packed:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "*" + ptr_dtypes.get(name, dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, signature, meta, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps})
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    return next(line.strip() for line in usage.splitlines() if "REG:" in line)


def main() -> int:
    import torch

    from tidepool.kernels import triton_kv_store as store, triton_paged_attention as attn
    dtypes = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    cases = []   # (name, kernel, dtype, meta, pointer dtypes beside dtype)
    for dtype, name in dtypes.items():
        dims = (16, 32, 64, 80, 128, 256) if dtype != torch.float32 else (16, 128, 256)
        for head_dim in dims:
            for group in (1, 4, 8):
                meta = attn.kernel_meta("decode", 8 * group, 8, head_dim, 16, dtype, "cuda", num_splits=4)
                cases.append((f"decode {name} D={head_dim} G={group}", attn._decode_kernel, name, meta, None))
            for max_q in (1, 512):
                meta = attn.kernel_meta("varlen", 32, 8, head_dim, 16, dtype, "cuda", max_seqlen_q=max_q)
                cases.append((f"varlen {name} D={head_dim} max_q={max_q}", attn._varlen_kernel, name, meta, None))
        merge = dict(HEAD_DIM=128, NUM_SPLITS=5, BLOCK_S=8, BLOCK_D=128, num_warps=4)
        cases.append((f"merge {name}", attn._merge_splits_kernel, name, merge, None))
        cases.append((f"store {name}", store._store_kv_kernel, name, dict(ROW=1024, BLOCK=1024, num_warps=4),
                      {"slot_mapping": "i64"}))
    # quantized caches (kernels/kv_quant.py) under bf16 queries
    for cache, qmax in (("fp8e4nv", 448.0), ("fp8e5", 57344.0), ("i8", 127.0)):
        caches = {"k_cache": cache, "v_cache": cache, "k_bytes": "u8", "v_bytes": "u8"}     # codes; rows' scales
        for head_dim in (64, 128):
            meta = attn.kernel_meta("decode", 32, 8, head_dim, 16, torch.bfloat16, "cuda", num_splits=4, quant=True)
            cases.append((f"decode {cache} D={head_dim}", attn._decode_kernel, "bf16", meta, caches))
            meta = attn.kernel_meta("varlen", 32, 8, head_dim, 16, torch.bfloat16, "cuda", max_seqlen_q=512,
                                    quant=True)
            cases.append((f"varlen {cache} D={head_dim}", attn._varlen_kernel, "bf16", meta, caches))
        meta = dict(HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, QMAX=qmax, INT8=cache == "i8", num_warps=4)
        cases.append((f"store {cache}", store._store_kv_quant_kernel, "bf16", meta,
                      {**caches, "slot_mapping": "i64", "k_scale": "fp32", "v_scale": "fp32"}))
    failed = 0
    for label, fn, dtype, meta, pointers in cases:
        usage = compile_one(fn, dtype, meta, pointers)
        spills = "STACK:0 " not in usage + " "
        failed += spills
        print(f"{'SPILLS ' if spills else 'ok     '}{label:<32} {usage}", flush=True)
    print(f"{len(cases)} configs compiled for sm_90, {failed} with spills")
    return 1 if failed else 0


def test_kernels_compile_for_sm90_without_spills():
    import triton
    assert (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists(), \
        "the installed Triton wheel has no bundled ptxas; install the Linux x86_64 wheel the project pins"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


if __name__ == "__main__":
    sys.exit(main())
