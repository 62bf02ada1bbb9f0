"""The native greedy argmax (kernels/csrc/fused_cpu.cpp argmax_rows via kernels.layer_ops.argmax_rows) against
torch.argmax(dim=-1): equal to the index, ties, NaN, infinities, row counts and lengths; and the sampler with it."""
import pytest
import torch

from tidepool.kernels import cpu_ops
from tidepool.kernels.layer_ops import _argmax_cases, argmax_rows, argmax_rows_ref
from tidepool.workers.engine.sampler import Sampler
from tidepool.workers.engine.sampling_params import SamplingParams
from tidepool.workers.engine.sequence import Sequence

pytestmark = pytest.mark.skipif(cpu_ops.compiler() is None, reason="no C++ compiler")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def native_kernels_switched_on(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_enabled", True)
    assert cpu_ops.paged_decode_op() is not None, cpu_ops.unavailable_reason()


def native(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tidepool_cpu.argmax_rows(x)


def same(x: torch.Tensor) -> bool:
    got = native(x)
    assert got.dtype == torch.int64 and got.shape == x.shape[:1]
    return torch.equal(got, argmax_rows_ref(x)) and torch.equal(argmax_rows(x), argmax_rows_ref(x))


SHAPES = [(rows, vocab) for rows in (1, 2, 3, 7, 8, 9, 64, 257)
          for vocab in (1, 15, 63, 64, 65, 1000, 8191, 8192, 49152, 50257)
          if rows * vocab <= 3_000_000]          # the widest vocabularies with up to 9 and 64 rows: large enough


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_random_rows_equal_torch(dtype, rows, vocab):
    gen = torch.Generator().manual_seed(rows * 100003 + vocab)
    x = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)    # bf16/fp16: many ties among equal values
    assert same(x)
    assert same(torch.randint(-3, 4, (rows, vocab), generator=gen).to(dtype))   # ties everywhere


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [13, 64, 200, 49152])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_ties_nan_and_infinities(dtype, vocab, rows):
    gen = torch.Generator().manual_seed(vocab + rows)
    base = torch.randn(rows, vocab, generator=gen).to(dtype)
    for case in range(8):
        x = base.clone()
        for r in range(rows):
            a, b = sorted(torch.randint(0, vocab, (2,), generator=gen).tolist())
            if case == 0:
                x[r, [a, b]] = 100.0                 # a tie: the first index wins
            elif case == 1:
                x[r, [a, b]] = NAN                   # the first NaN wins over everything
                x[r, 0] = INF
            elif case == 2:
                x[r] = -INF                          # all -inf: index 0
            elif case == 3:
                x[r] = -INF
                x[r, b] = NAN                        # NaN among -inf
            elif case == 4:
                x[r] = -INF
                x[r, b] = -1e4 if dtype != torch.float16 else -6e4
            elif case == 5:
                x[r, [a, b, vocab - 1]] = INF        # +inf ties
            elif case == 6:
                x[r] = 0.0
                x[r, a] = -0.0                       # -0 == +0: index 0
            else:
                x[r, vocab - 1] = NAN                # in the last element (the scalar tail for most widths)
        assert same(x), case


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_self_check_cases(dtype):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 3 * 5000, generator=gen).to(dtype)
    assert same(wide[:, 5000:10000]) and same(wide[:, 7:5007]) and same(wide[::2, :4097])
    for x in _argmax_cases(dtype, gen):
        assert same(x)


def test_every_thread_count_and_split(monkeypatch):
    """Row splitting across threads for few rows, a row per thread for many: same answers for any thread count."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 49152, generator=gen).bfloat16()
    x[:, 40000] = 20.0
    x[:, 45000] = 20.0                            # tie in a later stretch
    x[2, 30000] = NAN
    x[3, 49000] = NAN
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 4, 9):
                assert same(x[:rows]) and same(x[rows - 1:rows])
    finally:
        torch.set_num_threads(before)


def test_empty_and_fallbacks(monkeypatch):
    assert native(torch.empty(0, 100)).shape == (0,)
    x = torch.randn(3, 50, dtype=torch.float64)
    assert torch.equal(argmax_rows(x), x.argmax(-1))                 # dtype the op does not take
    y = torch.randn(50, 3)
    assert torch.equal(argmax_rows(y.t()), y.t().argmax(-1))         # columns not contiguous
    monkeypatch.setattr(cpu_ops, "_enabled", False)
    z = torch.randn(4, 1000)
    assert torch.equal(argmax_rows(z), z.argmax(-1))


def seqs_for(params: list[SamplingParams]) -> list[Sequence]:
    return [Sequence(f"r{i}", [1 + i, 2, 3, 4, 5], p) for i, p in enumerate(params)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_output_unchanged(monkeypatch, dtype):
    """The sampler with the native argmax and with torch's: same tokens, all-greedy and mixed batches."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(12, 3000, generator=gen) * 3).to(dtype)
    logits[3, [10, 20]] = 50.0                                 # a tie
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    batches = [[greedy] * 12,
               [greedy] * 6 + [SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3)] * 3
               + [SamplingParams(max_tokens=4, temperature=0.8, seed=9)] * 3]
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(cpu_ops, "_enabled", enabled)
        results.append([Sampler(torch.device("cpu"))(logits, seqs_for(b))[0] for b in batches])
    assert results[0] == results[1]
    assert results[0][0] == logits.argmax(-1).tolist()
