"""The decoy maps on the GPU: the csrc CT kernels' (csrc/ct_walk.cuh, through the
test probe csrc/ct_walk_probe.cu; the default build's 12-round shuffle and the
DHP_CT_DECOY_ROUNDS builds) and the Triton kernels' (kernels.decoy_block, compiled, not
interpreted) give their host copies' pages (launch.triton_decoy_page,
launch.swap_or_not) for every (request, logical block), in roomy, full, wrapping
and large caches.

Nothing in an output shows which decoy page a kernel read (its scores are masked
and its V rows zeroed), so this is where the three copies are compared. Run:
``pytest -m gpu tests/test_ct_walk_gpu.py``.
"""

import ctypes

import pytest
import torch

from dhp_backend.ops.cuda_build import DECOY_ROUNDS_ENV, find_nvcc, load
from dhp_backend.ops.triton.launch import DECOY_ROUNDS, decoy_magic, decoy_mult, swap_or_not, triton_decoy_page

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

# (num_reqs, table width, num_blocks): roomy, the audit's B16/B64 at L4096, wrapping, 1 block, large
CASES = [(3, 16, 200), (16, 256, 16 * 256 + 16), (64, 256, 64 * 256 + 16), (31, 64, 1000), (2, 8, 1),
         (5, 128, 60_013), (7, 64, 2**20 + 7)]


def host_pages(num_reqs, width, num_blocks, page=triton_decoy_page):
    return [page(r, lb, num_reqs, num_blocks) for r in range(num_reqs + 1) for lb in range(width)]


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc to build csrc/")
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="csrc is built for sm_90a")
@pytest.mark.parametrize("rounds", [None, 0, 5])
@pytest.mark.parametrize("num_reqs,width,num_blocks", CASES)
def test_csrc_decoy_pages_equal_the_host_map(num_reqs, width, num_blocks, rounds, monkeypatch):
    # None: the default build (DECOY_ROUNDS shuffle rounds); 0: DHP_CT_DECOY_ROUNDS=0 (the
    # Triton map as it is); 5: another count, so the hook is seen to reach the build
    if rounds is None:
        monkeypatch.delenv(DECOY_ROUNDS_ENV, raising=False)
    else:
        monkeypatch.setenv(DECOY_ROUNDS_ENV, str(rounds))
    rounds = DECOY_ROUNDS if rounds is None else rounds
    fn = load("dhp_ct_walk_probe", "ct_walk_probe.cu").dhp_ct_decoy_pages
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32,
                   ctypes.c_void_p]
    out = torch.full(((num_reqs + 1) * width,), -1, dtype=torch.int32, device="cuda")
    rc = fn(out.data_ptr(), num_reqs, width, num_blocks, decoy_magic(num_blocks), decoy_mult(num_blocks),
            torch.cuda.current_stream().cuda_stream)
    assert rc == 0
    torch.cuda.synchronize()
    tri = host_pages(num_reqs, width, num_blocks, triton_decoy_page)
    if rounds == 0:
        assert out.tolist() == tri
    else:
        assert out.tolist() == [swap_or_not(x, num_blocks, rounds) for x in tri]
        if num_blocks > 16:
            assert out.tolist() != tri  # the shuffle ran


@pytest.mark.parametrize("num_reqs,width,num_blocks", CASES)
def test_triton_decoy_pages_equal_the_host_map(num_reqs, width, num_blocks):
    import triton
    import triton.language as tl

    from dhp_backend.ops.triton.kernels import decoy_block

    # as attention_kernel: no integer argument specialised (a cache of 1 block has decoy_mult 1)
    @triton.jit(do_not_specialize=["num_reqs", "num_blocks", "magic", "mult"])
    def table(out_ptr, num_reqs, num_blocks, magic, mult, W: tl.constexpr):
        r = tl.program_id(0)
        lb = tl.arange(0, W)
        tl.store(out_ptr + r * W + lb, decoy_block(r, lb, num_reqs, num_blocks, magic, mult))

    out = torch.full(((num_reqs + 1) * width,), -1, dtype=torch.int32, device="cuda")
    table[(num_reqs + 1,)](out, num_reqs, num_blocks, decoy_magic(num_blocks), decoy_mult(num_blocks), W=width)
    torch.cuda.synchronize()
    assert out.tolist() == host_pages(num_reqs, width, num_blocks, triton_decoy_page)
