"""A transformers.Trainer run on CPU (DDP over gloo under torchrun), recorded by record_trainer.

A two-layer GPT-2 built from a config (nothing downloaded), random token sequences.

    python -m torch.distributed.run --nproc-per-node 2 tests/record/workers/hf_worker.py \
        OUT STEPS SLOW_RANK
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from slowdown import slow_down  # (puts examples/ on sys.path)

from launch import exit_without_finalizing  # noqa: E402  (examples/launch.py)
from stragglers.record.hf_trainer import record_trainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int = 64, vocab: int = 128):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def main(out: str, steps: int, slow_rank: int) -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    if int(os.environ["RANK"]) == slow_rank:
        slow_down(model.transformer.ln_f, 0.08, 0.16)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=steps,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0,
                             disable_tqdm=True, learning_rate=1e-3)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(4 * steps * 2))
    record_trainer(trainer, out + "/trace", flush_interval_s=0.05)
    trainer.train()
    # Shut down in order: the DDP model (it holds the process group and the comm hook) goes
    # before the group. Left to interpreter exit, gloo's threads can abort the process.
    del trainer, model
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    exit_without_finalizing()  # examples/launch.py: no rare gloo abort at shutdown
