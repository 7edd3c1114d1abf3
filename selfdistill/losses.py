"""Per-token losses for on-policy self-distillation: pure functions of tensors.

Papers:
- SDPO, "Reinforcement Learning via Self-Distillation" (arXiv 2601.20802): the teacher is the
  same model re-reading its answer with rich feedback in context; the student is pulled toward the
  teacher's next-token distribution on the student's own tokens.
- SDFT, "Self-Distillation Enables Continual Learning" (arXiv 2601.19897): the privileged context
  is a demonstration.

Notation, per token position (one row of the vocabulary): student logits ``s``, teacher logits
``t``, ``p_S = softmax(s)``, ``p_T = softmax(t)``. The divergence family is indexed by ``alpha``:

- ``alpha = 0``: forward KL(teacher‖student)  = Σ_v p_T (log p_T − log p_S)   (mode covering)
- ``alpha = 1``: reverse KL(student‖teacher)  = Σ_v p_S (log p_S − log p_T)   (mode seeking)
- ``0 < alpha < 1``: generalized Jensen–Shannon with mixture ``M = (1−alpha)·p_S + alpha·p_T``:
  ``JSD_alpha = (1−alpha)·KL(p_S‖M) + alpha·KL(p_T‖M)``.

With this mixture convention JSD_alpha tends to 0 at both ends (M collapses onto one of the two
distributions), so alpha = 0 and alpha = 1 are special-cased to the two KLs above, as TRL's GKD
trainer does. Beware ``F.kl_div(input=log p_S, target=log p_T, log_target=True)``: it computes
KL(target‖input), i.e. the *forward* KL (alpha = 0), not KL(input‖target).

Estimators: ``full`` (the whole vocabulary), ``topk`` (k indices with the largest *student* logits
plus, optionally, one tail bucket holding the remaining probability mass of each distribution) and
``sampled`` (the sampled token only: REINFORCE with per-token advantage log p_T − log p_S, the "RL
view" of self-distillation, valid for the reverse KL only; see ``sampled_token_objective``).

Departures from the papers: the chunked path (``chunk_size``) is an implementation detail that
recomputes the divergence in backward with a closed-form gradient (see ``_ChunkedDivergence``);
values and gradients equal the plain autograd path up to float32 rounding. GRPO pieces
(``group_advantages``, ``policy_gradient_objective``) follow DeepSeekMath's GRPO with PPO clipping.

Every function returns per-token values of shape (B, T); the trainer reduces with ``masked_mean``.
Teacher inputs never receive gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# The top-k tail sum can be exactly 0 (k = V) or underflow; it is clamped here before the log so
# every log stays finite (0·(log 0 − log 0) would be NaN) and log's backward never divides by 0.
_TINY = torch.finfo(torch.float32).tiny


# ----------------------------------------------------------------------------------------------
# Buckets: the distributions the divergence is taken over
# ----------------------------------------------------------------------------------------------


def _topk_tail(
    x_N_V: Tensor, idx_N_K: Tensor, *, idx_has_max: bool, work: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Full-softmax log-probs at ``idx`` plus the tail log-mass, for one distribution.

    With m = max_row x, e = exp(x − m) (N, V), r = Σ_{v ∉ idx} e (summed directly over the rest,
    so a tiny tail keeps its relative precision; no 1 − Σ top-k cancellation) and
    z = r + Σ_{v ∈ idx} e: log p[idx] = x[idx] − m − log z, tail = log(max(r, tiny)) − log z.
    A tail below float32's ``tiny`` (student logit gap > ~87 nats) counts as ``tiny`` and gets no
    gradient. ``idx_has_max``: the row max is among x[idx] (true for the student, whose top-k
    these are), so m comes from the (N, K) gather instead of another pass over V.
    ``work``: optional (N, V) float32 scratch for e (outside autograd), so a chunk loop does not
    allocate (and page-fault) a fresh (N, V) temporary per chunk.

    Returns: bucket log-probs (N, K+1), m, z, r (each (N, 1)).
    """
    x_top = x_N_V.gather(-1, idx_N_K)
    m = (x_top if idx_has_max else x_N_V).detach().amax(dim=-1, keepdim=True)
    e = torch.sub(x_N_V, m, out=work).exp_()
    # Under autograd exp's backward needs e unmodified; otherwise zero the top-k in place.
    rest = e.scatter(-1, idx_N_K, 0.0) if e.requires_grad else e.scatter_(-1, idx_N_K, 0.0)
    r = rest.sum(dim=-1, keepdim=True)
    top = x_top - m
    z = r + top.exp().sum(dim=-1, keepdim=True)
    log_z = z.log()
    log_p = torch.cat([top - log_z, r.clamp_min(_TINY).log() - log_z], dim=-1)
    return log_p, m, z, r


