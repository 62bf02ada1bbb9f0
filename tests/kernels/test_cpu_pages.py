"""kernels/cpu_pages.py: the KV pool's tensors on 2 MiB-aligned memory advised onto huge pages behave as torch.empty
ones (shape, dtype, contiguity, every element writable and read back), and the native decode kernel reads them."""
import sys

import pytest
import torch

from tidepool.kernels.cpu_pages import HUGE_PAGE, empty_on_huge_pages, huge_page_bytes
from tidepool.kernels.paged_attention import paged_decode_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_big_tensor_starts_on_a_huge_page_and_holds_what_is_written(dtype):
    shape = (600, 16, 3, 64)        # 7.0 MiB in fp32, 3.5 in bf16: not a whole number of huge pages
    t = empty_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % HUGE_PAGE == 0
    want = torch.arange(t.numel(), dtype=torch.float32).remainder(251).to(dtype).view(shape)
    t.copy_(want)
    assert torch.equal(t, want)
    assert torch.equal(t.view(-1, 3, 64)[-1], want.view(-1, 3, 64)[-1])     # the tail past the last whole page


def test_a_small_tensor_is_plain():
    t = empty_on_huge_pages((4, 8), torch.float32)
    assert t.shape == (4, 8) and t.storage_offset() == 0


def test_huge_page_bytes_reads_the_process_counter():
    got = huge_page_bytes()
    assert got is None or got >= 0
    if sys.platform.startswith("linux"):
        assert got is not None


def test_the_decode_kernel_reads_a_pool_on_huge_pages():
    gen = torch.Generator().manual_seed(0)
    k = empty_on_huge_pages((512, 16, 3, 64), torch.float32).copy_(torch.randn(512, 16, 3, 64, generator=gen))
    v = empty_on_huge_pages((512, 16, 3, 64), torch.float32).copy_(torch.randn(512, 16, 3, 64, generator=gen))
    tables = torch.randperm(512, generator=gen).to(torch.int32).view(8, 64)
    lens = torch.tensor([1, 15, 16, 33, 200, 511, 1000, 1024], dtype=torch.int32)
    q = torch.randn(8, 9, 64, generator=gen)
    from tidepool.kernels.attention import cpu_decode
    out = cpu_decode(q, k, v, tables, lens, 0.125)
    assert (out - paged_decode_ref(q, k, v, tables, lens, 0.125)).abs().max().item() <= 1e-5
