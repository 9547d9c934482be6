"""The torch side of `opd_step.py`: TRL's distillation update on one fixed batch of already-generated sequences.

"Update" = teacher forward (no grad) + student forward/backward + gradient clipping + AdamW step, the work one
OPD step does after the rollout. Two TRL trainers, each with generation switched off by feeding it a prepared
batch (the same token ids jopd sampled):

- `DistillationTrainer` (TRL's on-policy distillation trainer, chunked generalized JSD over the full vocabulary;
  beta=1 is the reverse KL): its own `compute_loss` on the batch layout its generation step produces, then
  backward, clipping and its optimizer's step. Its generation is not called.
- `GKDTrainer` (experimental) with lmbda=0 (off-policy: no generation) and seq_kd off: its own `training_step`
  (forward of both models, full-logit generalized JSD, backward), then clipping and the optimizer step.

Both run in fp32 (bf16 off: the model pair and jopd's update are fp32) and without gradient checkpointing
(DistillationConfig turns it on by default; off is the faster setting on this CPU). torch uses
`torch.set_num_threads(t)` for each t given; the best is kept. `trl_update_steps` hands back one update
callable per trainer, so `opd_step.py` can interleave them with jopd's update round by round.
"""

from __future__ import annotations

import contextlib
import io as _io
import time
from pathlib import Path

import numpy as np


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def load_model(src: str | Path):
    """transformers LlamaForCausalLM (fp32, eval) from an HF directory or a .gguf file."""
    import torch
    from transformers import AutoModelForCausalLM

    src = Path(src)
    kwargs = {"gguf_file": src.name} if src.is_file() else {}
    with contextlib.redirect_stderr(_io.StringIO()):  # GGUF dequantization progress bars
        model = AutoModelForCausalLM.from_pretrained(str(src.parent if src.is_file() else src),
                                                     dtype=torch.float32, **kwargs)
    return model


def _step(trainer, model, loss_fn, max_grad_norm: float):
    import torch

    model.train()
    loss = loss_fn()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def distillation_trainer_update(teacher, student, tokenizer, prompt_BxP, prompt_mask_BxP, completion_BxN, *,
                                lr: float, max_grad_norm: float, max_steps: int, out_dir: str):
    """A callable running one DistillationTrainer update on the fixed batch (returns the loss)."""
    import torch
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    B, N = completion_BxN.shape
    args = DistillationConfig(output_dir=out_dir, per_device_train_batch_size=B, max_completion_length=N,
                              beta=1.0, temperature=1.0, learning_rate=lr, max_grad_norm=max_grad_norm, bf16=False,
                              gradient_checkpointing=False, use_cpu=True, report_to="none", save_strategy="no",
                              logging_steps=1, seed=0)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, processing_class=tokenizer,
                                  train_dataset=Dataset.from_dict({"prompt": ["1+1="] * B}))
    trainer.create_optimizer_and_scheduler(num_training_steps=max_steps)
    model = trainer.model
    completion_mask = torch.ones((B, N), dtype=torch.long)
    inputs = {"prompt_ids": torch.as_tensor(prompt_BxP, dtype=torch.long),
              "prompt_mask": torch.as_tensor(prompt_mask_BxP, dtype=torch.long),
              "completion_ids": torch.as_tensor(completion_BxN, dtype=torch.long),
              "completion_mask": completion_mask, "num_items_in_batch": completion_mask.sum()}

    def loss_fn():
        loss = trainer.compute_loss(model, inputs)
        trainer.accelerator.backward(loss)
        return loss

    return lambda: _step(trainer, model, loss_fn, max_grad_norm)


def gkd_trainer_update(teacher, student, tokenizer, prompt_BxP, prompt_mask_BxP, completion_BxN, *, lr: float,
                       max_grad_norm: float, max_steps: int, out_dir: str):
    """A callable running one GKDTrainer (lmbda=0) update on the fixed batch (returns the loss)."""
    import torch
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    B, N = completion_BxN.shape
    P = prompt_BxP.shape[1]
    args = GKDConfig(output_dir=out_dir, per_device_train_batch_size=B, lmbda=0.0, seq_kd=False, beta=1.0,
                     temperature=1.0, learning_rate=lr, max_grad_norm=max_grad_norm, bf16=False,
                     gradient_checkpointing=False, use_cpu=True, report_to="none", save_strategy="no",
                     logging_steps=1, seed=0, max_length=P + N)
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"messages": [chat] * B}))
    trainer.create_optimizer_and_scheduler(num_training_steps=max_steps)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's own loop, read by training_step
    model = trainer.model
    ids = torch.as_tensor(np.concatenate([prompt_BxP, completion_BxN], axis=1), dtype=torch.long)
    mask = torch.as_tensor(np.concatenate([prompt_mask_BxP, np.ones_like(completion_BxN)], axis=1),
                           dtype=torch.long)
    labels = ids.clone()
    labels[:, :P] = -100  # loss on the completion only, as its collator labels it

    def loss_fn():
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        return trainer.training_step(model, batch)  # forward, loss, backward (no generation: lmbda=0)

    return lambda: _step(trainer, model, loss_fn, max_grad_norm)


TRAINERS = {"TRL DistillationTrainer": distillation_trainer_update, "TRL GKDTrainer (lmbda=0)": gkd_trainer_update}


def trl_update_steps(teacher_src, student_src, tokenizer, prompt_BxP, prompt_mask_BxP, completion_BxN, *,
                     lr: float, max_grad_norm: float, calib_steps: int, max_steps: int, threads: tuple[int, ...],
                     workdir: str) -> dict[str, dict]:
    """name -> {step, threads, first_s, calib_s: {threads: median s}} or {error}. For each trainer and each
    thread count a fresh student is built, its first update (warm-up) and `calib_steps` more are timed; the
    trainer with the fastest thread count is kept (`step()` runs one more update; call `use_threads(threads)`
    first). On a busy 2-core machine torch's OpenMP pool can be far slower with 2 threads than with 1, so the
    comparison takes TRL's best."""
    import torch

    tokenizer.padding_side = "left"
    arrays = [np.array(x) for x in (prompt_BxP, prompt_mask_BxP, completion_BxN)]  # writable copies for torch
    results = {}
    teacher = load_model(teacher_src).eval()
    for i, (name, make) in enumerate(TRAINERS.items()):
        best = None
        calib = {}
        try:
            for th in threads:
                torch.set_num_threads(th)
                step = make(teacher, load_model(student_src), tokenizer, *arrays, lr=lr, max_grad_norm=max_grad_norm,
                            max_steps=max_steps, out_dir=str(Path(workdir) / f"trl-{i}-{th}"))
                first = timed(step)
                calib[th] = float(np.median([timed(step) for _ in range(calib_steps)]))
                if best is None or calib[th] < calib[best[0]]:
                    best = (th, step, first)
        except Exception as e:  # report why, keep the rest of the benchmark
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            continue
        results[name] = {"step": best[1], "threads": best[0], "first_s": best[2], "calib_s": calib}
    return results


def use_threads(n: int) -> None:
    import torch
    torch.set_num_threads(n)


def trl_version() -> str:
    try:
        import trl
        return trl.__version__
    except ImportError as e:
        return f"not installed ({e})"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run benchmarks/opd_step.py (this module holds its torch/TRL side)")

