"""A hybridpar checkpoint and its Hugging Face export, both loaded on the device: the time to load
the checkpoint, and the relative error between hybridpar's logits and transformers' on the same
random tokens (float32 both, TF32 off: the export must be exact). One JSON line.

    python -m bench.gpu.hf_logits --checkpoint RUN/checkpoints --hf HF_FOLDER --device cuda
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--hf", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    import hybridpar
    from hybridpar.checkpoint.convert import load_model

    parallel = hybridpar.init_parallel(mp=1)
    device = parallel.device
    start = time.perf_counter()
    model, model_args = load_model(args.checkpoint, parallel, dtype=torch.float32)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    load_s = time.perf_counter() - start
    tokens = torch.randint(0, model_args.vocab_size, (2, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens.to(device), gather_logits=True).float()
    del model

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.hf, torch_dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        theirs = hf(tokens.to(device)).logits.float()
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    print("LOGITS_JSON " + json.dumps({"load_s": load_s, "rel_error": rel, "tokens": list(tokens.shape),
                                       "params": sum(t.numel() for t in hf.parameters())}), flush=True)


if __name__ == "__main__":
    main()
