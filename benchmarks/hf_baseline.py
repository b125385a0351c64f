"""The Hugging Face ``transformers`` side of the model decode benchmark (``decode_e2e``): the model
built from a config with its own random initialisation, its tensors viewed under segkv's parameter
names (so both models share one set of weights), and greedy ``generate`` timed per variant
(``eager``: dynamic cache; ``static``: static cache; ``compiled``: static cache with
``generate``'s ``torch.compile`` of the decode step). How the timing works is in ``decode_e2e``'s
docstring."""

from __future__ import annotations

import re

import torch

from benchmarks.runs import StepTimes, release, summary

HF_VARIANTS = ("eager", "static", "compiled")
HF_SKIPPED_FORWARDS = 3  # first decode forwards of a generate call left out of its timing
_FUSED = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def hf_tensor(name: str, shape: tuple, hf_state: dict, used: set[str]) -> torch.Tensor:
    """The Hugging Face tensor of segkv parameter ``name``: the same name, or a view of a fused
    expert tensor (``experts.gate_up_proj`` (E, 2I, H) or (E, H, 2I); ``experts.down_proj``)."""
    if name in hf_state and tuple(hf_state[name].shape) == shape:
        used.add(name)
        return hf_state[name]
    match = _FUSED.match(name)
    if match:
        prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
        fused_name = f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}"
        fused = hf_state.get(fused_name)
        if fused is not None:
            used.add(fused_name)
            w = fused[expert]
            out_dim = shape[0]
            if part != "down":
                if w.shape[0] == 2 * out_dim and w.shape[1] == shape[1]:
                    return w[:out_dim] if part == "gate" else w[out_dim:]
                if w.shape[1] == 2 * out_dim and w.shape[0] == shape[1]:
                    return (w[:, :out_dim] if part == "gate" else w[:, out_dim:]).t()
            elif tuple(w.shape) == shape:
                return w
            elif tuple(w.shape) == shape[::-1]:
                return w.t()
            raise ValueError(f"{fused_name} has shape {tuple(fused.shape)}: no {shape} slice for {name}")
    raise ValueError(f"no Hugging Face tensor for segkv parameter {name} {shape}")


def build_hf(cfg: dict, *, device: torch.device, dtype: torch.dtype):
    """The ``transformers`` model of ``cfg`` with its own random initialisation, on ``device``."""
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                                       if k != "model_type"})
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation="sdpa")
    return hf.eval().requires_grad_(False)


def step_clock(device: torch.device):
    """A logits processor marking each time ``generate`` has new logits (CUDA events, no sync)."""
    from transformers import LogitsProcessor

    class StepClock(StepTimes, LogitsProcessor):
        def __call__(self, input_ids, scores):
            self.mark()
            return scores

    return StepClock(device)


def hf_kv_row_bytes(hf, cfg: dict, element_size: int) -> int:
    """Bytes one token takes in Hugging Face's cache (latent rows for MLA where it caches them)."""
    if "kv_lora_rank" in cfg:
        if hasattr(hf.model.layers[0].self_attn, "expand_kv"):
            width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        else:
            width = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
                                                  + cfg["v_head_dim"])
    else:
        width = 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
    return cfg["num_hidden_layers"] * width * element_size


def hf_case_bytes(hf, cfg: dict, *, batch: int, context: int, steps: int, element_size: int) -> int:
    """Estimate of a ``generate`` call's memory beyond the weights: cache and prefill activations."""
    inter = cfg["intermediate_size"]
    wide = cfg.get("num_attention_heads", 0) * 3 * (cfg.get("qk_nope_head_dim", 0) + cfg.get("v_head_dim", 0))
    act = batch * context * element_size * (8 * cfg["hidden_size"] + 3 * inter + wide)
    cache = batch * (context + steps) * hf_kv_row_bytes(hf, cfg, element_size)
    return cache + act + 4 * batch * cfg["vocab_size"] * 4


def hf_reset(hf) -> None:
    """Forget static-cache sizes and caches of earlier calls (each case gets its own size)."""
    for name in ("_previous_max_cache_length", "_cache"):
        if name in hf.__dict__:
            delattr(hf, name)


def hf_case(hf, variant: str, *, device: torch.device, batch: int, context: int, steps: int, trials: int,
            vocab: int, seed: int) -> dict:
    """Greedy ``generate`` timings of one Hugging Face variant (see the module docstring)."""
    from transformers import GenerationConfig, LogitsProcessorList

    kwargs = {"do_sample": False, "num_beams": 1, "pad_token_id": 0, "disable_compile": variant != "compiled"}
    short_warmup = variant == "eager"
    if variant != "eager":
        kwargs["cache_implementation"] = "static"
        if hasattr(GenerationConfig(), "max_cache_len"):  # the same cache shape for a short warm-up
            kwargs["max_cache_len"] = context + steps
            short_warmup = True
    if variant == "compiled":
        for name in ("recompile_limit", "cache_size_limit"):  # never fall back to eager silently
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (batch, context), generator=gen).to(device)

    def generate(ids: torch.Tensor, new: int):
        clock = step_clock(device)
        hf_reset(hf)
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, logits_processor=LogitsProcessorList([clock]), **kwargs)
        if tuple(out.shape) != (batch, ids.shape[1] + new) or len(clock.marks) != new:
            raise RuntimeError(f"generate made {tuple(out.shape)} with {len(clock.marks)} logits steps, "
                               f"expected {(batch, ids.shape[1] + new)} and {new}")
        return clock

    if short_warmup:  # compiles the decode step for the case's cache shape without the long prefill
        generate(prompt[:, : min(context, 64)], HF_SKIPPED_FORWARDS + 1)
    else:
        generate(prompt, steps)
    rates, first = [], []
    for _ in range(trials):
        clock = generate(prompt, steps)
        rates.append(batch * (steps - 1 - HF_SKIPPED_FORWARDS) / clock.seconds(HF_SKIPPED_FORWARDS))
        first.append(clock.seconds(0) - clock.seconds(HF_SKIPPED_FORWARDS))
    result = {**summary(rates), "skipped_forwards_s": first}
    if variant == "compiled":
        result["compiled"] = hasattr(hf, "_compiled_call")
    hf_reset(hf)
    return result


def drop_compiled(hf, device: torch.device) -> None:
    """Forget ``generate``'s compiled decode step and its CUDA graphs (memory of earlier shapes)."""
    if hf is not None:
        for name in ("_compiled_call", "_last_compile_config"):
            hf.__dict__.pop(name, None)
    if device.type == "cuda":
        torch._dynamo.reset()
        try:
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()
        except Exception:  # an older or newer torch without it: the dynamo reset is what matters
            pass
    release(device)
