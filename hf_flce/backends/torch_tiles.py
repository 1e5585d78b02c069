"""Pure-PyTorch tile passes: run on any device, and define the behaviour the kernels must match."""

from __future__ import annotations

import torch

from .base import TileParams, TileStats


class TorchTileOps:
    name = "torch"
    # t (or tanh), p, and one temporary of the same size
    scratch_bytes_per_logit = 12

    def _transform(self, logits: torch.Tensor, params: TileParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the transformed logits ``t`` and, with a softcap, ``tanh(z / softcap)`` for the chain rule."""
        if params.softcap is None:
            if params.inv_temperature == 1.0:
                return logits, None
            return logits * params.inv_temperature, None
        tanh = torch.tanh(logits / params.softcap)
        return tanh * (params.softcap * params.inv_temperature), tanh

    def _row_stats(self, t: torch.Tensor, target: torch.Tensor, params: TileParams):
        valid = target != params.ignore_index
        safe_target = torch.where(valid, target, 0)
        row_max = t.amax(dim=1, keepdim=True)
        # Rows of -inf (or NaN) propagate as stock does; keep finite rows exact.
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = (t - row_max).exp_()
        sum_exp = p.sum(dim=1)
        lse = row_max.squeeze(1) + torch.log(sum_exp)
        p /= sum_exp[:, None]
        target_logit = t.gather(1, safe_target[:, None]).squeeze(1)
        # sum_j p_j t_j as a batched dot product: no [rows, V] temporary
        expected_t = torch.bmm(p.unsqueeze(1), t.unsqueeze(2)).view(-1)
        return valid, safe_target, p, lse, target_logit, expected_t

    def _weights(self, safe_target: torch.Tensor, params: TileParams, like: torch.Tensor):
        if params.class_weight is None:
            return torch.ones_like(like), None
        return params.class_weight[safe_target], params.class_weight_sum

    def forward(self, logits, target, params, grad_scale=None, grad_out=None) -> TileStats:
        t, tanh = self._transform(logits, params)
        valid, safe_target, p, lse, target_logit, expected_t = self._row_stats(t, target, params)
        eps, vocab = params.label_smoothing, params.vocab
        w_y, w_sum = self._weights(safe_target, params, lse)
        loss = (1.0 - eps) * w_y * (lse - target_logit)
        if eps:
            if params.class_weight is None:
                smooth = vocab * lse - t.sum(dim=1)
            else:
                smooth = w_sum * lse - t @ params.class_weight
            loss = loss + (eps / vocab) * smooth
        if params.z_loss:
            loss = loss + params.z_loss * lse.square()
        zero = torch.zeros((), dtype=t.dtype, device=t.device)
        stats = TileStats(
            loss=torch.where(valid, loss, zero),
            lse=torch.where(valid, lse, zero),
            logprob=torch.where(valid, target_logit - lse, zero),
            entropy=torch.where(valid, lse - expected_t, zero),
            is_top1=valid & (t.argmax(dim=1) == target),
            mean_logit=torch.where(valid, t.mean(dim=1), zero),
            log_sum_sq_probs=torch.where(valid, torch.log(torch.linalg.vector_norm(p, dim=1).square()), zero),
        )
        if grad_scale is not None:
            grad_loss = torch.where(valid, grad_scale, zero)
            self._write_grad(t, tanh, p, safe_target, lse, stats.entropy, params, grad_loss, None, None, grad_out)
        return stats

    def backward(self, logits, target, lse, entropy, params, grad_loss, grad_logprob, grad_entropy, grad_out) -> None:
        t, tanh = self._transform(logits, params)
        valid = target != params.ignore_index
        safe_target = torch.where(valid, target, 0)
        zero = torch.zeros((), dtype=t.dtype, device=t.device)
        p = torch.exp(t - lse[:, None]).masked_fill_(~valid[:, None], 0.0)
        masked = [
            None if g is None else torch.where(valid, g.float(), zero) for g in (grad_loss, grad_logprob, grad_entropy)
        ]
        self._write_grad(t, tanh, p, safe_target, lse, entropy, params, *masked, grad_out)

    def _write_grad(
        self, t, tanh, p, safe_target, lse, entropy, params, grad_loss, grad_logprob, grad_entropy, grad_out
    ):
        eps, vocab = params.label_smoothing, params.vocab
        zeros = torch.zeros_like(lse)
        g_loss = zeros if grad_loss is None else grad_loss
        w_y, w_sum = self._weights(safe_target, params, lse)
        # Per-row coefficient of p_j, and the weight of the one-hot target entry (see base.py for the formulas).
        p_coef = g_loss * (1.0 - eps) * w_y
        if eps:
            p_coef = p_coef + g_loss * (eps / vocab) * (vocab if w_sum is None else w_sum)
        if params.z_loss:
            p_coef = p_coef + g_loss * (2.0 * params.z_loss) * lse
        onehot_coef = -g_loss * (1.0 - eps) * w_y
        if grad_logprob is not None:
            p_coef = p_coef - grad_logprob
            onehot_coef = onehot_coef + grad_logprob
        if grad_entropy is not None:
            # -g_H * p_j * (t_j - lse + H): fold the row constant into p_coef, keep the t_j part
            p_coef = p_coef + grad_entropy * (lse - entropy)
            grad = p * (p_coef[:, None] - grad_entropy[:, None] * t)
        else:
            grad = p.mul_(p_coef[:, None])
        grad.scatter_add_(1, safe_target[:, None], onehot_coef[:, None])
        if eps:
            if params.class_weight is None:
                grad -= (g_loss * (eps / vocab))[:, None]
            else:
                grad -= (g_loss * (eps / vocab))[:, None] * params.class_weight[None, :]
        grad *= params.inv_temperature
        if tanh is not None:
            grad *= 1.0 - tanh.square()
        grad_out.copy_(grad)