def _bucket_logprobs(
    s_N_V: Tensor, t_N_V: Tensor, idx_N_K: Tensor | None, add_tail: bool, work: Tensor | None = None
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """Log-probabilities of the buckets the divergence sums over, for student and teacher.

    - ``idx_N_K is None``: full vocabulary, log_softmax of each, shape (N, V).
    - with tail: ``log p[idx]`` (true full-softmax values) and the tail log-mass, shape (N, K+1)
      (``_topk_tail``); also returns the student's (m, z, r), which the closed-form gradient uses.
    - without tail: log-softmax over the K gathered logits (renormalized), shape (N, K).

    Inputs are float32; ``t_N_V`` must not require grad. ``work``: scratch for ``_topk_tail``.
    """
    if idx_N_K is None:
        return F.log_softmax(s_N_V, dim=-1), F.log_softmax(t_N_V, dim=-1), None
    if not add_tail:
        log_p = F.log_softmax(s_N_V.gather(-1, idx_N_K), dim=-1)
        return log_p, F.log_softmax(t_N_V.gather(-1, idx_N_K), dim=-1), None
    log_p, m, z, r = _topk_tail(s_N_V, idx_N_K, idx_has_max=True, work=work)
    log_q = _topk_tail(t_N_V, idx_N_K, idx_has_max=False, work=work)[0]
    return log_p, log_q, (m, z, r)


def _log_mixture(log_p: Tensor, log_q: Tensor, alpha: float) -> Tensor:
    """log M with M = (1−alpha)·p + alpha·q, computed in log space (0 < alpha < 1)."""
    return torch.logaddexp(log_p + math.log1p(-alpha), log_q + math.log(alpha))


def _divergence(log_p: Tensor, log_q: Tensor, alpha: float) -> Tensor:
    """Divergence over the last dim between bucket log-probs ``log_p`` (student) and ``log_q``.

    (N, K) → (N,). alpha=0: Σ q(log q − log p); alpha=1: Σ p(log p − log q); otherwise
    (1−alpha)·Σ p(log p − log M) + alpha·Σ q(log q − log M).
    """
    if alpha == 0.0:
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if alpha == 1.0:
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    log_m = _log_mixture(log_p, log_q, alpha)
    kl_pm = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
    return (1.0 - alpha) * kl_pm + alpha * kl_qm


def _divergence_grad(log_p: Tensor, log_q: Tensor, alpha: float) -> Tensor:
    """G = ∂D/∂(log p) for ``_divergence``, treating each bucket log-prob as a free variable.

    alpha=0: G = −q.  alpha=1: G = p(log p − log q + 1).
    0<alpha<1: G = (1−alpha)·p·(log p − log M)  (the ∂log M terms cancel because
    (1−alpha)p + alpha·q = M). The "+1" of alpha=1 is kept literally (it cancels through the
    softmax only when Σp = 1 exactly) so the result matches autograd of ``_divergence``.
    """
    if alpha == 0.0:
        return -log_q.exp()
    if alpha == 1.0:
        return log_p.exp() * (log_p - log_q + 1.0)
    return (1.0 - alpha) * log_p.exp() * (log_p - _log_mixture(log_p, log_q, alpha))


def _full_student_grad(
    s_n_V: Tensor, t_n_V: Tensor, alpha: float, scale_n_1: Tensor, out: Tensor | None
) -> Tensor:
    """Closed-form scale·∂D/∂s over the full vocabulary, (n, V), recomputed from the logits.

    With G = scale·∂D/∂log p (``_divergence_grad``; D is linear in G, so the per-row upstream
    gradient ``scale`` folds in here) and p = softmax(s): ∂D/∂s_j = G_j − p_j·Σ_v G_v.
    Written into ``out`` when given (a float32 view of the final gradient).
    """
    log_p, log_q = F.log_softmax(s_n_V, dim=-1), F.log_softmax(t_n_V, dim=-1)
    g = _divergence_grad(log_p, log_q, alpha).mul_(scale_n_1)
    return torch.addcmul(g, log_p.exp_(), g.sum(-1, keepdim=True), value=-1.0, out=out)


def _topk_student_grad(
    s_n_V: Tensor,
    idx_n_K: Tensor,
    log_p: Tensor,
    g: Tensor,
    m_z_r: tuple[Tensor, ...] | None,
    out: Tensor | None,
) -> Tensor:
    """Closed-form ∂D/∂s for top-k buckets, (n, V), from the bucket statistics saved in forward.

    ``log_p`` are the student's bucket log-probs, ``g`` = ∂D/∂log P over the buckets b (already
    multiplied by the upstream gradient). Written into ``out`` when given.
    - with tail (``m_z_r`` from ``_topk_tail``): ∂D/∂s_j = G_{b(j)}·p_j/P_{b(j)} − p_j·Σ_b G_b,
      b(j) = j's own bucket in the top-k (p_j/P_b = 1), else the tail. With e = exp(s − m),
      p_j = e_j/z and P_tail = r/z, so outside the top-k: e_j·(G_tail/r − Σ_b G_b/z). Every one of
      the V logits gets gradient through the normalizer. Where r < tiny (clamped in forward),
      G_tail is zeroed, as clamp's autograd does.
    - without tail (``m_z_r`` None): P = softmax(s[idx]); ∂D/∂s_idx = G − P·Σ_b G_b, others 0.
    """
    g_sum = g.sum(-1, keepdim=True)  # (n, 1)
    if m_z_r is None:
        grad = torch.zeros_like(s_n_V) if out is None else out.zero_()
        return grad.scatter_(-1, idx_n_K, g - log_p.exp() * g_sum)
    m, z, r = m_z_r
    coef = torch.where(r >= _TINY, g[:, -1:] / r.clamp_min(_TINY), 0.0) - g_sum / z
    g_top = g[:, :-1] - log_p[:, :-1].exp() * g_sum
    e = torch.sub(s_n_V, m, out=out).exp_()
    return e.mul_(coef).scatter_(-1, idx_n_K, g_top)


# ----------------------------------------------------------------------------------------------
# Chunked path: O(chunk × V) extra memory in forward and backward
# ----------------------------------------------------------------------------------------------


class _ChunkedDivergence(torch.autograd.Function):
    """Divergence over row chunks with a closed-form gradient recomputed in backward.

    Forward computes each chunk's values under no_grad. It keeps the (already alive) inputs and,
    for top-k, per-row bucket statistics only: indices (N, K) int64, bucket log-probs of student
    and teacher (N, K+1) and the student's row max and sums m, z, r (N, 1) — no (N, V)
    intermediate is kept. Backward walks the chunks again: full vocabulary recomputes both
    log-softmaxes (``_full_student_grad``); top-k recomputes only exp(s − m)
    (``_topk_student_grad``). Each chunk's ``grad_out[:, None] · ∂D/∂s`` is written straight
    into the (N, V) gradient when the student is float32 (via a float32 temporary otherwise).
    Peak extra memory: that gradient plus a few (chunk, V) float32 temporaries.

    ``overwrite``: the gradient goes into the student logits' own storage instead (row chunk i
    of the logits is read before chunk i of the gradient is written, and no chunk reads another
    chunk's rows), so no (N, V) gradient is allocated: peak extra memory is the temporaries and
    the per-row statistics. The write bumps the logits' version counter, so a later backward
    that saved the same logits fails with autograd's "modified by an inplace operation" error
    instead of using the overwritten values.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        student_N_V: Tensor,
        teacher_N_V: Tensor,
        alpha: float,
        topk: int | None,
        add_tail: bool,
        chunk_size: int,
        overwrite: bool = False,
    ) -> Tensor:
        n_rows, device = student_N_V.shape[0], student_N_V.device
        out_N = torch.empty(n_rows, dtype=torch.float32, device=device)
        # Per-row top-k statistics for backward: idx, log_p, log_q[, m, z, r]. Preallocated,
        # because small tensors kept alive between the chunks' large temporaries fragment the CPU
        # heap (measured: +0.8 GB resident after a 2048-row forward at V = 49152 without this).
        saved: list[Tensor] = []
        if topk is not None:
            n_buckets = topk + 1 if add_tail else topk
            shapes = [(topk, torch.int64), (n_buckets, torch.float32), (n_buckets, torch.float32)]
            shapes += [(1, torch.float32)] * (3 if add_tail else 0)
            saved = [torch.empty(n_rows, w, dtype=dt, device=device) for w, dt in shapes]
        work = None
        if topk is not None and add_tail:
            work = torch.empty(min(chunk_size, n_rows), student_N_V.shape[1], device=device)
        for lo in range(0, n_rows, chunk_size):
            rows = slice(lo, lo + chunk_size)
            s, t = student_N_V[rows].float(), teacher_N_V[rows].float()
            idx = None if topk is None else s.topk(topk, dim=-1, sorted=False).indices
            w = None if work is None else work[: s.shape[0]]
            log_p, log_q, aux = _bucket_logprobs(s, t, idx, add_tail, w)
            out_N[rows] = _divergence(log_p, log_q, alpha)
            if idx is not None:
                for buf, value in zip(saved, (idx, log_p, log_q, *(aux or ())), strict=True):
                    buf[rows] = value
        ctx.save_for_backward(student_N_V, teacher_N_V, *saved)
        ctx.alpha, ctx.chunk_size, ctx.overwrite = alpha, chunk_size, overwrite
        return out_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out_N: Tensor):  # type: ignore[override]
        student_N_V, teacher_N_V, *saved = ctx.saved_tensors
        # detach: the same storage and version counter, without the input's autograd history
        grad_N_V = student_N_V.detach() if ctx.overwrite else torch.empty_like(student_N_V)
        direct = grad_N_V.dtype == torch.float32
        for lo in range(0, student_N_V.shape[0], ctx.chunk_size):
            rows = slice(lo, lo + ctx.chunk_size)
            s = student_N_V[rows].float()
            scale = grad_out_N[rows].float().unsqueeze(-1)  # (n, 1)
            out = grad_N_V[rows] if direct else None
            if not saved:
                g = _full_student_grad(s, teacher_N_V[rows].float(), ctx.alpha, scale, out)
            else:
                idx, log_p, log_q, *m_z_r = (x[rows] for x in saved)
                g_buckets = _divergence_grad(log_p, log_q, ctx.alpha).mul_(scale)
                g = _topk_student_grad(s, idx, log_p, g_buckets, tuple(m_z_r) or None, out)
            if not direct:
                grad_N_V[rows] = g
        return grad_N_V, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def per_token_divergence(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    alpha: float = 0.5,
    topk: int | None = None,
    add_tail: bool = True,
    chunk_size: int | None = None,
    overwrite_student: bool = False,
) -> Tensor:
    """Per-token divergence between student and teacher next-token distributions, in nats.

    Args:
        student_logits: (B, T, V), any float dtype; computed in float32.
        teacher_logits: (B, T, V); detached here, never receives gradient.
        alpha: 0 = forward KL(teacher‖student) = Σ p_T(log p_T − log p_S); 1 = reverse
            KL(student‖teacher) = Σ p_S(log p_S − log p_T); in between the generalized JSD
            (1−alpha)·KL(p_S‖M) + alpha·KL(p_T‖M) with M = (1−alpha)·p_S + alpha·p_T. The two ends
            are special-cased (the JSD itself → 0 there).
        topk: None = full vocabulary. k = the k indices with the largest *student* logits; both
            distributions use their true full-softmax probabilities there.
        add_tail: with ``topk``, add one bucket holding 1 − Σ top-k mass for each distribution
            (gradient then reaches all V logits through the normalizer). False = renormalize each
            distribution over the k indices (gradient reaches only those k logits).
        chunk_size: None = plain autograd (saves several (B·T, V) float32 intermediates).
            n = process the B·T rows n at a time with a closed-form, recompute-in-backward
            gradient: extra memory is the (B, T, V) gradient plus O(n × V) temporaries. On CPU,
            keep n × V × 4 bytes under ~32 MB (n = 128 for V = 49152): larger temporaries are
            mmap'ed afresh by the allocator on every chunk and page faults add up. On cores
            shared with other busy processes, run with OMP_WAIT_POLICY=PASSIVE: spin-waiting
            OpenMP threads slow each of the many per-chunk kernels (see
            benchmarks/loss_kernels.py).
        overwrite_student: with ``chunk_size``, backward writes the gradient into the student
            logits' storage (their values are gone afterwards) instead of a new (B, T, V) tensor:
            for logits nothing reads after this loss, such as a row-selected copy. Another
            backward that saved the same logits then raises instead of reading gradients.

    Returns:
        (B, T) float32 per-token values.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits differ in shape: {tuple(student_logits.shape)} vs "
            f"{tuple(teacher_logits.shape)}"
        )
    *lead, vocab = student_logits.shape
    if topk is not None and not 1 <= topk <= vocab:
        raise ValueError(f"topk must be in [1, vocabulary size {vocab}], got {topk}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    if overwrite_student and chunk_size is None:
        raise ValueError("overwrite_student needs chunk_size (only the chunked backward can "
                         "write the gradient into the logits row chunk by row chunk)")
    s_N_V = student_logits.reshape(-1, vocab)
    t_N_V = teacher_logits.detach().reshape(-1, vocab)
    alpha = float(alpha)
    if chunk_size is not None:
        out_N = _ChunkedDivergence.apply(s_N_V, t_N_V, alpha, topk, add_tail, chunk_size,
                                         overwrite_student)
        return out_N.reshape(lead)
    s_N_V, t_N_V = s_N_V.float(), t_N_V.float()
    if topk is None and alpha == 0.0:
        return _forward_kl_full(s_N_V, t_N_V).reshape(lead)
    idx = None if topk is None else s_N_V.detach().topk(topk, dim=-1, sorted=False).indices
    log_p, log_q, _ = _bucket_logprobs(s_N_V, t_N_V, idx, add_tail)
    return _divergence(log_p, log_q, alpha).reshape(lead)


def _forward_kl_full(s_N_V: Tensor, t_N_V: Tensor) -> Tensor:
    """Forward KL(q‖p) over the full vocabulary, (N, V) float32 → (N,), without forming log p.

    With q = softmax(t), p = softmax(s) and log p_v = s_v − lse(s):
    Σ_v q_v (log q_v − log p_v) = Σ_v q_v log q_v − Σ_v q_v s_v + lse(s)·Σ_v q_v, whose
    gradient is ∂/∂s = softmax(s)·Σq − q. The teacher terms carry no gradient, the student
    side is one weighted row sum and one logsumexp, so autograd keeps no (N, V) log-softmax
    and makes a few passes over V where the two log-softmaxes made about a dozen (Σq is
    computed, not assumed 1, so the value is the plain formula's up to rounding).
    """
    with torch.no_grad():
        log_q = F.log_softmax(t_N_V, dim=-1)
        q = log_q.exp()
        neg_entropy = (q * log_q).sum(-1)
        mass = q.sum(-1)
    # Σ_v q_v s_v as an elementwise product and a cascade sum: a BLAS dot product over V was
    # measured ~3e-5 relative off the float64 value at V = 49152.
    cross = (q * s_N_V).sum(-1)
    return neg_entropy - cross + torch.logsumexp(s_N_V, dim=-1) * mass


class _ChunkedLogSumExp(torch.autograd.Function):
    """logsumexp over the last dim of (N, V), in float32, chunk rows at a time.

    Backward writes ∂lse/∂x = softmax(x)·grad_out per chunk into a gradient of x's dtype, so a
    half-precision input never has a full float32 copy alive.
    """

    @staticmethod
    def forward(ctx, x_N_V: Tensor, chunk_size: int) -> Tensor:  # type: ignore[override]
        lse_N = torch.cat(
            [
                torch.logsumexp(x_N_V[lo : lo + chunk_size].float(), dim=-1)
                for lo in range(0, x_N_V.shape[0], chunk_size)
            ]
        )
        ctx.save_for_backward(x_N_V, lse_N)
        ctx.chunk_size = chunk_size
        return lse_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_N: Tensor):  # type: ignore[override]
        x_N_V, lse_N = ctx.saved_tensors
        grad_N_V = torch.empty_like(x_N_V)
        step = ctx.chunk_size
        for lo in range(0, x_N_V.shape[0], step):
            sl = slice(lo, lo + step)
            soft = (x_N_V[sl].float() - lse_N[sl].unsqueeze(-1)).exp_()
            grad_N_V[sl] = soft.mul_(grad_N[sl].unsqueeze(-1))
        return grad_N_V, None


