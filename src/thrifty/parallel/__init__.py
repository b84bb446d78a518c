"""Beyond one GPU: FSDP2 training of thrifty's models under ``torchrun``, sharded safetensors checkpoints
that load on any number of ranks, and a vocabulary-parallel cut cross-entropy. See NOTES.md."""

from .checkpoint import consolidate, is_sharded_checkpoint, load_sharded, save_sharded
from .fsdp import (RankData, run_with_gathered_head, init_distributed, launched_by_torchrun, mean_over_ranks,
                   mesh_of, mixed_precision, rank_data, shard_model)
from .vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_lm_loss

__all__ = ["shard_model", "init_distributed", "launched_by_torchrun", "mesh_of", "mixed_precision",
           "run_with_gathered_head", "RankData", "rank_data", "mean_over_ranks", "save_sharded", "load_sharded",
           "is_sharded_checkpoint", "consolidate", "vocab_parallel_cross_entropy", "vocab_parallel_lm_loss"]
