"""Triton kernels and their launchers (GPU); imports torch and triton only.

``attention/``: the paged stage 1 (GQA and latent) and the merge; ``gemv/``: one-row products;
``moe/``: expert kernels; ``fused/``: elementwise and sampling kernels. At the top: Triton's
import (``triton_import``), programmatic dependent launch (``pdl``) and offline compilation."""
