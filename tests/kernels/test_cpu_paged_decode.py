"""The native CPU decode kernel (kernels/csrc/paged_decode_cpu.cpp via kernels/cpu_ops.py) against the pure-torch
reference it replaces (kernels/paged_attention.py), on randomized paged batches whose unowned cache slots hold NaN;
and the "torch" backend of kernels/attention.py, which puts the kernel under the varlen step, against the same."""
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tidepool.kernels import attention, cpu_ops
from tidepool.kernels.paged_attention import paged_attention_ref, paged_decode_ref

pytestmark = pytest.mark.skipif(cpu_ops.compiler() is None, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def native_kernels_switched_on(monkeypatch):
    """cpu_ops.configure (TIDEPOOL_CPU_KERNELS) picks the engine's path; the tests here switch it where they need."""
    monkeypatch.setattr(cpu_ops, "_enabled", True)


@pytest.fixture(scope="module")
def op():
    switch = cpu_ops.enabled()     # see native_kernels_switched_on
    cpu_ops.configure(enabled=True)
    try:
        found = cpu_ops.paged_decode_op()
    finally:
        cpu_ops.configure(enabled=switch)
    assert found is not None, f"a compiler is present but the kernel is unavailable: {cpu_ops.unavailable_reason()}"
    return found


def paged_batch(rng: random.Random, contexts, num_heads, num_kv_heads, head_dim, block_size, dtype, pad=-1):
    """Shuffled blocks, block tables padded with `pad` and viewed out of a wider tensor (row stride > width), NaN in
    every cache slot no sequence owns (slot 0 included)."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    blocks_per_seq = [-(-c // block_size) for c in contexts]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    width = max(blocks_per_seq) + rng.randrange(3)
    tables = torch.full((len(contexts), width + 4), pad, dtype=torch.int32)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b, (n, ctx) in enumerate(zip(blocks_per_seq, contexts)):
        ids = [free.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(ctx):
            owned[ids[pos // block_size] * block_size + pos % block_size] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[~owned] = float("nan")
    q = torch.randn(len(contexts), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables[:, :width], torch.tensor(contexts, dtype=torch.int32)


def random_contexts(rng: random.Random, batch: int, block_size: int, longest: int) -> list[int]:
    out = []
    for _ in range(batch):
        edge = block_size * rng.randint(1, max(1, longest // block_size))
        out.append(rng.choice([1, edge - 1, edge, edge + 1, rng.randint(1, longest)]))
    return [max(1, c) for c in out]


CASES = [  # (seed, dtype, head_dim, block_size, num_kv_heads, group, batch)
    (0, torch.float32, 64, 16, 3, 3, 40), (1, torch.float32, 64, 16, 3, 3, 2), (2, torch.float32, 128, 16, 2, 4, 9),
    (3, torch.float32, 16, 1, 1, 1, 3), (4, torch.float32, 80, 32, 2, 2, 17), (5, torch.float32, 8, 8, 4, 2, 5),
    (6, torch.float32, 256, 16, 1, 8, 4), (7, torch.float32, 24, 4, 3, 1, 33), (8, torch.bfloat16, 64, 16, 3, 3, 12),
    (9, torch.float16, 64, 16, 3, 3, 12), (10, torch.bfloat16, 128, 32, 1, 4, 3), (11, torch.float16, 32, 16, 2, 2, 7),
]
_draw = random.Random(99)
CASES += [(seed, _draw.choice([torch.float32] * 3 + [torch.bfloat16, torch.float16]), _draw.choice([8, 16, 32, 64, 96, 128]),
           _draw.choice([1, 4, 16, 32]), _draw.choice([1, 2, 3]), _draw.choice([1, 2, 3, 4]), _draw.randint(1, 48))
          for seed in range(12, 36)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}   # fp32: the contract; else output rounding


@pytest.mark.parametrize("seed,dtype,head_dim,block_size,num_kv_heads,group,batch", CASES)
def test_matches_torch_path(op, seed, dtype, head_dim, block_size, num_kv_heads, group, batch):
    rng = random.Random(seed)
    contexts = random_contexts(rng, batch, block_size, rng.choice([3, 10, 40]) * block_size)
    q, k_cache, v_cache, tables, lens = paged_batch(rng, contexts, num_kv_heads * group, num_kv_heads, head_dim,
                                                    block_size, dtype, pad=rng.choice([-1, 0]))
    scale = head_dim ** -0.5
    out = op(q, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all(), "a NaN from an unowned slot leaked"
    ref = paged_decode_ref(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)   # poisoned cache too
    err = (out.float() - ref).abs().max().item()
    assert err <= TOL[dtype], f"max abs err {err} > {TOL[dtype]}"


def test_same_result_for_any_thread_count(op):
    rng = random.Random(7)
    contexts = random_contexts(rng, 37, 16, 300)
    args = paged_batch(rng, contexts, 9, 3, 64, 16, torch.float32)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            outs.append(op(*args, 0.125))
            outs.append(op(args[0][:2].contiguous(), *args[1:3], args[3][:2], args[4][:2].contiguous(), 0.125))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(outs[::2], outs[2::2]):
        assert torch.equal(a, b)
    for a, b in zip(outs[1::2], outs[3::2]):
        assert torch.equal(a, b)
    assert torch.equal(outs[1], outs[0][:2])    # split per KV head (few sequences) or not: the same arithmetic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_mixed_batch(op, monkeypatch, dtype):
    """Prefill chunks and decode rows in one step: the "torch" backend (native decode rows) against the pure
    reference; with TIDEPOOL_CPU_KERNELS=0 the backend is the reference."""
    rng = random.Random(3)
    block_size, num_kv_heads, group, head_dim = 16, 3, 3, 64
    q_lens = [1, 5, 1, 1, 17, 1, 1]
    contexts = [1, 40, 16, 17, 17, 33, 200]
    _, k_cache, v_cache, tables, lens = paged_batch(rng, contexts, num_kv_heads * group, num_kv_heads, head_dim,
                                                    block_size, dtype, pad=0)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim).to(dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    native = attention.paged_attention("torch", q, k_cache, v_cache, tables, lens, cu, max(q_lens), 0.125)
    torch_only = paged_attention_ref(q, k_cache, v_cache, tables, lens, cu, 0.125)
    assert torch.isfinite(native).all()
    assert (native.float() - torch_only.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 3e-2)
    monkeypatch.setattr(cpu_ops, "_enabled", False)
    assert cpu_ops.paged_decode_op() is None
    assert torch.equal(attention.paged_attention("torch", q, k_cache, v_cache, tables, lens, cu, max(q_lens), 0.125),
                       torch_only)
    monkeypatch.setattr(cpu_ops, "_enabled", True)
    assert cpu_ops.paged_decode_op() is op
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    rows = cu[:-1][decode].long()
    assert torch.equal(op(q[rows], k_cache, v_cache, tables[decode], lens[decode], 0.125), native[rows])


def test_context_zero_is_a_padding_row(op):
    """Padding rows (context 0, as in the CUDA-graph decode buffers) read nothing and come out as zeros."""
    rng = random.Random(4)
    q, k_cache, v_cache, tables, lens = paged_batch(rng, [7, 1, 30], 6, 2, 64, 16, torch.float32)
    tables = torch.cat([tables, torch.full((2, tables.shape[1]), -1, dtype=torch.int32)])
    q2 = torch.cat([q, torch.randn(2, 6, 64)])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = op(q2, k_cache, v_cache, tables, torch.tensor([7, 1, 30, 0, 0], dtype=torch.int32), 0.125)
            assert torch.equal(out[3:], torch.zeros(2, 6, 64))
            assert torch.equal(out[:3], op(q, k_cache, v_cache, tables[:3], lens, 0.125))
    finally:
        torch.set_num_threads(threads)


def dense_reference(q, k_cache, v_cache, tables, lens, cu, scale):
    """Causal attention position by position in float64, reading only each sequence's own slots."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, length in enumerate(lens.tolist()):
        slots = [tables[b, p // block_size].item() * block_size + p % block_size for p in range(length)]
        k = k_cache.view(-1, num_kv_heads, k_cache.shape[-1])[slots].double().repeat_interleave(group, 1)  # [L, Hq, D]
        v = v_cache.view(-1, num_kv_heads, v_cache.shape[-1])[slots].double().repeat_interleave(group, 1)
        start, end = cu[b].item(), cu[b + 1].item()
        for i, row in enumerate(range(start, end)):
            visible = length - (end - start) + i + 1
            p = torch.einsum("hd,lhd->hl", q[row].double(), k[:visible]).mul(scale).softmax(-1)
            out[row] = torch.einsum("hl,lhd->hd", p, v[:visible])
    return out


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_paged_attention_against_dense(op, native, seed):
    """Decode rows, whole-sequence prefills (the causal path) and chunks after cached context (the masked path): the
    pure reference and the "torch" backend (native decode rows)."""
    rng = random.Random(seed)
    block_size, num_kv_heads, group, head_dim = rng.choice([4, 16]), rng.choice([1, 3]), rng.choice([1, 3]), 64
    q_lens = [rng.choice([1, 1, 2, 7, 20]) for _ in range(rng.randint(1, 6))]
    contexts = [n + rng.choice([0, 0, 1, block_size, 9]) for n in q_lens]
    _, k_cache, v_cache, tables, lens = paged_batch(rng, contexts, num_kv_heads * group, num_kv_heads, head_dim,
                                                    block_size, torch.float32, pad=rng.choice([-1, 0]))
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if native:
        out = attention.paged_attention("torch", q, k_cache, v_cache, tables, lens, cu, max(q_lens), 0.125)
    else:
        out = paged_attention_ref(q, k_cache, v_cache, tables, lens, cu, 0.125)
    assert torch.isfinite(out).all()
    err = (out.double() - dense_reference(q, k_cache, v_cache, tables, lens, cu, 0.125)).abs().max().item()
    assert err <= 1e-5, f"max abs err {err}"


def test_rejects_bad_input(op):
    rng = random.Random(5)
    q, k_cache, v_cache, tables, lens = paged_batch(rng, [5, 20], 4, 2, 32, 16, torch.float32)
    with pytest.raises(RuntimeError, match="context_lens"):
        op(q, k_cache, v_cache, tables, torch.tensor([5, tables.shape[1] * 16 + 1], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="context_lens"):
        op(q, k_cache, v_cache, tables, torch.tensor([-1, 20], dtype=torch.int32), 1.0)
    bad = tables.clone()
    bad[1, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, k_cache, v_cache, bad, lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        op(q[..., :12].contiguous(), k_cache[..., :12].contiguous(), v_cache[..., :12].contiguous(), tables, lens, 1.0)


def test_failed_build_falls_back_and_is_logged(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_ops, "_enabled", True)      # an engine earlier in this process may have switched it off
    monkeypatch.setattr(cpu_ops, "_cache_dir", tmp_path)
    with pytest.raises(RuntimeError, match="compile failed"):
        cpu_ops._build("false")             # a "compiler" that always fails
    assert list(tmp_path.glob("*.failed")) and not list(tmp_path.glob("*.so"))
    with pytest.raises(RuntimeError, match="compile failed"):
        cpu_ops._build("false")             # remembered: no second attempt
    monkeypatch.setattr(cpu_ops, "_tried", False)
    monkeypatch.setattr(cpu_ops, "_op", None)
    monkeypatch.setattr(cpu_ops, "_why_not", None)
    monkeypatch.setattr(cpu_ops, "_loaded", lambda: False)
    monkeypatch.setattr(cpu_ops, "compiler", lambda: "false")
    with caplog.at_level(logging.WARNING, logger="tidepool.kernels.cpu_ops"):
        assert cpu_ops.paged_decode_op() is None
    assert "using the torch path" in caplog.text and "compile failed" in cpu_ops.unavailable_reason()
    rng = random.Random(1)
    q, k_cache, v_cache, tables, lens = paged_batch(rng, [1, 17], 6, 3, 64, 16, torch.float32)
    cu = torch.arange(3, dtype=torch.int32)
    out = attention.paged_attention("torch", q, k_cache, v_cache, tables, lens, cu, 1, 0.125)    # the reference
    assert torch.equal(out, paged_decode_ref(q, k_cache, v_cache, tables, lens, 0.125))


def test_build_is_keyed_by_every_source_and_header(monkeypatch, tmp_path):
    """The cached library is named by a hash of every .cpp and .h in csrc/: editing the header the kernels share
    (simd.h) builds anew, as editing a source does, and an unchanged tree finds what it built."""
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_ops.CSRC, csrc)
    assert {"paged_decode_cpu.cpp", "fused_cpu.cpp", "simd.h"} <= {p.name for p in csrc.iterdir()}
    cxx = tmp_path / "cxx"      # "compiles" by writing an empty file where -o says, and counts its builds
    cxx.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\necho >> "$0.builds"\n'
                   'while [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    cxx.chmod(0o755)
    monkeypatch.setattr(cpu_ops, "CSRC", csrc)
    monkeypatch.setattr(cpu_ops, "_cache_dir", tmp_path / "cache")
    first = cpu_ops._build(str(cxx))
    assert cpu_ops._build(str(cxx)) == first
    with open(csrc / "simd.h", "a") as f:
        f.write("// edited\n")
    after_header = cpu_ops._build(str(cxx))
    with open(csrc / "fused_cpu.cpp", "a") as f:
        f.write("// edited\n")
    after_source = cpu_ops._build(str(cxx))
    (csrc / "notes.txt").write_text("not built from")
    assert cpu_ops._build(str(cxx)) == after_source
    built = (first, after_header, after_source)
    assert len(set(built)) == 3 and all(p.is_file() for p in built)
    assert (tmp_path / "cxx.builds").read_text().count("\n") == 3


def test_a_background_build_ends_with_its_process(tmp_path):
    """A process that exits while its background build runs (a short run-batch, a script) takes its compiler with
    it: no compiler left running for nobody, no partial library in the cache."""
    cxx = tmp_path / "cxx"
    cxx.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\necho $$ > "$0.pid"\nexec sleep 60\n')
    cxx.chmod(0o755)
    cache = tmp_path / "cache"
    script = ("import os, sys, time\nfrom tidepool.kernels import cpu_ops\n"
              f"cpu_ops.configure(enabled=True, cache_dir={str(cache)!r})\n"
              "assert cpu_ops.prepare(background=True) == 'building'\n"
              "while not cpu_ops._compiling: time.sleep(0.05)\n"
              f"while not os.path.exists({str(tmp_path / 'cxx.pid')!r}): time.sleep(0.05)\n")   # the compiler runs
    env = {**os.environ, "CXX": str(cxx), "PYTHONPATH": str(Path(cpu_ops.__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    pid = int((tmp_path / "cxx.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not list(cache.glob(".*.tmp")) and not list(cache.glob("*.so"))


def test_processes_building_at_once_compile_once(tmp_path):
    """Workers starting together on one host: one compiles the library, the others wait and load its file."""
    cxx = tmp_path / "cxx"
    cxx.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\necho x >> "$0.calls"\nsleep 1\n'
                   'while [ "$1" != -o ]; do shift; done\necho built > "$2"\n')
    cxx.chmod(0o755)
    script = ("from tidepool.kernels import cpu_ops\n"
              f"cpu_ops.configure(enabled=True, cache_dir={str(tmp_path / 'cache')!r})\n"
              f"print(cpu_ops._build({str(cxx)!r}))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(cpu_ops.__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1 and Path(paths.pop()).read_text() == "built\n"
    assert (tmp_path / "cxx.calls").read_text() == "x\n"