def token_logprobs(logits: Tensor, token_ids: Tensor, *, chunk_size: int | None = None) -> Tensor:
    """log p(token) = logits[token] − logsumexp(logits), in float32.

    Args:
        logits: (B, T, V), any float dtype.
        token_ids: (B, T) int64 indices into V.
        chunk_size: None = one logsumexp over all rows. n = n rows at a time, with a gradient
            written chunk by chunk (no (B·T, V) float32 copy of half-precision logits is kept).

    Returns:
        (B, T) float32 log-probabilities. Formed as gather − logsumexp rather than gathering from
        log_softmax, so autograd never stores a (B, T, V) log_softmax output.
    """
    *lead, vocab = logits.shape
    x_N_V = logits.reshape(-1, vocab)
    picked_N = x_N_V.gather(-1, token_ids.reshape(-1, 1)).squeeze(-1).float()
    if chunk_size is None:
        lse_N = torch.logsumexp(x_N_V.float(), dim=-1)
    else:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
        lse_N = _ChunkedLogSumExp.apply(x_N_V, chunk_size)
    return (picked_N - lse_N).reshape(lead)


def sampled_token_objective(student_logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """Sampled-token estimator ("RL view"): REINFORCE with per-token advantage log p_T − log p_S.

    Args:
        student_logprobs: (B, T) log p_S(y_t) of the tokens the student sampled (with grad).
        teacher_logprobs: (B, T) log p_T(y_t) of the same tokens; detached here.

    Returns:
        (B, T) surrogate. Value: log p_S − log p_T (the one-sample estimate of the reverse KL).
        Gradient w.r.t. the student: −(log p_T − log p_S).detach() · ∇ log p_S.

    Valid only as an estimator of the *reverse* KL(student‖teacher) and only when the tokens were
    sampled from the student: E_{y~p_S}[(log p_S(y) − log p_T(y)) ∇log p_S(y)] = ∇KL(p_S‖p_T)
    because E_{y~p_S}[∇log p_S(y)] = 0. Off-policy tokens need ``importance_weights``.
    """
    advantage = (teacher_logprobs.detach() - student_logprobs.detach()).float()
    # exp(x − x.detach()) is 1 in value with gradient ∇x, so value = −advantage and
    # gradient = −advantage·∇log p_S.
    score = torch.exp(student_logprobs.float() - student_logprobs.detach().float())
    return -advantage * score


def importance_weights(logprobs: Tensor, old_logprobs: Tensor, clip: float = 2.0) -> Tensor:
    """Per-token weights min(exp(log p − log p_old), clip), **detached**.

    (B, T) → (B, T). Multiply per-token losses by them to correct for tokens sampled by an older
    policy (truncated importance sampling); being detached, they rescale the gradient but are not
    themselves optimized.
    """
    return torch.exp(logprobs.detach().float() - old_logprobs.detach().float()).clamp(max=clip)


def masked_mean(values: Tensor, mask: Tensor, count: float | None = None) -> Tensor:
    """Σ values·mask / Σ mask over all entries (a scalar); 0 when the mask is empty.

    ``mask`` is bool or 0/1 (or non-negative weights), broadcastable to ``values``. Masked-out
    entries are excluded with ``where``, so NaN/inf there reaches neither the value nor the
    gradient; an all-masked batch returns 0 with zero (finite) gradient. ``count`` replaces the
    denominator Σ mask (data parallelism: the global count over the world size, so that the
    ranks' averaged gradients equal the one-process gradient).
    """
    weights = mask.to(values.dtype)
    total = torch.where(weights != 0, values * weights, torch.zeros_like(values)).sum()
    if count is None:
        count = weights.expand_as(values).sum()
    else:
        count = torch.as_tensor(count, dtype=values.dtype, device=values.device)
    return total / count.clamp_min(torch.finfo(values.dtype).tiny)


def group_advantages(
    rewards: Tensor, group_size: int, *, eps: float = 1e-6, normalize_std: bool = True
) -> Tensor:
    """GRPO advantages: (r − mean_group) / (std_group + eps), or r − mean_group.

    Args:
        rewards: (N,) with N = groups·group_size, each group contiguous.
        group_size: completions per prompt. With 1, every advantage is 0.
        eps: added to the standard deviation, so a constant group gives 0, not NaN.
        normalize_std: divide by the group's standard deviation (unbiased, as in GRPO/TRL).

    Returns:
        (N,) float32.
    """
    if group_size < 1 or rewards.ndim != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )
    r_G_S = rewards.float().reshape(-1, group_size)
    centred = r_G_S - r_G_S.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred = centred / (r_G_S.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def policy_gradient_objective(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, clip_eps: float = 0.2
) -> Tensor:
    """PPO-clip surrogate to minimize: −min(ratio·A, clip(ratio, 1−ε, 1+ε)·A).

    Args:
        logprobs: (B, T) log p of the sampled tokens under the current policy (with grad).
        old_logprobs: (B, T) under the sampling policy; detached here.
        advantages: (B,) one per sequence, broadcast over T.
        clip_eps: ε.

    Returns:
        (B, T) float32, with ratio = exp(logprobs − old_logprobs). At ratio = 1 (on-policy, one
        step) the gradient is −A·∇log p.
    """
    ratio = torch.exp(logprobs.float() - old_logprobs.detach().float())
    adv_B_1 = advantages.detach().float().unsqueeze(-1)
    unclipped = ratio * adv_B_1
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv_B_1
    return -torch.minimum(unclipped, clipped)
