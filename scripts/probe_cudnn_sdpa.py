"""What torch's cuDNN and flash SDPA backends do on this GPU for a prefill chunk over a history:
which causal alignment ``is_causal`` takes when the query is shorter than the keys (top-left or
bottom-right), whether grouped K/V heads (``enable_gqa``) run, and whether the log-sum-exp comes
back (``_scaled_dot_product_cudnn_attention(compute_log_sumexp=True)``). Prints one line per check.

Run on a CUDA device: ``python scripts/probe_cudnn_sdpa.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def reference(q, k, v, align: str):
    """float32 attention with a causal mask aligned ``top-left`` or ``bottom-right``; (out, lse)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, 1) for t in (k, v))
    s = q.float() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    lq, lk = q.shape[2], k.shape[2]
    shift = lk - lq if align == "bottom-right" else 0
    visible = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + shift
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def main() -> int:
    torch.manual_seed(0)
    dev = "cuda"
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    lq, lk, d = 256, 1024, 128
    for backend, name in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash")):
        for kv_heads in (32, 8):
            q = torch.randn(1, 32, lq, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, kv_heads, lk, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(1, kv_heads, lk, d, device=dev, dtype=torch.bfloat16)
            try:
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != 32)
            except Exception as exc:  # noqa: BLE001 - a probe reports what fails
                print(f"{name} kv_heads {kv_heads}: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
                continue
            errs = {a: (out.float() - reference(q, k, v, a)[0]).abs().max().item()
                    for a in ("top-left", "bottom-right")}
            print(f"{name} kv_heads {kv_heads} is_causal lq {lq} < lk {lk}: max error vs top-left {errs['top-left']:.3g}, "
                  f"vs bottom-right {errs['bottom-right']:.3g}")
    # the cuDNN op's log-sum-exp, BSHD strided views (the paged cache's row-major layout)
    q = torch.randn(1, lq, 32, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, lk, 32, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(1, lk, 32, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    try:
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)
        s = q.float() @ k.float().transpose(-1, -2) * d ** -0.5
        lse = torch.logsumexp(s, -1)
        print(f"cudnn op unmasked BSHD views: out error {(res[0].float() - torch.softmax(s, -1) @ v.float()).abs().max():.3g}, "
              f"lse shape {tuple(res[1].shape)} error {(res[1].reshape(lse.shape).float() - lse).abs().max():.3g}")
    except Exception as exc:  # noqa: BLE001
        print(f"cudnn op: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
