"""Train the demo model: corpus -> tokenizer -> K3 in PyTorch (CPU) -> released layout.

``python -m tools.train.train --work build/train`` (what ``make train`` runs) does, in order:

1. builds the corpus (:mod:`tools.train.corpus`, checked against the committed manifest);
2. fits k3's BPE tokenizer on the training split (:func:`k3core.tokenizer.fit.write_tokenizer`,
   vocabulary :data:`VOCAB`, the Kimi special-token layout);
3. trains :class:`tools.train.k3torch.K3` of :func:`demo_config` on random windows of the
   training split: AdamW, warm-up then cosine decay, the router's score-correction bias
   balanced by bias adjustment after every step (no auxiliary loss), and MXFP4
   quantisation-aware training of the routed experts for the last ``--qat-frac`` of the steps;
   a checkpoint every ``--save-every`` steps (``--resume`` continues from it);
4. exports the result in the released layout (:func:`tools.train.released.export`) with the
   tokenizer files, and writes ``train_log.json`` (losses, times) beside it.

Seeds are fixed; with the same torch version and thread count the run repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from k3core.model.config import ModelConfig
from k3core.tokenizer.encoding import Tokenizer
from k3core.tokenizer.fit import write_tokenizer
from tools.train import corpus
from tools.train.k3torch import K3
from tools.train.released import export

VOCAB = 4096


def demo_config() -> ModelConfig:
    """The demo model: 8 layers (KDA, MLA at 4, 7, 8), 64 routed experts top-4, hidden 128."""
    flat = {
        "hidden_size": 128, "num_hidden_layers": 8, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
        "kda_num_heads": 4, "kda_head_dim": 32, "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0, "num_attention_heads": 4, "q_lora_rank": 64,
        "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "mla_use_output_gate": True, "num_experts": 64, "num_experts_per_token": 4,
        "num_shared_experts": 2, "routed_expert_hidden_size": 64, "moe_intermediate_size": 64,
        "routed_scaling_factor": 1.0, "moe_renormalize": True, "latent_moe_use_norm": True,
        "first_k_dense_replace": 1, "intermediate_size": 256, "attn_res_block_size": 3,
        "situ_beta": 4.0, "situ_linear_beta": 25.0, "full_attn_layers": [4, 7, 8],
    }
    return ModelConfig.from_json_dict(flat, source="demo_config")


def windows(ids: np.ndarray, T: int, stride: int) -> np.ndarray:
    starts = np.arange(0, len(ids) - T - 1, stride)
    return np.stack([ids[s : s + T + 1] for s in starts])


@torch.no_grad()
def evaluate(model: K3, batch: np.ndarray, bs: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over the rows of ``batch`` (all positions)."""
    was = model.training
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(batch), bs):
        x = torch.from_numpy(batch[i : i + bs]).long()
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        tot += float(loss)
        n += x[:, 1:].numel()
    model.train(was)
    return tot / n


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def prepare(work: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """Corpus and tokenizer under ``work``; the two splits as token ids."""
    cdir = work / "corpus"
    if corpus.main([str(cdir)]) != 0:
        raise SystemExit(1)
    tok_dir = work / "tokenizer"
    train_bytes = (cdir / "train.txt").read_bytes()
    if not (tok_dir / "tiktoken.model").is_file():
        layout = write_tokenizer(tok_dir, VOCAB, corpus=train_bytes)
        print(f"tokenizer: {layout.n_ranks} ranks ({layout.corpus_merges} merges from the "
              f"training split), {layout.special_block} special ids", flush=True)
    tok = Tokenizer.from_dir(tok_dir, vocab_size=VOCAB)
    train = np.array(tok.encode_bytes(train_bytes, allow_special=False), dtype=np.int64)
    held = np.array(tok.encode_bytes((cdir / "heldout.txt").read_bytes(), allow_special=False),
                    dtype=np.int64)
    print(f"tokens: train {len(train)}, held-out {len(held)}", flush=True)
    return tok_dir, train, held


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Train the k3 demo model (see module docstring).")
    ap.add_argument("--work", type=Path, default=Path("build/train"))
    ap.add_argument("--out", type=Path, default=Path("demo-model"))
    ap.add_argument("--steps", type=int, default=350)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--qat-frac", type=float, default=0.15)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--bench", type=int, default=0, help="time N steps and stop")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    tok_dir, train_ids, held_ids = prepare(work)
    held_batch = windows(held_ids, args.seq, args.seq)[:48]
    rng = np.random.default_rng(args.seed)

    cfg = demo_config()
    model = K3(cfg, seed=args.seed)
    n_params = sum(p.numel() for p in model.params.values())
    print(f"model: {cfg.describe()}, {n_params} parameters", flush=True)
    decay = [p for k, p in model.params.items() if p.dim() >= 2]
    no_decay = [p for k, p in model.params.items() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    ckpt = work / "checkpoint.pt"
    log: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "params": n_params,
                 "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids)),
                 "evals": [], "losses": [], "seconds": 0.0}
    step0 = 0
    if args.resume and ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        rng = state["rng"]
        log = state["log"]
        log["args"] = {k: str(v) for k, v in vars(args).items()}
        step0 = state["step"]
        print(f"resumed at step {step0}", flush=True)
    qat_start = int(args.steps * (1 - args.qat_frac))
    t_start = time.time() - log["seconds"]
    model.train()
    for step in range(step0, args.steps):
        if step == qat_start and not model.quant:
            log["fp32_heldout_loss"] = evaluate(model, held_batch)
            model.quant = True
            log["ptq_heldout_loss"] = evaluate(model, held_batch)
            print(f"step {step}: QAT starts; held-out loss fp32 {log['fp32_heldout_loss']:.4f}, "
                  f"MXFP4 experts (post-training) {log['ptq_heldout_loss']:.4f}", flush=True)
        model.quant = step >= qat_start
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        starts = rng.integers(0, len(train_ids) - args.seq - 1, size=args.batch)
        x = torch.from_numpy(np.stack([train_ids[s : s + args.seq + 1] for s in starts]))
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab),
                                                 x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.balance_router(args.bias_rate)
        log["losses"].append(round(loss.item(), 4))
        log["seconds"] = time.time() - t_start
        if args.bench and step + 1 - step0 >= args.bench:
            print(f"bench: {(time.time() - t_start) / args.bench:.3f} s/step", flush=True)
            return 0
        if (step + 1) % 20 == 0:
            print(f"step {step + 1}/{args.steps} loss {np.mean(log['losses'][-20:]):.4f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} {log['seconds']:.0f}s", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            ev = evaluate(model, held_batch)
            log["evals"].append({"step": step + 1, "heldout_loss": ev,
                                 "seconds": round(log["seconds"], 1), "qat": model.quant})
            print(f"step {step + 1}: held-out loss {ev:.4f}", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": rng,
                        "log": log, "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
    log["final_heldout_loss"] = log["evals"][-1]["heldout_loss"] if log["evals"] else None
    log["train_seconds"] = log["seconds"]
    out = export(model, work / "export", extra={"k3_demo": {
        "note": "trained by tools/train/train.py on the CPython standard library (PSF-2.0)"}})
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)
    (work / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    ship(out, args.out)
    print(f"exported to {out} and copied into {args.out}", flush=True)
    return 0


def ship(export_dir: Path, dest: Path) -> None:
    """Replace the checkpoint files in ``dest`` by the export (the model card stays)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("model-*.safetensors"):
        old.unlink()
    for f in sorted(export_dir.iterdir()):
        shutil.copy(f, dest / f.name)
        os.chmod(dest / f.name, 0o644)


if __name__ == "__main__":
    sys.exit(main())
