"""What int8 activations per 32 (the VNNI kernel's, pdserve/kernels/native/int4_gemm.py) cost on
SmolLM2-135M's real projection inputs, beside rounding them to bfloat16.

transformers runs the bundled Q4_1 GGUF file (dequantized, float32) over one prompt; a hook
on every projection takes its input x and, with its float weight W, measures
||(x' - x) W^T|| / ||x W^T|| summed over the 30 layers, for x' = the int8 activations
dequantized and x' = x in bfloat16. Only the activations' rounding: the weights are exact.

    python benchmarks/vnni_int4_activations.py
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch

# benchmarks/kernels.py would shadow the `kernels` package transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from pdserve.kernels.native.int4_gemm import quantize_activations  # noqa: E402
from pdserve.model.default_model import bundled_model  # noqa: E402

PROMPT = ("The sky appears blue because of a process called Rayleigh scattering. Write a short "
          "poem about the ocean, then explain how a CPU cache works and why memory bandwidth "
          "limits decoding.")


def main() -> None:
    path, why = bundled_model()
    if path is None:
        raise SystemExit(f"no bundled GGUF model: {why}")
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    sums = collections.defaultdict(lambda: [0.0, 0.0, 0.0])   # int8 err², bf16 err², |y|²

    def hook(name):
        def record(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()          # [T, K]
            xq, sx, _ = quantize_activations(x)
            x8 = (xq * sx[..., None]).reshape(x.shape).double()
            w, x64 = module.weight.double(), x.double()
            s = sums[name]
            s[0] += ((x8 - x64) @ w.T).norm().item() ** 2
            s[1] += ((x.bfloat16().double() - x64) @ w.T).norm().item() ** 2
            s[2] += (x64 @ w.T).norm().item() ** 2
        return record

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.register_forward_hook(hook(name.rpartition(".")[2]))
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        model(ids)
    print(f"{ids.shape[1]} tokens; relative error of the projection's output, 30 layers")
    print("| projection | int8 per 32 | bfloat16 |")
    print("|---|---|---|")
    for name, (e8, e16, y) in sums.items():
        print(f"| {name} | {(e8 / y) ** 0.5:.2e} | {(e16 / y) ** 0.5:.2e} |")


if __name__ == "__main__":
    main()
