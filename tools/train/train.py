"""Train the demo model: corpus -> tokenizer -> K3 in PyTorch (CPU) -> released layout.

``python -m tools.train.train --work build/train`` (what ``make train`` runs) does, in order:

1. builds the corpus (:mod:`tools.train.corpus`: code and prose, checked against the committed
   manifest) and the chat transcripts (:mod:`tools.train.chat_data`);
2. fits k3's BPE tokenizer on the training split (:func:`k3core.tokenizer.fit.write_tokenizer`,
   vocabulary :data:`VOCAB`, the Kimi special-token layout) and tokenizes every split once
   (kept under ``WORK/ids``);
3. trains :class:`tools.train.k3torch.K3` of :func:`demo_config` (``--size``, :data:`SIZES`)
   on random windows drawn from code, prose and chat in the ``--mix`` proportions: AdamW,
   warm-up then cosine decay, the router's score-correction bias balanced by bias adjustment
   after every step (no auxiliary loss), and MXFP4 quantisation-aware training of the routed
   experts for the last ``--qat-frac`` of the steps; progress and ETA every ``--log-every``
   steps, the held-out loss on code and on prose every ``--eval-every`` steps, a checkpoint
   every ``--save-every`` steps and on Ctrl-C (``--resume`` continues from it: a run split
   over several sittings equals one run);
4. exports the result in the released layout (:func:`tools.train.released.export`) with the
   tokenizer files, and writes ``train_log.json`` (losses, times) beside it.

Seeds are fixed; with the same torch version and thread count the run repeats.
"""

from __future__ import annotations

import argparse
import hashlib
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
from tools.train import chat_data, corpus
from tools.train.k3torch import K3
from tools.train.released import export

VOCAB = 4096
#: model sizes of the sweep: hidden, layers, MoE latent = expert intermediate, dense/shared
#: intermediate per expert, heads (KDA and MLA)
SIZES = {
    "s128": {"hidden": 128, "layers": 8, "latent": 64, "inter": 128, "heads": 4},
    "s192": {"hidden": 192, "layers": 8, "latent": 96, "inter": 192, "heads": 6},
    "s256": {"hidden": 256, "layers": 8, "latent": 128, "inter": 256, "heads": 8},
}
DEFAULT_SIZE = "s128"
SPLITS = ("train_code", "train_prose", "heldout_code", "heldout_prose")


def demo_config(size: str = DEFAULT_SIZE) -> ModelConfig:
    """The demo model: 8 layers (KDA, MLA at 4, 7, 8), 64 routed experts top-4."""
    z = SIZES[size]
    E, H, lat = z["hidden"], z["heads"], z["latent"]
    flat = {
        "hidden_size": E, "num_hidden_layers": z["layers"], "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5, "kda_num_heads": H, "kda_head_dim": 32,
        "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "num_attention_heads": H,
        "q_lora_rank": E // 2, "kv_lora_rank": E // 4, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_output_gate": True,
        "num_experts": 64, "num_experts_per_token": 4, "num_shared_experts": 2,
        "routed_expert_hidden_size": lat, "moe_intermediate_size": lat,
        "routed_scaling_factor": 1.0, "moe_renormalize": True, "latent_moe_use_norm": True,
        "first_k_dense_replace": 1, "intermediate_size": 2 * z["inter"],
        "attn_res_block_size": 3, "situ_beta": 4.0, "situ_linear_beta": 25.0,
        "full_attn_layers": [4, 7, 8],
    }
    return ModelConfig.from_json_dict(flat, source=f"demo_config({size})")


def spread_windows(ids: np.ndarray, T: int, n: int) -> np.ndarray:
    """``n`` windows of ``T + 1`` ids spread evenly over ``ids`` (the held-out evaluation)."""
    starts = np.linspace(0, len(ids) - T - 2, n).astype(np.int64)
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


