"""Triton kernels that add weight gradients straight onto the fp32 window buffer.

- ``wgrad_accumulate(acc, x2, dy2, scale)``: ``acc += scale * dy2ᵀ @ x2``, one GEMM whose fp32
  accumulators never leave registers until the epilogue reads ``acc``, adds, and writes it back.
  Nothing weight-sized is made. ``x2`` is ``(K, N)``, ``dy2`` ``(K, M)``, ``acc`` ``(M, N)``, any
  strides: K runs over tokens, so ``dy2ᵀ`` is read column-major without a copy.
- ``embedding_accumulate(acc, ids, dy2, scale, padding_idx)``: ``acc[ids[t]] += scale * dy2[t]``.
  Ids are sorted (stably, so repeats keep token order) and one program per (run of equal ids,
  column block) adds the run's rows in token order: deterministic, no atomics, and the same
  order of additions as the C++ CPU kernel.

Launchers take arguments already validated by ``gradaccel.ops`` (gradaccel/ops/wgrad.py).
"""

import torch
import triton
import triton.language as tl


def wgrad_config(m: int, n: int, dtype: torch.dtype, interpret: bool) -> dict:
    """Tile sizes for the wgrad GEMM: one place that chooses them (tl.dot wants every dim >= 16).

    On a GPU, 128x128 output tiles with 64-deep K steps, 8 warps and 3 pipeline stages for
    bf16/fp16 (96 KiB of shared memory: fits A100 and H100); fp32 (exact, ``ieee``) tiles are
    smaller because they take twice the bytes. Small weights (LoRA's rank-r factors) shrink the
    tile to the weight. In the interpreter (tests on CPU) small tiles keep it quick.
    """
    if interpret:
        bm = min(32, max(16, triton.next_power_of_2(m)))
        bn = min(32, max(16, triton.next_power_of_2(n)))
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)
    wide = dtype != torch.float32
    top, depth = (128, 64) if wide else (64, 32)
    bm = min(top, max(16, triton.next_power_of_2(m)))
    bn = min(top, max(16, triton.next_power_of_2(n)))
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=depth, GROUP_M=8,
                num_warps=8 if bm * bn >= 128 * 128 else 4, num_stages=3)


@triton.jit
def _wgrad_accumulate_kernel(acc_ptr, x_ptr, dy_ptr, M, N, K, scale,
                             acc_sm, acc_sn, x_sk, x_sn, dy_sk, dy_sm,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                             WIDEN: tl.constexpr):
    # Grouped order: GROUP_M row tiles share their column tiles of x while they sit in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edge wrap onto valid ones, so the loads need no M/N mask;
    # the epilogue's store is masked instead. int64: K*M passes 2**31 at 16K tokens x 128K vocab.
    lm = (rm % M).to(tl.int64)
    ln = (rn % N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = dy_ptr + rk[None, :] * dy_sk + lm[:, None] * dy_sm   # dyᵀ tile: (BLOCK_M, BLOCK_K)
    b_ptrs = x_ptr + rk[:, None] * x_sk + ln[None, :] * x_sn      # x tile:   (BLOCK_K, BLOCK_N)
    c = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < left, other=0.0)
        if WIDEN:  # the interpreter's dot misreads bf16 (raw bits): widen, exactly, first
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:  # fp32 inputs: exact fp32 products, never TF32
            c = tl.dot(a, b, c, input_precision="ieee")
        else:     # bf16/fp16 inputs: products exact in fp32, fp32 accumulators
            c = tl.dot(a, b, c)
        a_ptrs += BLOCK_K * dy_sk
        b_ptrs += BLOCK_K * x_sk
    # Epilogue: the window's running sum is read, added to and written back, once per element.
    om = rm.to(tl.int64)
    on = rn.to(tl.int64)
    out = acc_ptr + om[:, None] * acc_sm + on[None, :] * acc_sn
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    prev = tl.load(out, mask=mask, other=0.0)
    tl.store(out, prev + c * scale, mask=mask)


def wgrad_accumulate(acc: torch.Tensor, x2: torch.Tensor, dy2: torch.Tensor, scale: float) -> None:
    """``acc += scale * dy2ᵀ @ x2`` in one kernel, fp32 accumulation.

    Args:
        acc: fp32 ``(M, N)``, any strides, not overlapping ``x2``/``dy2``.
        x2: ``(K, N)``; dy2: ``(K, M)``; both fp32, bf16 or fp16 (the same), any strides.
        scale: multiplier applied to the product in fp32 before the add.
    """
    m, n = acc.shape
    k = x2.shape[0]
    if m == 0 or n == 0 or k == 0:
        return
    interpret = acc.device.type == "cpu"
    cfg = wgrad_config(m, n, x2.dtype, interpret)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _wgrad_accumulate_kernel[grid](
        acc, x2, dy2, m, n, k, scale,
        acc.stride(0), acc.stride(1), x2.stride(0), x2.stride(1), dy2.stride(0), dy2.stride(1),
        EVEN_K=k % cfg["BLOCK_K"] == 0, IEEE=x2.dtype == torch.float32 or (interpret and x2.dtype == torch.bfloat16),
        WIDEN=interpret and x2.dtype == torch.bfloat16, **cfg)


@triton.jit
def _embedding_accumulate_kernel(acc_ptr, dy_ptr, sorted_ptr, order_ptr, end_ptr, D, scale, padding_idx,
                                 acc_s0, acc_s1, dy_s0, dy_s1, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    row = tl.load(sorted_ptr + i)
    prev = tl.load(sorted_ptr + tl.maximum(i - 1, 0))
    # Only the first position of a run of equal ids does the work for the whole run.
    if ((i == 0) | (prev != row)) & (row != padding_idx):
        end = tl.load(end_ptr + i)
        out = acc_ptr + row * acc_s0 + cols.to(tl.int64) * acc_s1
        a = tl.load(out, mask=mask, other=0.0)
        for j in range(i, end):
            t = tl.load(order_ptr + j)
            g = tl.load(dy_ptr + t * dy_s0 + cols.to(tl.int64) * dy_s1, mask=mask, other=0.0)
            a += g.to(tl.float32) * scale
        tl.store(out, a, mask=mask)


def embedding_accumulate(acc: torch.Tensor, ids: torch.Tensor, dy2: torch.Tensor, scale: float,
                         padding_idx: int) -> None:
    """``acc[ids[t]] += scale * dy2[t]`` for every token ``t``, repeats summed in token order.

    Args:
        acc: fp32 ``(V, D)``; ids: 1-D int64 ``(T,)``, every id in ``[0, V)`` (the embedding's
            forward has checked them); dy2: ``(T, D)`` fp32/bf16/fp16, any strides.
        padding_idx: rows with this id are skipped (-1: none), as ``nn.Embedding`` does.
    """
    t, d = dy2.shape
    if t == 0 or d == 0:
        return
    # Token-sized helpers: the stable sort keeps repeats in token order; end[i] is where the
    # run of sorted[i] ends, found without a host sync.
    sorted_ids, order = torch.sort(ids, stable=True)
    end = torch.searchsorted(sorted_ids, sorted_ids, right=True)
    block = min(1024 if acc.device.type != "cpu" else 128, max(16, triton.next_power_of_2(d)))
    _embedding_accumulate_kernel[(t, triton.cdiv(d, block))](
        acc, dy2, sorted_ids, order, end, d, scale, padding_idx,
        acc.stride(0), acc.stride(1), dy2.stride(0), dy2.stride(1),
        BLOCK_D=block, num_warps=4)
