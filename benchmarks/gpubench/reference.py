"""A straightforward SCSE (paper Listing 1) around a plain pre-norm block, and its training step:
the yardstick of the ``throughput`` section."""

from __future__ import annotations


def build_reference(d: int, n_heads: int, d_ff: int, vocab: int, context: int, device):
    """A straightforward SCSE (paper Listing 1) around a plain pre-norm block; forward = loss."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class PreNormBlock(nn.Module):
        """x ↦ G(x): causal attention and SwiGLU, each after RMSNorm; bias-free."""

        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.w12 = nn.Linear(d, 2 * d_ff, bias=False)
            self.w3 = nn.Linear(d_ff, d, bias=False)

        def forward(self, x):
            Bx, Lx, _ = x.shape
            q, k, v = (
                self.qkv(self.n1(x)).view(Bx, Lx, 3, n_heads, d // n_heads).permute(2, 0, 3, 1, 4)
            )
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            a = self.proj(a.transpose(1, 2).reshape(Bx, Lx, d))
            g, u = self.w12(self.n2(x + a)).chunk(2, dim=-1)
            return a + self.w3(F.silu(g) * u)

    def scse_step(h, anchor, core, step_scale=0.5, eps=1e-8):  # Listing 1 (leak 0, no cond)
        delta = h - anchor
        q = step_scale * core(delta)
        active = (delta.pow(2).sum(dim=(1, 2), keepdim=True) > eps).to(q.dtype)
        return anchor + delta + q * active

    class ListingSCSE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(context, d)
            self.anchor_proj = nn.Linear(d, d, bias=False)
            self.init_delta_proj = nn.Linear(d, d, bias=False)
            self.core = PreNormBlock()
            self.norm_f = nn.RMSNorm(d, eps=1e-6)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, ids, targets, loops: int):
            e = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            anchor = e + 0.1 * self.anchor_proj(e)
            h = e + 0.1 * self.init_delta_proj(e)
            for _ in range(loops):
                h = scse_step(h, anchor, self.core)
            logits = F.linear(self.norm_f(h), self.tok.weight)  # (B, L, V)
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return ListingSCSE().to(device)


class RefTrainer:
    """The reference's training step: autocast forward, backward, clip, fused AdamW."""

    def __init__(
        self,
        model,
        device,
        *,
        compile_mode: str,
        lr: float = 3e-4,
        fused: bool | None = None,
        autocast: bool | None = None,
    ) -> None:
        import torch

        self.model, self.device = model, device
        # bf16 autocast: on a GPU by default; on a CPU when asked (as looplm's train.autocast=bf16)
        self.autocast = device.type == "cuda" if autocast is None else autocast
        decay = [p for p in model.parameters() if p.dim() >= 2]
        other = [p for p in model.parameters() if p.dim() < 2]
        fused = device.type == "cuda" if fused is None else fused
        extra = {"fused": True} if fused else {}
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
            lr=lr,
            betas=(0.9, 0.95),
            **extra,
        )
        self.fn = model
        if compile_mode == "block":
            model.core.compile()
        elif compile_mode == "full":
            self.fn = torch.compile(model, dynamic=False)  # one graph per T

    def step(self, x, y, loops: int) -> float:
        import torch

        self.opt.zero_grad(set_to_none=True)
        if self.autocast:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = self.fn(x, y, loops)
        else:
            loss = self.fn(x, y, loops)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach())  # logged every step, as looplm's step does