def prepare(work: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """Corpus, tokenizer and chat transcripts under ``work``; every split as token ids."""
    cdir = work / "corpus"
    if corpus.main([str(cdir), "--sources", str(work / "sources")]) != 0:
        raise SystemExit(1)
    tok_dir = work / "tokenizer"
    if not (tok_dir / "tiktoken.model").is_file():
        layout = write_tokenizer(tok_dir, VOCAB, corpus=(cdir / "train.txt").read_bytes())
        print(f"tokenizer: {layout.n_ranks} ranks ({layout.corpus_merges} merges from the "
              f"training split), {layout.special_block} special ids", flush=True)
    tok = Tokenizer.from_dir(tok_dir, vocab_size=VOCAB)
    key = hashlib.sha256((tok_dir / "tiktoken.model").read_bytes()).hexdigest()[:16]
    ids_dir = work / "ids" / key
    ids_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, np.ndarray] = {}
    for name in (*SPLITS, "train_chat"):
        f = ids_dir / f"{name}.npy"
        if not f.is_file():
            if name == "train_chat":
                arr = chat_data.build(cdir, tok)
            else:
                arr = np.array(tok.encode_bytes((cdir / f"{name}.txt").read_bytes(),
                                                allow_special=False), dtype=np.int32)
            np.save(f.with_suffix(".tmp.npy"), arr)
            os.replace(f.with_suffix(".tmp.npy"), f)
        out[name] = np.load(f)
    print("tokens: " + ", ".join(f"{k} {len(v):,}" for k, v in out.items()), flush=True)
    return tok_dir, out


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Train the k3 demo model (see module docstring).")
    ap.add_argument("--work", type=Path, default=Path("build/train"))
    ap.add_argument("--out", type=Path, default=Path("demo-model"))
    ap.add_argument("--size", choices=sorted(SIZES), default=DEFAULT_SIZE)
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mix", default="0.55,0.25,0.2",
                    help="the share of windows drawn from code, prose and chat")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--qat-frac", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--no-export", action="store_true", help="train only (the size sweep)")
    ap.add_argument("--bench", type=int, default=0, help="time N steps and stop")
    args = ap.parse_args(argv)
    mix = np.array([float(x) for x in args.mix.split(",")])
    if len(mix) != 3 or (mix < 0).any() or mix.sum() <= 0:
        ap.error("--mix takes three non-negative shares: code,prose,chat")
    mix = mix / mix.sum()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    tok_dir, ids = prepare(work)
    streams = [ids["train_code"], ids["train_prose"], ids["train_chat"]]
    held = {k: spread_windows(ids[f"heldout_{k}"], args.seq, args.eval_windows)
            for k in ("code", "prose")}
    rng = np.random.default_rng(args.seed)

    cfg = demo_config(args.size)
    model = K3(cfg, seed=args.seed)
    n_params = sum(p.numel() for p in model.params.values())
    print(f"model {args.size}: {cfg.describe()}, {n_params:,} parameters", flush=True)
    decay = [p for k, p in model.params.items() if p.dim() >= 2]
    no_decay = [p for k, p in model.params.items() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    ckpt = work / f"checkpoint-{args.size}.pt"
    log: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "params": n_params,
                 "tokens": {k: int(len(v)) for k, v in ids.items()},
                 "evals": [], "losses": [], "seconds": 0.0, "sittings": 0}
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
    log["sittings"] = log.get("sittings", 0) + 1

    def save(step: int) -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": rng,
                    "log": log, "step": step}, tmp)
        os.replace(tmp, ckpt)

    def held_out() -> dict[str, float]:
        return {k: evaluate(model, b) for k, b in held.items()}

    qat_start = int(args.steps * (1 - args.qat_frac))
    tokens_per_step = args.batch * args.seq
    t_start = time.time() - log["seconds"]
    t_sitting, s_sitting = time.time(), step0
    model.train()
    step = step0
    try:
        for step in range(step0, args.steps):
            if step == qat_start and not model.quant:
                log["fp32_heldout"] = held_out()
                model.quant = True
                log["ptq_heldout"] = held_out()
                print(f"step {step}: QAT starts; held-out fp32 {log['fp32_heldout']}, MXFP4 "
                      f"experts (post-training) {log['ptq_heldout']}", flush=True)
            model.quant = step >= qat_start
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
            which = rng.choice(3, size=args.batch, p=mix)
            rows = []
            for w in which:
                s = int(rng.integers(0, len(streams[w]) - args.seq - 1))
                rows.append(streams[w][s : s + args.seq + 1])
            x = torch.from_numpy(np.stack(rows).astype(np.int64))
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
            done = step + 1
            if args.bench and done - step0 >= args.bench:
                print(f"bench: {(time.time() - t_sitting) / args.bench:.3f} s/step", flush=True)
                return 0
            if done % args.log_every == 0:
                rate = (time.time() - t_sitting) / (done - s_sitting)
                print(f"step {done}/{args.steps} loss {np.mean(log['losses'][-args.log_every:]):.4f}"
                      f" lr {opt.param_groups[0]['lr']:.2e} · {tokens_per_step / rate:,.0f} tok/s"
                      f" · {_clock(log['seconds'])} · ETA {_clock(rate * (args.steps - done))}",
                      flush=True)
            if done % args.eval_every == 0 or done == args.steps:
                ev = held_out()
                log["evals"].append({"step": done, "heldout": ev,
                                     "seconds": round(log["seconds"], 1), "qat": model.quant})
                print(f"step {done}: held-out loss code {ev['code']:.4f}, prose "
                      f"{ev['prose']:.4f}", flush=True)
            if done % args.save_every == 0 or done == args.steps:
                save(done)
    except KeyboardInterrupt:
        save(step)
        print(f"\ninterrupted: saved at step {step}; --resume continues", file=sys.stderr)
        return 130
    log["final_heldout"] = log["evals"][-1]["heldout"] if log["evals"] else None
    log["train_seconds"] = log["seconds"]
    (work / f"train_log-{args.size}.json").write_text(json.dumps(log, indent=1) + "\n")
    if args.no_export:
        return 0
    out = export(model, work / "export", extra={"k3_demo": {
        "note": "trained by tools/train/train.py on Python code and English prose "
                "(tools/train/corpus_manifest.json)"}})
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)
    shutil.copy(work / f"train_log-{args.size}.json", out / "train_log.json")
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
